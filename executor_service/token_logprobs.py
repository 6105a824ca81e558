"""Log probabilities of chosen tokens and their top alternatives, gathered on the device in one batch.

The sampler uses it for the generated tokens, ``prompt_logprobs`` for the prompt's: one
``log_softmax`` over the rows that ask, one ``topk`` at the widest count asked for, each chosen
token's rank (vLLM's: how many tokens are at least as likely), and one copy to the host; each
request then takes its own rows and count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.logprobs import Logprobs


@dataclass(frozen=True)
class LogprobRows:
    """Host copies of the gathered rows: row i's chosen token and its ``width`` best alternatives."""

    width: int
    token_ids: list[int]
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    ranks: list[int]

    def take(self, start: int, end: int, num_top: int) -> Logprobs:
        """Rows ``start..end-1`` as one request's run of positions, with its own alternatives count."""
        k = min(num_top, self.width)
        return Logprobs(
            tuple(self.token_ids[start:end]),
            tuple(self.logprobs[start:end]),
            k,
            tuple(t for row in self.top_ids[start:end] for t in row[:k]),
            tuple(x for row in self.top_logprobs[start:end] for x in row[:k]),
            tuple(self.ranks[start:end]),
        )


def gather(logits: torch.Tensor, chosen: torch.Tensor, width: int) -> LogprobRows:
    """For logits [N, V] (raw, any float dtype): the log probability of ``chosen`` [N] in each row,
    its rank, and the ``width`` most likely tokens (at most V), most likely first."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)
    ranks = (logprobs >= chosen_lp.unsqueeze(1)).sum(dim=-1)
    tokens, ranked = torch.stack((chosen.long(), ranks)).tolist()  # one copy to the host for both
    width = min(width, logprobs.shape[-1])
    if width:
        values, ids = torch.topk(logprobs, width, dim=-1)
        return LogprobRows(width, tokens, chosen_lp.tolist(), ids.tolist(), values.tolist(), ranked)
    none: list[list[int]] = [[] for _ in range(logprobs.shape[0])]
    return LogprobRows(0, tokens, chosen_lp.tolist(), none, [[] for _ in none], ranked)
