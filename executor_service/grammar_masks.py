"""The structured-output constraint at each step: a grammar matcher per constrained sequence, and
the token bitmask that keeps its row of the logits to the tokens its grammar accepts next.

Only constrained rows are touched: each step fills the bitmask rows of the sequences that have a
matcher (xgrammar's ``fill_next_token_bitmask``), narrows them to the tokens that keep the output
well-formed UTF-8, which xgrammar's matcher does not ensure (``utf8_vocabulary.py``), and applies
them to those rows alone (on the host with a native kernel, ``kernels/token_mask.c``, about 2 us a
row where xgrammar's takes 25; on a GPU with plain torch ops); the other rows, and steps without a
constrained sequence, pay nothing. The mask comes before anything
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
from dataclasses import dataclass
from typing import cast

import torch
import xgrammar as xgr

from executor_service.kernels import token_mask
from executor_service.utf8_vocabulary import BETWEEN, Utf8Vocabulary

_BITS = torch.arange(32, dtype=torch.int32)
# A row whose grammar allows tokens in at most this share of the bitmask's words is "sparse".
_SPARSE_WORDS = 8


class GrammarBroken(ValueError):
    """A token the grammar does not accept: the output cannot continue under its constraint."""


@dataclass(frozen=True)
class OutputGrammar:
    """A structured output's compiled grammar, with its tokenizer's UTF-8 table (``GrammarCache``)."""

    compiled: xgr.CompiledGrammar
    utf8: Utf8Vocabulary


class OutputMatcher:
    """A constrained output's place in its grammar (xgrammar's matcher) and in its last character
    (the UTF-8 decoder's state after the output's bytes)."""

    __slots__ = ("matcher", "utf8", "utf8_state")

    def __init__(self, grammar: OutputGrammar) -> None:
        self.matcher = xgr.GrammarMatcher(grammar.compiled)
        self.utf8 = grammar.utf8
        self.utf8_state = BETWEEN

    def accept_token(self, token: int) -> bool:
        """Take ``token`` as the output's next; False, and nothing taken, if the grammar refuses it."""
        if not self.matcher.accept_token(token):
            return False
        self.utf8_state = self.utf8.after(self.utf8_state, token)
        return True

    def is_terminated(self) -> bool:
        """Whether the grammar has taken its stop token: the output is complete."""
        return bool(self.matcher.is_terminated())


def resume_matcher(grammar: OutputGrammar, output_ids: Sequence[int]) -> OutputMatcher:
    """A matcher for ``grammar`` that has accepted ``output_ids`` (a resumed request's output)."""
    matcher = OutputMatcher(grammar)
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
    def apply(self, logits: torch.Tensor, matchers: Sequence[OutputMatcher | None]) -> list[int]:
        """Mask ``logits`` [len(matchers), V] in place to what each row's matcher accepts next and
        keeps its output well-formed UTF-8; rows without a matcher are left alone. Ids past the
        grammar's vocabulary are never accepted. Returns the rows whose grammar accepts no token at
        all (a grammar that ran into a dead end, such as a pattern no string matches): nothing is
        left to sample there, and their requests end with an error."""
        present = [(i, m) for i, m in enumerate(matchers) if m is not None]
        if not present:
            return []
        bitmask = self._buffer(len(matchers))
        for i, matcher in present:
            matcher.matcher.fill_next_token_bitmask(bitmask, i)
        rows = [i for i, _ in present]
        self._hold_to_utf8(bitmask, rows, [m.utf8_state for _, m in present], present[0][1].utf8)
        accepting = cast(list[bool], bitmask.numpy()[rows].any(axis=1).tolist())
        width = logits.shape[-1]
        covered = min(width, self.vocab_size)
        if logits.device.type == "cpu":
            if logits.dtype == torch.float32 and token_mask.available():
                token_mask.apply_token_bitmask(logits, bitmask, rows, covered)
            else:
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
        return [row for row, ok in zip(rows, accepting, strict=True) if not ok]

    @staticmethod
    def _hold_to_utf8(bitmask: torch.Tensor, rows: list[int], states: list[int], utf8: Utf8Vocabulary) -> None:
        """Narrow each row to the tokens that continue its output well-formed (one vocabulary per
        engine: every grammar compiles for its tokenizer). A row with nothing left keeps the grammar's
        mask alone, as every xgrammar-based server applies it, rather than reach a dead end. In numpy
        over the host buffer: a few single-threaded microseconds, where torch's small indexed ops wake
        its thread pool (about 0.1 ms each at two threads)."""
        words = bitmask.numpy()
        grammar_words = words[rows]
        narrowed = grammar_words & utf8.allowed_words_np[states]
        dead = ~narrowed.any(axis=1)
        if dead.any():
            narrowed[dead] = grammar_words[dead]
        words[rows] = narrowed

    @staticmethod
    def _mask_on_host(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], covered: int) -> None:
        """Without the native kernel (``kernels/token_mask.c``, a word of 32 tokens at a time, 2-4 us
        a row of 8,192 tokens): xgrammar's CPU kernel writes -inf token by token, so its cost grows
        with the tokens a row disallows: a row that allows a few (a key, a literal, a digit) costs
        the most. Such sparse rows (allowed tokens in at most an eighth of the bitmask's words) are
        instead filled with -inf whole, at memset speed, and their few allowed logits put back: the
        same logits, 3-6x faster. The others keep the kernel, which is fast when most tokens are
        allowed."""
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
