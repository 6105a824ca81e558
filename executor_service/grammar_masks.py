"""The structured-output constraint at each step: a grammar matcher per constrained sequence, and
the token bitmask that keeps its row of the logits to the tokens its grammar accepts next.

Only constrained rows are touched: each step fills the bitmask rows of the sequences that have a
matcher (xgrammar's ``fill_next_token_bitmask``, which also says whether anything is masked at all)
and applies them to those rows alone (on the host, rows that allow few tokens are masked whole and
their allowed logits put back; the others through xgrammar's kernel); the other rows, and steps
without a constrained sequence, pay nothing. The mask comes before anything
else changes the logits (penalties, bias, temperature, filters), as in vLLM, so a constrained
request's log probabilities are those of the masked distribution.

A matcher's state is the output so far, and the engine keeps nothing else: a request re-admitted
after a preemption or a migration (it comes back with every token it generated) gets a new matcher
that replays its output (``resume_matcher``), so the constraint continues exactly where it was.
Tokens are never taken back in this engine once sampled, so nothing calls the matchers' rollback.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import xgrammar as xgr

_BITS = torch.arange(32, dtype=torch.int32)
# A row whose grammar allows tokens in at most this share of the bitmask's words is "sparse".
_SPARSE_WORDS = 8


class GrammarBroken(ValueError):
    """A token the grammar does not accept: the output cannot continue under its constraint."""


def resume_matcher(compiled: xgr.CompiledGrammar, output_ids: Sequence[int]) -> xgr.GrammarMatcher:
    """A matcher for ``compiled`` that has accepted ``output_ids`` (a resumed request's output)."""
    matcher = xgr.GrammarMatcher(compiled)
    for i, token in enumerate(output_ids):
        if matcher.is_terminated() or not matcher.accept_token(token):
            raise GrammarBroken(f"output token {i} (id {token}) does not follow the structured output's grammar")
    return matcher


class GrammarMasks:
    """Per engine: the host bitmask buffer, one row per batch row, grown to the widest batch seen."""

    def __init__(self, vocab_size: int) -> None:
        """``vocab_size``: the grammars' vocabulary (``GrammarCache.vocab_size``)."""
        self.vocab_size = vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def _buffer(self, rows: int) -> torch.Tensor:
        if self._bitmask.shape[0] < rows:
            self._bitmask = xgr.allocate_token_bitmask(max(rows, 2 * self._bitmask.shape[0]), self.vocab_size)
        return self._bitmask

    @torch.inference_mode()  # the model's logits are inference tensors
    def apply(self, logits: torch.Tensor, matchers: Sequence[xgr.GrammarMatcher | None]) -> None:
        """Mask ``logits`` [len(matchers), V] in place to what each row's matcher accepts next;
        rows without a matcher are left alone. Ids past the grammar's vocabulary are never accepted."""
        constrained = [i for i, m in enumerate(matchers) if m is not None]
        if not constrained:
            return
        bitmask = self._buffer(len(matchers))
        rows = [i for i in constrained if matchers[i].fill_next_token_bitmask(bitmask, i)]  # type: ignore[union-attr]
        if not rows:
            return
        width = logits.shape[-1]
        covered = min(width, self.vocab_size)
        if logits.device.type == "cpu":
            self._mask_on_host(logits, bitmask, rows, covered)
        else:
            # Pure torch ops on the device: no kernel compiled at run time (xgrammar's default on CUDA is Triton).
            device_mask = bitmask.to(logits.device, non_blocking=True)
            xgr.apply_token_bitmask_inplace(
                logits, device_mask, vocab_size=covered, indices=rows, backend="torch_native"
            )
        if width > covered:
            index = torch.tensor(rows, dtype=torch.long, device=logits.device)
            logits[index, covered:] = -math.inf

    @staticmethod
    def _mask_on_host(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], covered: int) -> None:
        """xgrammar's CPU kernel writes -inf token by token, so its cost grows with the tokens a row
        disallows: a row that allows a few (a key, a literal, a digit) costs the most. Such sparse
        rows (allowed tokens in at most an eighth of the bitmask's words) are instead filled with
        -inf whole, at memset speed, and their few allowed logits put back: the same logits, 3-6x
        faster. The others keep the kernel, which is fast when most tokens are allowed."""
        words = bitmask[rows]
        sparse = (torch.count_nonzero(words, dim=1) <= words.shape[1] // _SPARSE_WORDS).tolist()
        dense_rows = [r for r, s in zip(rows, sparse, strict=True) if not s]
        if dense_rows:
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=covered, indices=dense_rows)
        if len(dense_rows) == len(rows):
            return
        sparse_words = words[torch.tensor(sparse)]
        row, word = sparse_words.nonzero(as_tuple=True)
        which, bit = (((sparse_words[row, word].unsqueeze(-1) >> _BITS) & 1) != 0).nonzero(as_tuple=True)
        tokens = word[which] * 32 + bit
        index = torch.tensor([r for r, s in zip(rows, sparse, strict=True) if s])
        token_rows = index[row[which]]
        kept = tokens < covered
        tokens, token_rows = tokens[kept], token_rows[kept]
        allowed = logits[token_rows, tokens]
        logits.index_fill_(0, index, -math.inf)
        logits[token_rows, tokens] = allowed
