"""Prompt log probabilities: which logits a step keeps for them, and each request's share.

A request that asks (``SamplingParams.prompt_logprobs``) needs the logits of every prompt position
but the last (position q's predict token q + 1; the last one's predict the first output, which the
sampler handles). Its prefill chunks keep those rows (``ModelRunner.run``'s ``leading``), and the
log probabilities of each chunk's positions are gathered as the chunk is computed and joined on
the sequence, until its first output carries them all. Such a request skips the prefix cache, as
in vLLM: a cached block's positions would have no logits. Only a request with no output yet asks
(a resumed one delivered its prompt's already), so its tokens are all prompt.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from common.logprobs import NO_LOGPROBS, Logprobs, unpredicted
from executor_service import token_logprobs
from executor_service.sequence import Sequence
from executor_service.step_scheduler import ScheduledChunk


def rows_wanted(chunk: ScheduledChunk[Sequence]) -> int:
    """How many of the chunk's first positions score the prompt (0 when its request did not ask)."""
    seq = chunk.seq
    if seq.prompt_logprobs is None:
        return 0
    start = seq.num_computed
    return max(0, min(start + chunk.num_tokens, len(seq.prompt_ids) - 1) - start)


def gather(chunks: Seq[ScheduledChunk[Sequence]], leading: Seq[int], logits: torch.Tensor) -> None:
    """Add to each asking sequence the log probabilities of its chunk's positions, from ``logits``
    (the ``leading`` rows of each chunk, in chunk order). Call before the chunks count as computed."""
    asking = [(c.seq, n) for c, n in zip(chunks, leading, strict=True) if c.seq.prompt_logprobs is not None]
    targets: list[int] = []
    for seq, n in asking:
        targets += seq.token_slice(seq.num_computed + 1, seq.num_computed + 1 + n)
    if len(targets) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(targets)} prompt positions")
    vocab = logits.shape[-1]
    rows = None
    if targets:
        width = max(seq.params.prompt_logprobs or 0 for seq, _ in asking)
        rows = token_logprobs.gather(logits, torch.tensor(targets, dtype=torch.long, device=logits.device), width)
    start = 0
    for seq, n in asking:
        count = seq.params.prompt_logprobs or 0
        gathered = seq.prompt_logprobs or NO_LOGPROBS
        if seq.num_computed == 0:  # nothing comes before the first token to predict it
            gathered = unpredicted(seq.prompt_ids[0], min(count, vocab))
        if rows is not None and n:
            gathered = gathered.then(rows.take(start, start + n, count))
        seq.prompt_logprobs = gathered
        start += n


def take(seq: Sequence) -> Logprobs | None:
    """The sequence's prompt log probabilities, once, when its first output goes out."""
    gathered, seq.prompt_logprobs = seq.prompt_logprobs, None
    return gathered
