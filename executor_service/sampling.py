"""Turns a step's logits into next-token ids, one row per sequence, honouring each request's sampling parameters.

Greedy rows are the hot path and are handled with one batched argmax. Sampled rows share one batched
temperature / min-p / top-k / top-p pipeline, and then draw with their own request's generator: a seeded request
then produces the same tokens whatever else happens to be batched with it. Before either, the rows whose requests
ask for it get their min_tokens mask, logit bias and penalties (``logits_processing``); rows that ask for nothing
keep the plain path.

Log probabilities, for the rows that ask, are those of the raw logits (vLLM's default ``raw_logprobs``): taken
before anything above changes them, and gathered for the chosen token and the top ones in one batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import cast

import torch

from common.logprobs import Logprobs
from common.sampling_params import SamplingParams
from executor_service import token_logprobs
from executor_service.kernels import layer_ops
from executor_service.logits_processing import LogitsProcessing, SamplingRow


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)``; float32 or bfloat16 on the CPU through the native kernel, 2-3x faster
    over a large vocabulary (and bfloat16 logits need no float32 copy first)."""
    if logits.dim() == 2 and layer_ops.available(logits.device, logits.dtype):
        return layer_ops.argmax_rows(logits)
    return logits.argmax(dim=-1)


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A private generator for one request, on the device the logits live on (multinomial needs them to match).

    Without a seed it is seeded from fresh OS randomness, but it is still the request's own stream: sampling
    never touches the global RNG, so other requests' seeded streams are unaffected by it.
    """
    gen = torch.Generator(device=torch.device(device))
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


@dataclass(frozen=True)
class Sampled:
    """One step's choices: a token per row, and its log probabilities where the request asked."""

    on_device: torch.Tensor  # [rows] int64, where the logits were: the next decode step reads them there
    logprobs: list[Logprobs | None]
    # Rows left with no token to sample (``logits_processing.Adjusted.dead``): their tokens mean
    # nothing, and their requests end with an error.
    dead: tuple[int, ...] = ()
    # On CUDA, the tokens' copy to pinned host memory, queued behind the step's work, and the event that
    # marks it done (``copy_to_host``): reading them then waits for this step alone, not for later ones.
    _host_copy: tuple[torch.Tensor, torch.cuda.Event] | None = field(default=None, init=False, repr=False)

    def copy_to_host(self) -> None:
        """Queue the tokens' device-to-host copy now, without waiting for it; nothing to do on the CPU."""
        if self.on_device.device.type != "cuda" or self._host_copy is not None:
            return
        with torch.cuda.device(self.on_device.device):  # the event goes on the stream the copy runs on
            host = torch.empty(self.on_device.shape, dtype=self.on_device.dtype, pin_memory=True)
            host.copy_(self.on_device, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        object.__setattr__(self, "_host_copy", (host, done))

    @cached_property
    def tokens(self) -> list[int]:
        """The tokens on the host: the step's one device-to-host copy of them, made when first asked."""
        if self._host_copy is not None:
            host, done = self._host_copy
            done.synchronize()
            return cast(list[int], host.tolist())
        return cast(list[int], self.on_device.tolist())


class Sampler:
    """One per engine: it holds the penalised requests' token counts (see ``logits_processing``)."""

    def __init__(self, eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.processing = LogitsProcessing(eos_token_ids)

    def release(self, request_id: str) -> None:
        """The request left the batch: forget what sampling kept for it."""
        self.processing.release(request_id)

    @torch.inference_mode()
    def sample_greedy(self, logits: torch.Tensor) -> Sampled:
        """``sample`` for a batch of plain greedy rows (no logprobs, nothing adjusting logits): one argmax,
        with no pass over the rows' parameters."""
        return Sampled(greedy(logits), [None] * logits.shape[0])

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        generators: Sequence[torch.Generator | None],
        stuck: Sequence[int] = (),
    ) -> Sampled:
        """Next tokens for logits of shape [B, V] (changed in place for rows that adjust them);
        ``stuck``: rows already known to have nothing to sample (a grammar's dead end)."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        batch = logits.shape[0]
        if len(rows) != batch or len(generators) != batch:
            raise ValueError(f"got {batch} logit rows, {len(rows)} rows and {len(generators)} generators")
        params = [r.params for r in rows]
        asking = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw = None
        if asking:  # the raw logits, before anything below changes them
            asking_idx = torch.tensor(asking, dtype=torch.long, device=logits.device)
            raw = logits.index_select(0, asking_idx)
        adjusted = self.processing.apply(logits, rows) if any(p.adjusts_logits for p in params) else None
        penalised, dead = (adjusted.penalised, adjusted.dead) if adjusted is not None else (None, [])
        if stuck:
            dead = sorted({*dead, *stuck})
        if dead:  # something to draw from, so the batch's draw cannot fail; the token is never used
            logits[torch.tensor(dead, dtype=torch.long, device=logits.device)] = 0.0
        tokens = self.choose(logits, params, generators)
        if penalised is not None:
            penalised.record(tokens)
        logprobs: list[Logprobs | None] = [None] * batch
        if raw is not None:
            counts = [params[i].logprobs or 0 for i in asking]
            gathered = token_logprobs.gather(raw, tokens.index_select(0, asking_idx), max(counts))
            for row, (i, count) in enumerate(zip(asking, counts, strict=True)):
                logprobs[i] = gathered.take(row, row + 1, count)
        return Sampled(tokens, logprobs, tuple(dead))

    def choose(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> torch.Tensor:
        """Next-token ids (int64, shape [B], on ``logits.device``) for logits of shape [B, V]."""
        batch = logits.shape[0]
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not sampled_rows:
            return greedy(logits)

        out = torch.empty(batch, dtype=torch.long, device=logits.device)
        if len(sampled_rows) < batch:
            sampled = set(sampled_rows)
            greedy_rows = [i for i in range(batch) if i not in sampled]
            greedy_idx = torch.tensor(greedy_rows, dtype=torch.long, device=logits.device)
            out[greedy_idx] = greedy(logits.index_select(0, greedy_idx))
            sampled_idx = torch.tensor(sampled_rows, dtype=torch.long, device=logits.device)
            sampled_logits = logits.index_select(0, sampled_idx)
        else:
            sampled_idx = None
            sampled_logits = logits
        sub_params = [params[i] for i in sampled_rows]
        sub_gens = [generators[i] for i in sampled_rows]
        tokens = self._sample_rows(sampled_logits, sub_params, sub_gens)
        if sampled_idx is None:
            return tokens
        out[sampled_idx] = tokens
        return out

    def _sample_rows(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> torch.Tensor:
        device = logits.device
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        # float32 even for half-precision models: small temperatures would overflow, and top-p sums need precision.
        scaled = logits.to(torch.float32) / temps.unsqueeze(1)
        if any(p.min_p > 0.0 for p in params):
            scaled = self._min_p(scaled, params)
        if any(p.needs_filter for p in params):
            scaled = self._filter(scaled, params)
        probs = torch.softmax(scaled, dim=-1)

        tokens = torch.empty(len(params), dtype=torch.long, device=device)
        # Rows without a generator draw from the global RNG together in one call; a row with its own generator
        # must draw alone, so its stream advances exactly once per step whatever the batch looks like.
        shared = [i for i, g in enumerate(generators) if g is None]
        if shared:
            idx = torch.tensor(shared, dtype=torch.long, device=device)
            tokens[idx] = torch.multinomial(probs.index_select(0, idx), 1).squeeze(1)
        for i, gen in enumerate(generators):
            if gen is not None:
                tokens[i] = torch.multinomial(probs[i], 1, generator=gen)[0]
        return tokens

    @staticmethod
    def _min_p(scaled: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Mask the tokens less likely than min_p times the row's most likely one (vLLM's order:
        after temperature, before top-k and top-p). Rows with min_p 0 keep every token."""
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=scaled.device)
        probs = torch.softmax(scaled, dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
        return scaled.masked_fill(probs < threshold, -math.inf)

    @staticmethod
    def _filter(scaled: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Mask (to -inf) the tokens outside each row's top-k and top-p sets; rows without filters stay unchanged.

        The mask is computed in sorted order but applied in vocabulary order, so the draw itself always happens
        over the same vocabulary-ordered distribution whether or not another row in the batch needed sorting.
        """
        device = scaled.device
        vocab = scaled.shape[-1]
        # Stable sort: ties are ordered by token id, so the kept set does not depend on the batch.
        sorted_logits, sorted_idx = torch.sort(scaled, dim=-1, descending=True, stable=True)

        # Top-k keeps every token at least as likely as the k-th, ties included (as vLLM and
        # transformers cut): with bfloat16 logits, ties at the cut are common.
        top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=device)
        kth = sorted_logits.gather(1, (top_k - 1).unsqueeze(1))
        remove = sorted_logits < kth

        # Rows without top-p get an unreachable threshold: rounding can push the running mass to 1.0 before the
        # tail, and trimming those tail tokens would make such a row's distribution depend on its batch-mates.
        top_p = torch.tensor(
            [p.top_p if p.top_p < 1.0 else math.inf for p in params], dtype=torch.float32, device=device
        )
        sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, -math.inf), dim=-1)
        # Mass strictly before each token: drop a token once the tokens ahead of it already reach p. The first
        # token has zero mass ahead of it and is always kept, so at least one token survives.
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        remove |= mass_before >= top_p.unsqueeze(1)
        remove[:, 0] = False

        mask = torch.zeros_like(remove).scatter_(-1, sorted_idx, remove)
        return scaled.masked_fill(mask, -math.inf)
