"""The sampling settings a model's ``generation_config.json`` recommends.

vLLM's OpenAI server applies them to whatever a request leaves out (its ``--generation-config
auto``, the default since 0.8): a chat model tuned to sample at temperature 0.6 and top-p 0.9 then
does so for a client that sends neither. Baton's gateway does the same. The executor reads them
from the model it loaded and registers them; the scheduler hands them out with ``ModelInfo``.

Which settings, as in vLLM: temperature, top_p, top_k, min_p, repetition_penalty, and
max_new_tokens (as max_tokens: the scheduler caps an output whose max_tokens is left unset by
it, for gRPC clients too, since only it knows the prompt's length), each only where the file sets
it (``GenerationConfig.to_diff_dict``, as vLLM reads it).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from common.pb import generate_pb2 as pb

_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty")
_INTS = ("top_k", "max_tokens")


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # generation_config's max_new_tokens

    @classmethod
    def of_generation_config(cls, config: Any) -> SamplingDefaults:
        """From a transformers ``GenerationConfig`` (None: the model has none)."""
        if config is None:
            return cls()
        diff = config.to_diff_dict()
        return cls.from_mapping({**diff, "max_tokens": diff.get("max_new_tokens")})

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> SamplingDefaults:
        """The settings in ``values`` that are well formed; the rest are left unset."""
        kept: dict[str, Any] = {}
        for name in _FLOATS:
            value = values.get(name)
            if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                kept[name] = float(value)
        for name in _INTS:
            value = values.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**32:
                kept[name] = value
        return cls(**kept)

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> SamplingDefaults:
        """As ``to_json`` wrote it; anything malformed (a record in Redis is anyone's) counts as none."""
        try:
            values = json.loads(text)
        except (ValueError, RecursionError):
            return cls()
        return cls.from_mapping(values) if isinstance(values, dict) else cls()

    def to_pb(self) -> pb.SamplingDefaults:
        return pb.SamplingDefaults(**{f.name: getattr(self, f.name) for f in fields(self)})
