"""Turns a GenerateRequest into a validated, tokenised NewRequest, or raises InvalidRequest."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence

from common.config import RequestLevelConfig
from common.errors import InvalidRequest
from common.keys import MAX_NAME_CHARS, NAME_ALPHABET, is_safe_name
from common.pb import generate_pb2 as pb
from common.sampling_params import SamplingParams
from common.structured_output import StructuredOutput
from scheduler_service.requests import NewRequest
from scheduler_service.samples import check_samples
from scheduler_service.tokenizer_source import ModelLimits

MAX_STREAM_INTERVAL_TOKENS = 1024
# Biased tokens per request: each costs a little on every step of the request.
MAX_LOGIT_BIAS_ENTRIES = 1024
# Characters of a structured output's schema, expression, grammar or choices: the executor compiles
# it against the whole vocabulary, and Redis keeps it with the request.
MAX_STRUCTURED_OUTPUT_CHARS = 65536
# A cache salt is hashed once at submit; 256 characters hold any random secret (vLLM suggests 43).
MAX_CACHE_SALT_CHARS = 256


def _check_ids(ids: Sequence[int], vocab_size: int, what: str) -> None:
    bad = [t for t in ids if t >= vocab_size]
    if bad:
        raise InvalidRequest(f"{what} has token ids outside the vocabulary (size {vocab_size}): {bad[:5]}")


def bad_words_token_ids(
    words: Sequence[str], encode_word: Callable[[str], list[int]], vocab_size: int
) -> tuple[tuple[int, ...], ...]:
    """The token sequences that spell ``words``, as vLLM bans them: each word as it is, and with one
    leading space (how a tokenizer that marks word starts spells it mid-text) where that is a
    different first token in as many tokens. ``encode_word`` tokenises without special tokens."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(encode_word(word.lstrip()))
        spaced = tuple(encode_word(" " + word.lstrip()))
        if not plain or not spaced:
            raise InvalidRequest(f"bad word {word!r} has no tokens")
        out.append(plain)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    _check_ids([t for word in out for t in word], vocab_size, "bad_words")
    return tuple(dict.fromkeys(out))


def _default_max_tokens(msg: pb.SamplingParams, room: int, limits: ModelLimits, config: RequestLevelConfig) -> int:
    """An unset max_tokens: the server's default, or the context's room where the request asks to
    fill it, capped by the model's generation_config max_new_tokens (as vLLM's server caps it)."""
    default = room if msg.fill_context else min(config.default_max_tokens, room)
    model_cap = limits.sampling_defaults.max_tokens
    return min(default, model_cap) if model_cap else default


