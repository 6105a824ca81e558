"""Predicted output length: a running mean per (tenant, prompt-length bucket), kept in Redis.

The FINISH script folds each finished request's real output length into its key's mean and the
prediction's absolute error into an error mean (exponential moving averages, ``estimator_alpha``),
so every replica shares one estimator and it adapts as traffic changes. Until a key has
``estimator_min_samples`` samples the prediction is the request's ``max_tokens``, the safe bound.
"""

from __future__ import annotations

from dataclasses import dataclass


def length_bucket(prompt_tokens: int) -> int:
    """Power-of-two prompt-length buckets: 0 for 1 token, 1 for 2-3, 2 for 4-7, ..."""
    return max(0, prompt_tokens).bit_length() - 1 if prompt_tokens > 0 else 0


def estimator_key(tenant: str, prompt_tokens: int) -> str:
    return f"{tenant}|{length_bucket(prompt_tokens)}"


def estimator_fields(tenant: str) -> list[str]:
    """Every field of the estimator's hash that can hold ``tenant``'s estimates: each prompt-length
    bucket's sample count, mean and error (the FINISH script's ``:n``, ``:mean`` and ``:err``)."""
    return [f"{tenant}|{bucket}{stat}" for bucket in range(64) for stat in (":n", ":mean", ":err")]


@dataclass(frozen=True)
class LengthStats:
    samples: int
    mean: float  # mean output tokens
    abs_error: float  # mean |actual - predicted| tokens

    @classmethod
    def from_fields(cls, samples: str | None, mean: str | None, abs_error: str | None) -> LengthStats | None:
        if samples is None or mean is None:
            return None
        return cls(int(samples), float(mean), float(abs_error or 0.0))


def predict_output(max_tokens: int, stats: LengthStats | None, min_samples: int) -> int:
    if stats is None or stats.samples < min_samples:
        return max_tokens
    return max(1, min(max_tokens, round(stats.mean)))
