"""Log probabilities of consecutive tokens: what the executor computes, Redis keeps and the API returns.

One ``Logprobs`` covers a run of positions (a step's new tokens, or the prompt). For each position
it holds the token that is there (the one generated, or the prompt's) with its log probability and
its rank (vLLM's: how many tokens are at least as likely; 0 where unknown), and the ``num_top`` most
likely tokens with theirs, most likely first. The layout is flat and
columnar (``top_ids[i * num_top : (i + 1) * num_top]`` belong to position ``i``), so a run is
sliced and joined without touching its numbers, and it travels as packed arrays: protobuf's packed
repeated fields between executor and scheduler, and one base64 string of little-endian arrays in
a Redis stream entry (``pack`` / ``unpack``), never pickle.

The numbers are those of the model's raw distribution: ``log_softmax`` of its logits before any
penalty, bias, temperature or filter (vLLM's default ``logprobs_mode``, ``raw_logprobs``).
A NaN log probability marks a position nothing predicts: the prompt's first token.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from common.pb import executor_pb2 as pb

# vLLM's and OpenAI's bound on the alternatives per position (OpenAI's top_logprobs is 0-20).
MAX_LOGPROBS = 20

_HEADER = np.dtype("<u4")
_IDS = np.dtype("<u4")
_FLOATS = np.dtype("<f4")


@dataclass(frozen=True)
class Logprobs:
    """Log probabilities at consecutive positions (see the module's docstring for the layout)."""

    token_ids: tuple[int, ...]  # the token at each position
    logprobs: tuple[float, ...]  # its log probability; NaN where nothing predicts it
    num_top: int = 0  # alternatives per position
    top_ids: tuple[int, ...] = ()  # num_top per position, most likely first
    top_logprobs: tuple[float, ...] = ()
    ranks: tuple[int, ...] = ()  # the token's rank at each position, 0 where unknown; () all unknown

    def __post_init__(self) -> None:
        n, k = len(self.token_ids), self.num_top
        if len(self.logprobs) != n or len(self.top_ids) != n * k or len(self.top_logprobs) != n * k:
            raise ValueError(
                f"logprobs of {n} positions need {n} logprobs and {n} x {self.num_top} alternatives, got "
                f"{len(self.logprobs)}, {len(self.top_ids)} and {len(self.top_logprobs)}"
            )
        if not self.ranks:
            object.__setattr__(self, "ranks", (0,) * n)
        elif len(self.ranks) != n:
            raise ValueError(f"logprobs of {n} positions need {n} ranks, got {len(self.ranks)}")

    def __len__(self) -> int:
        return len(self.token_ids)

    @classmethod
    def build(
        cls,
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        top_ids: Sequence[Sequence[int]] = (),
        top_logprobs: Sequence[Sequence[float]] = (),
        ranks: Sequence[int] = (),
    ) -> Logprobs:
        """From per-position lists of alternatives (all of one length)."""
        num_top = len(top_ids[0]) if top_ids else 0
        return cls(
            tuple(token_ids),
            tuple(logprobs),
            num_top,
            tuple(t for row in top_ids for t in row),
            tuple(x for row in top_logprobs for x in row),
            tuple(ranks),
        )

    def top(self, position: int) -> list[tuple[int, float]]:
        """The alternatives at ``position``: (token id, log probability), most likely first."""
        start, end = position * self.num_top, (position + 1) * self.num_top
        return list(zip(self.top_ids[start:end], self.top_logprobs[start:end], strict=True))

    def predicted(self, position: int) -> bool:
        """Whether the model predicted the token at ``position`` (all but the prompt's first)."""
        return not math.isnan(self.logprobs[position])

    def slice(self, start: int, end: int | None = None) -> Logprobs:
        end = len(self) if end is None else end
        k = self.num_top
        return Logprobs(
            self.token_ids[start:end],
            self.logprobs[start:end],
            k,
            self.top_ids[start * k : end * k],
            self.top_logprobs[start * k : end * k],
            self.ranks[start:end],
        )

    def then(self, later: Logprobs) -> Logprobs:
        """These positions followed by ``later``'s (a request's alternatives count never changes)."""
        if not later:
            return self
        if not self:
            return later
        if later.num_top != self.num_top:
            raise ValueError(f"cannot join logprobs with {self.num_top} and {later.num_top} alternatives")
        return Logprobs(
            self.token_ids + later.token_ids,
            self.logprobs + later.logprobs,
            self.num_top,
            self.top_ids + later.top_ids,
            self.top_logprobs + later.top_logprobs,
            self.ranks + later.ranks,
        )

    # ---- Redis: one base64 string of little-endian arrays ----------------------------------
    def pack(self) -> str:
        n = len(self)
        raw = b"".join(
            (
                np.array([n, self.num_top], dtype=_HEADER).tobytes(),
                np.array(self.token_ids, dtype=_IDS).tobytes(),
                np.array(self.logprobs, dtype=_FLOATS).tobytes(),
                np.array(self.top_ids, dtype=_IDS).tobytes(),
                np.array(self.top_logprobs, dtype=_FLOATS).tobytes(),
                np.array(self.ranks, dtype=_IDS).tobytes(),
            )
        )
        return base64.b64encode(raw).decode("ascii")

    @classmethod
    def unpack(cls, text: str) -> Logprobs:
        raw = base64.b64decode(text, validate=True)
        n, k = (int(x) for x in np.frombuffer(raw, dtype=_HEADER, count=2))
        unranked = 8 + 4 * (2 * n + 2 * n * k)  # as written before ranks were kept
        if len(raw) not in (unranked, unranked + 4 * n):
            raise ValueError(f"packed logprobs of {n} x {k} need {unranked + 4 * n} bytes, got {len(raw)}")
        offset = 8
        parts = []
        columns = [(_IDS, n), (_FLOATS, n), (_IDS, n * k), (_FLOATS, n * k)]
        for dtype, count in columns + ([(_IDS, n)] if len(raw) > unranked else []):
            parts.append(np.frombuffer(raw, dtype=dtype, count=count, offset=offset).tolist())
            offset += 4 * count
        ids, lps, top_ids, top_lps, *ranks = parts
        return cls(tuple(ids), tuple(lps), k, tuple(top_ids), tuple(top_lps), tuple(ranks[0]) if ranks else ())

    # ---- the executor -> scheduler wire ----------------------------------------------------
    def to_pb(self) -> pb.TokenLogprobs:
        return pb.TokenLogprobs(
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            num_top=self.num_top,
            top_token_ids=self.top_ids,
            top_logprobs=self.top_logprobs,
            ranks=self.ranks,
        )

    @classmethod
    def from_pb(cls, msg: pb.TokenLogprobs) -> Logprobs:
        return cls(
            tuple(msg.token_ids),
            tuple(msg.logprobs),
            msg.num_top,
            tuple(msg.top_token_ids),
            tuple(msg.top_logprobs),
            tuple(msg.ranks),
        )


NO_LOGPROBS = Logprobs((), ())


def unpredicted(token_id: int, num_top: int) -> Logprobs:
    """The entry of a position nothing predicts (the prompt's first token): NaN, with placeholder
    alternatives that no reader shows (``Logprobs.predicted`` is False there)."""
    return Logprobs((token_id,), (math.nan,), num_top, (0,) * num_top, (math.nan,) * num_top)


def joined_logprobs(earlier: Logprobs | None, later: Logprobs | None) -> Logprobs | None:
    """The log probabilities of two consecutive runs of one request's tokens, either possibly absent."""
    if later is None:
        return earlier
    return later if earlier is None else earlier.then(later)