def _params(
    msg: pb.SamplingParams,
    prompt_len: int,
    limits: ModelLimits,
    config: RequestLevelConfig,
    encode_word: Callable[[str], list[int]] | None,
) -> SamplingParams:
    """The request's parameters: the checks that need the model or the config here, the value checks
    in ``SamplingParams`` itself. ``encode_word`` tokenises a bad word (None: bad words are refused)."""
    room = limits.max_model_len - prompt_len
    if msg.HasField("max_tokens") and msg.max_tokens == 0 and not msg.HasField("prompt_logprobs"):
        raise InvalidRequest(
            "max_tokens must be at least 1 (leave it unset for the server default; 0 only with prompt_logprobs)"
        )
    if msg.max_tokens > room:
        raise InvalidRequest(
            f"prompt ({prompt_len} tokens) + max_tokens ({msg.max_tokens}) exceeds max_model_len {limits.max_model_len}"
        )
    if msg.stream_interval_tokens > MAX_STREAM_INTERVAL_TOKENS:
        raise InvalidRequest(
            f"stream_interval_tokens must be at most {MAX_STREAM_INTERVAL_TOKENS}, got {msg.stream_interval_tokens}"
        )
    if len(msg.stop) > config.max_stop_strings:
        raise InvalidRequest(f"at most {config.max_stop_strings} stop strings are allowed, got {len(msg.stop)}")
    for stop in msg.stop:
        if not stop or len(stop) > config.max_stop_string_chars:
            raise InvalidRequest(f"stop strings must have 1 to {config.max_stop_string_chars} characters")
    if len(msg.stop_token_ids) > config.max_stop_strings * 4:
        raise InvalidRequest(f"at most {config.max_stop_strings * 4} stop token ids are allowed")
    _check_ids(msg.stop_token_ids, limits.vocab_size, "stop_token_ids")
    if len(msg.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequest(f"logit_bias may name at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(msg.logit_bias)}")
    _check_ids(sorted(msg.logit_bias), limits.vocab_size, "logit_bias")
    if len(msg.allowed_token_ids) > limits.vocab_size:
        raise InvalidRequest(f"allowed_token_ids may name at most the vocabulary's {limits.vocab_size} tokens")
    _check_ids(msg.allowed_token_ids, limits.vocab_size, "allowed_token_ids")
    if len(msg.bad_words) > config.max_bad_words:
        raise InvalidRequest(f"at most {config.max_bad_words} bad words are allowed, got {len(msg.bad_words)}")
    if any(not word.strip() or len(word) > config.max_stop_string_chars for word in msg.bad_words):
        raise InvalidRequest(f"bad words must have 1 to {config.max_stop_string_chars} characters, not only spaces")
    if msg.bad_words and encode_word is None:
        raise InvalidRequest("this call takes no bad_words")
    bad_words = bad_words_token_ids(msg.bad_words, encode_word, limits.vocab_size) if encode_word else ()
    structured = StructuredOutput.from_pb(msg.structured_output) if msg.HasField("structured_output") else None
    if structured is not None and structured.size > MAX_STRUCTURED_OUTPUT_CHARS:
        limit = MAX_STRUCTURED_OUTPUT_CHARS
        raise InvalidRequest(f"structured_output has {structured.size} characters of specification; at most {limit}")
    return SamplingParams(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else _default_max_tokens(msg, room, limits, config),
        temperature=float(msg.temperature),
        top_p=float(msg.top_p) or 1.0,  # proto3's unset 0 means "no top-p"
        top_k=0 if msg.top_k >= limits.vocab_size else int(msg.top_k),  # every token: off, as vLLM reads it
        seed=int(msg.seed) if msg.HasField("seed") else None,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        stream_interval_tokens=int(msg.stream_interval_tokens),
        presence_penalty=float(msg.presence_penalty),
        frequency_penalty=float(msg.frequency_penalty),
        repetition_penalty=float(msg.repetition_penalty) if msg.HasField("repetition_penalty") else 1.0,
        min_tokens=int(msg.min_tokens),
        min_p=float(msg.min_p),
        logit_bias=tuple(msg.logit_bias.items()),
        include_stop_str_in_output=msg.include_stop_str_in_output,
        logprobs=int(msg.logprobs) if msg.HasField("logprobs") else None,
        prompt_logprobs=int(msg.prompt_logprobs) if msg.HasField("prompt_logprobs") else None,
        structured_output=structured,
        skip_special_tokens=msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True,
        allowed_token_ids=tuple(msg.allowed_token_ids),
        bad_words_token_ids=bad_words,
    )


def _kept_prompt_tokens(truncate: int, limits: ModelLimits) -> int:
    """How many of the prompt's last tokens ``truncate_prompt_tokens`` keeps (-1: as many as the model
    takes with room for one output token, as vLLM's -1 means its max_model_len)."""
    if truncate == -1:
        return limits.max_model_len - 1
    if truncate < 1:
        raise InvalidRequest(f"truncate_prompt_tokens must be -1 or >= 1, got {truncate}")
    return truncate


def validate(
    msg: pb.GenerateRequest,
    tokenize: Callable[[str], list[int]],
    limits: ModelLimits,
    config: RequestLevelConfig,
    now_ms: int | None = None,
    render_chat: Callable[[pb.Chat], list[int]] | None = None,
    max_samples: int | None = None,
    encode_word: Callable[[str], list[int]] | None = None,
) -> NewRequest:
    """``tokenize`` gives a text prompt's ids, ``render_chat`` a conversation's (None: conversations
    are refused); each is called only once the prompt's own checks have passed. ``max_samples``
    bounds ``n`` (default: ``config.max_samples``). ``encode_word`` tokenises a bad word without
    special tokens (None: bad words are refused)."""
    now = int(time.time() * 1000) if now_ms is None else now_ms
    request_id = msg.request_id or uuid.uuid4().hex
    # Ids and tenants become parts of Redis keys: their alphabet keeps them from aliasing one.
    if not is_safe_name(request_id):
        raise InvalidRequest(f"request_id must be 1-{MAX_NAME_CHARS} characters of {NAME_ALPHABET}")
    priority = msg.priority if msg.HasField("priority") else config.default_priority
    if priority > config.max_priority:
        raise InvalidRequest(f"priority must lie in [0, {config.max_priority}], got {priority}")
    if msg.tenant and not is_safe_name(msg.tenant):
        raise InvalidRequest(f"tenant must be 1-{MAX_NAME_CHARS} characters of {NAME_ALPHABET}")
    if msg.deadline_ms and msg.deadline_ms <= now:
        raise InvalidRequest(f"deadline_ms {msg.deadline_ms} is in the past (now {now})")
    if len(msg.cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequest(f"cache_salt has {len(msg.cache_salt)} characters; at most {MAX_CACHE_SALT_CHARS}")
    if msg.WhichOneof("input") == "chat":
        if msg.prompt_token_ids:
            raise InvalidRequest("set one input: chat or prompt_token_ids, not both")
        if render_chat is None:
            raise InvalidRequest("this call takes no chat input")
        prompt_ids = render_chat(msg.chat)
    elif msg.prompt:
        if len(msg.prompt) > config.max_prompt_chars:
            raise InvalidRequest(f"prompt has {len(msg.prompt)} characters; at most {config.max_prompt_chars}")
        prompt_ids = tokenize(msg.prompt)
    else:
        prompt_ids = list(msg.prompt_token_ids)
        _check_ids(prompt_ids, limits.vocab_size, "prompt_token_ids")
    if not prompt_ids:
        raise InvalidRequest("prompt is empty: set prompt, prompt_token_ids or chat")
    if msg.params.HasField("truncate_prompt_tokens"):
        prompt_ids = prompt_ids[-_kept_prompt_tokens(msg.params.truncate_prompt_tokens, limits) :]
    if len(prompt_ids) >= limits.max_model_len:
        raise InvalidRequest(f"prompt has {len(prompt_ids)} tokens; max_model_len is {limits.max_model_len}")
    params = _params(msg.params, len(prompt_ids), limits, config, encode_word)
    n = check_samples(msg.params.n, config.max_samples if max_samples is None else max_samples)
    tenant = msg.tenant or "default"
    # A tenant's name cannot hold NUL, so no request's own salt can take another tenant's place.
    salt = f"{tenant}\0{msg.cache_salt}" if config.prefix_cache_per_tenant else msg.cache_salt
    return NewRequest(
        request_id=request_id,
        prompt_ids=tuple(prompt_ids),
        params=params,
        priority=priority,
        tenant=tenant,
        deadline_ms=msg.deadline_ms,
        arrival_ms=now,
        ttft_target_ms=msg.ttft_target_ms,
        n=n,
        cache_salt=salt,
        open_ended=msg.params.fill_context and not msg.params.HasField("max_tokens"),
    )
