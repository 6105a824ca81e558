"""How one request picks and stops its tokens: the one sampling-parameter type of both services.

The scheduler builds it from the public ``baton.v1.SamplingParams`` (``scheduler_service.validation``,
which adds the checks that need the model or the config), keeps it in Redis as JSON, and sends it to
an executor as ``ExecSampling`` (``to_pb``); the executor reads it back with ``from_pb``. The value
checks live here, once, so both sides agree on what a valid request is.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields

from common.errors import InvalidRequest
from common.pb import executor_pb2 as pb

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

    def __post_init__(self) -> None:
        # Callers build this from lists (protobuf repeated fields, JSON); keep the object hashable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequest(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):  # also rejects NaN
            raise InvalidRequest(f"top_p must lie in (0, 1] (0 means 1), got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0, got {self.top_k}")
        if self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not (SEED_MIN <= self.seed <= SEED_MAX):
            raise InvalidRequest(f"seed must fit in 64 bits, got {self.seed}")
        if any(not s for s in self.stop):
            # An empty stop string would match before the first character and end every request at once.
            raise InvalidRequest("stop strings must not be empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequest(f"stop_token_ids must be >= 0, got {self.stop_token_ids}")
        if self.stream_interval_tokens < 0:
            raise InvalidRequest(f"stream_interval_tokens must be >= 0, got {self.stream_interval_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_filter(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0

    # ---- Redis (JSON, never pickle) ------------------------------------------------------
    def to_json(self) -> str:
        # Every field is a number, a string or a tuple of them: a shallow dict is enough
        # (``asdict`` deep-copies, and this runs once per submit).
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)}, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str) -> SamplingParams:
        return cls(**json.loads(raw))

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
        )
        if self.seed is not None:
            msg.seed = self.seed
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
        )
