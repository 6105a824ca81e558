"""How one request picks and stops its tokens: the one sampling-parameter type of both services.

The scheduler builds it from the public ``baton.v1.SamplingParams`` (``scheduler_service.validation``,
which adds the checks that need the model or the config), keeps it in Redis as JSON, and sends it to
an executor as ``ExecSampling`` (``to_pb``); the executor reads it back with ``from_pb``. The value
checks live here, once, so both sides agree on what a valid request is.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields

from common.errors import InvalidRequest
from common.logprobs import MAX_LOGPROBS
from common.pb import executor_pb2 as pb
from common.structured_output import StructuredOutput

# A positive temperature below this one samples at this one, as vLLM raises it (its _MAX_TEMP), and
# only 0 is greedy: dividing logits by a tinier one reached float32's range (a NaN softmax).
LEAST_TEMPERATURE = 0.01
# A smaller repetition penalty counts as this one. Dividing a logit by a tiny penalty (and then by a
# temperature) overflowed float32: the softmax was NaN and multinomial failed the whole step. With
# both at least 1e-5 and bias within +-100, every adjusted logit stays finite, so nothing has to be
# checked per step; a penalty this small already puts nearly all the mass on the repeated tokens.
LEAST_REPETITION_PENALTY = 1e-5
# And a larger one as this one: multiplying a negative logit by a huge penalty reached -inf, and a
# request whose every allowed token had been seen had a row of -inf (sampled: NaN, the step failed;
# greedy: token 0, allowed or not). A penalty this large already makes a seen token all but unlikely.
GREATEST_REPETITION_PENALTY = 1e5
# torch.Generator.manual_seed accepts exactly this range (negative values wrap around).
SEED_MIN = -(1 << 63)
SEED_MAX = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """Validated sampling and stopping parameters. Invalid values raise InvalidRequest (a ValueError)."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # How the client takes its output (tokens per chunk; 0: the server's interval). The scheduler's
    # stream batching reads it; sampling does not, and it does not travel to executors.
    stream_interval_tokens: int = 0
    # OpenAI's penalties on the output so far: presence once per distinct token, frequency per
    # occurrence (subtracted from the logits). 0 is off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Hugging Face's, on prompt and output tokens: positive logits divided by it, negative ones
    # multiplied. 1 is off.
    repetition_penalty: float = 1.0
    # Stopping (EOS, stop_token_ids, stop strings) waits until the output holds this many tokens.
    min_tokens: int = 0
    # Drop tokens less likely than min_p times the most likely one (after temperature). 0 is off.
    min_p: float = 0.0
    # (token id, bias) pairs, by id, added to the logits.
    logit_bias: tuple[tuple[int, float], ...] = ()
    include_stop_str_in_output: bool = False
    # Alternatives per position for the output's and the prompt's log probabilities; None: none.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # The form the output must take (a grammar masks the logits at every step); None: free text.
    structured_output: StructuredOutput | None = None
    # Whether special tokens' text is left out of the output text (their ids are returned either way).
    skip_special_tokens: bool = True
    # Only these token ids may be sampled (sorted, distinct); empty: any.
    allowed_token_ids: tuple[int, ...] = ()
    # Token sequences the output must not complete (the request's bad_words, tokenised by the
    # scheduler): the last token of each is masked where the output ends with the rest.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # Derived once: the sampler asks every row of every step whether its logits need adjusting.
    adjusts_logits: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Callers build this from lists (protobuf repeated fields, JSON); keep the object hashable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = tuple(sorted((int(t), float(b)) for t, b in self.logit_bias))
        object.__setattr__(self, "logit_bias", bias)
        object.__setattr__(self, "allowed_token_ids", tuple(sorted({int(t) for t in self.allowed_token_ids})))
        object.__setattr__(self, "bad_words_token_ids", tuple(tuple(map(int, w)) for w in self.bad_words_token_ids))
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequest(f"temperature must be a finite number >= 0, got {self.temperature}")
        if 0 < self.temperature < LEAST_TEMPERATURE:
            object.__setattr__(self, "temperature", LEAST_TEMPERATURE)
        if not (0.0 < self.top_p <= 1.0):  # also rejects NaN
            raise InvalidRequest(f"top_p must lie in (0, 1] (0 means 1), got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0, got {self.top_k}")
        if self.max_tokens < 1 and not (self.max_tokens == 0 and self.prompt_logprobs is not None):
            # 0 only scores the prompt, which needs prompt_logprobs to say anything.
            raise InvalidRequest(f"max_tokens must be >= 1 (0 only with prompt_logprobs), got {self.max_tokens}")
        if self.seed is not None and not (SEED_MIN <= self.seed <= SEED_MAX):
            raise InvalidRequest(f"seed must fit in 64 bits, got {self.seed}")
        if any(not s for s in self.stop):
            # An empty stop string would match before the first character and end every request at once.
            raise InvalidRequest("stop strings must not be empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequest(f"stop_token_ids must be >= 0, got {self.stop_token_ids}")
        if self.stream_interval_tokens < 0:
            raise InvalidRequest(f"stream_interval_tokens must be >= 0, got {self.stream_interval_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:  # also rejects NaN
                raise InvalidRequest(f"{name} must lie in [-2, 2], got {value}")
        if not (0.0 < self.repetition_penalty < math.inf):
            raise InvalidRequest(f"repetition_penalty must be finite and > 0 (1 is off), got {self.repetition_penalty}")
        if self.repetition_penalty < LEAST_REPETITION_PENALTY:
            object.__setattr__(self, "repetition_penalty", LEAST_REPETITION_PENALTY)
        if self.repetition_penalty > GREATEST_REPETITION_PENALTY:
            object.__setattr__(self, "repetition_penalty", GREATEST_REPETITION_PENALTY)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest(f"min_tokens must lie in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest(f"min_p must lie in [0, 1], got {self.min_p}")
        ids = [t for t, _ in self.logit_bias]
        if len(set(ids)) != len(ids) or any(t < 0 for t in ids):
            raise InvalidRequest("logit_bias must map distinct token ids >= 0 to biases")
        if any(not -100.0 <= b <= 100.0 for _, b in self.logit_bias):
            raise InvalidRequest("logit_bias values must lie in [-100, 100]")
        for name in ("logprobs", "prompt_logprobs"):
            count = getattr(self, name)
            if count is not None and not 0 <= count <= MAX_LOGPROBS:
                raise InvalidRequest(f"{name} must lie in [0, {MAX_LOGPROBS}], got {count}")
        if any(t < 0 for t in self.allowed_token_ids):
            raise InvalidRequest("allowed_token_ids must be token ids >= 0")
        if any(not word or min(word) < 0 for word in self.bad_words_token_ids):
            raise InvalidRequest("bad words must be non-empty sequences of token ids >= 0")
        # Whether anything changes this request's logits before the choice (penalties, bias,
        # min_tokens, banned tokens).
        adjusts = self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0 or self.bans_tokens
        object.__setattr__(self, "adjusts_logits", adjusts)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_filter(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0

    @property
    def bans_tokens(self) -> bool:
        """Whether the request itself excludes tokens (allowed_token_ids, bad words): with a grammar
        or min_tokens beside them, a step may be left with nothing to sample."""
        return bool(self.allowed_token_ids) or bool(self.bad_words_token_ids)

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    # ---- Redis (JSON, never pickle) ------------------------------------------------------
    def to_json(self) -> str:
        # Every other field is a number, a string or a tuple of them: a shallow dict is enough
        # (``asdict`` deep-copies, and this runs once per submit).
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        if self.structured_output is not None:
            out["structured_output"] = self.structured_output.to_dict()
        return json.dumps(out, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str) -> SamplingParams:
        values = json.loads(raw)
        structured = values.get("structured_output")
        if structured is not None:
            values["structured_output"] = StructuredOutput.from_dict(structured)
        return cls(**values)

    # ---- the scheduler -> executor wire --------------------------------------------------
    def to_pb(self) -> pb.ExecSampling:
        msg = pb.ExecSampling(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=list(self.stop),
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens,
            min_p=self.min_p,
            logit_bias=dict(self.logit_bias),
            include_stop_str_in_output=self.include_stop_str_in_output,
            keep_special_tokens=not self.skip_special_tokens,
            allowed_token_ids=list(self.allowed_token_ids),
            bad_words=[pb.TokenIds(token_ids=word) for word in self.bad_words_token_ids],
        )
        if self.seed is not None:
            msg.seed = self.seed
        if self.logprobs is not None:
            msg.logprobs = self.logprobs
        if self.prompt_logprobs is not None:
            msg.prompt_logprobs = self.prompt_logprobs
        if self.structured_output is not None:
            msg.structured_output.CopyFrom(self.structured_output.to_pb())
        return msg

    @classmethod
    def from_pb(cls, msg: pb.ExecSampling) -> SamplingParams:
        return cls(
            max_tokens=msg.max_tokens,
            temperature=msg.temperature,
            top_p=msg.top_p,
            top_k=msg.top_k,
            seed=msg.seed if msg.HasField("seed") else None,
            stop=tuple(msg.stop),
            stop_token_ids=tuple(msg.stop_token_ids),
            ignore_eos=msg.ignore_eos,
            presence_penalty=msg.presence_penalty,
            frequency_penalty=msg.frequency_penalty,
            repetition_penalty=msg.repetition_penalty or 1.0,  # proto3's unset 0 means "off"
            min_tokens=msg.min_tokens,
            min_p=msg.min_p,
            logit_bias=tuple(msg.logit_bias.items()),
            include_stop_str_in_output=msg.include_stop_str_in_output,
            logprobs=msg.logprobs if msg.HasField("logprobs") else None,
            prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
            structured_output=StructuredOutput.from_pb(msg.structured_output),
            skip_special_tokens=not msg.keep_special_tokens,
            allowed_token_ids=tuple(msg.allowed_token_ids),
            bad_words_token_ids=tuple(tuple(word.token_ids) for word in msg.bad_words),
        )
