"""What a request changes in its logits before its token is chosen: allowed_token_ids, bad words,
min_tokens, logit_bias and the repetition, frequency and presence penalties.

Applied in place, in vLLM's order (the tokens outside allowed_token_ids and those that would
complete a bad word masked, stop tokens masked for min_tokens, then the bias, then the penalties),
to the rows of the requests that ask, each kind as a few tensor operations over all of its rows at
once; rows that ask for nothing are never touched. Temperature, min-p, top-k and top-p come after,
in the sampler.

The penalties depend on the tokens a request holds so far. Rather than counting every token again
at each step, ``PenaltyTable`` keeps one row per penalised request on the device: how many times
each token occurs in its output, and whether its prompt or output holds it. A row is built from
the sequence's prompt and whole output the first time the request is sampled here, so a request
re-admitted after a preemption or a migration (it comes back with every token it generated)
gets exactly the counts it would have had, and is updated with each token sampled after.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from common.sampling_params import SamplingParams


class SamplingRow(Protocol):
    """What sampling reads of one sequence (``executor_service.sequence.Sequence`` is one)."""

    @property
    def request_id(self) -> str: ...

    @property
    def prompt_ids(self) -> Sequence[int]: ...

    @property
    def output_ids(self) -> Sequence[int]: ...

    @property
    def params(self) -> SamplingParams: ...


class PenaltyTable:
    """Per penalised request, on the device: its output token counts and its prompt+output token set."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._counts = torch.zeros(0, vocab_size, dtype=torch.float32, device=device)
        self._seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self._slots: dict[str, int] = {}
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self._slots)

    def slot(self, row: SamplingRow) -> int:
        """The request's row, built from its prompt and output on first use."""
        slot = self._slots.get(row.request_id)
        if slot is not None:
            return slot
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self._slots[row.request_id] = slot
        vocab = self.vocab_size
        output = torch.tensor([t for t in row.output_ids if t < vocab], dtype=torch.long, device=self.device)
        self._counts[slot].zero_().index_add_(0, output, torch.ones_like(output, dtype=torch.float32))
        seen = self._seen[slot].zero_()
        seen[torch.tensor([t for t in row.prompt_ids if t < vocab], dtype=torch.long, device=self.device)] = True
        seen[output] = True
        return slot

    def _grow(self) -> None:
        # Doubling: a table sized for the most penalised requests at once, allocated a few times.
        old = self._counts.shape[0]
        new = max(4, 2 * old)
        counts = torch.zeros(new, self.vocab_size, dtype=torch.float32, device=self.device)
        seen = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
        counts[:old] = self._counts
        seen[:old] = self._seen
        self._counts, self._seen = counts, seen
        self._free.extend(range(new - 1, old - 1, -1))

    def release(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def apply(
        self, logits: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, params: list[SamplingParams]
    ) -> None:
        """Penalise ``logits[rows]`` in place with the requests' counts (``slots``) and ``params``."""
        device = logits.device
        sub = logits.index_select(0, rows)
        counts = self._counts.index_select(0, slots)
        repetition = [p.repetition_penalty for p in params]
        if any(r != 1.0 for r in repetition):
            # Hugging Face's RepetitionPenaltyLogitsProcessor, over the prompt and the output.
            rep = torch.tensor(repetition, dtype=sub.dtype, device=device).unsqueeze(1)
            penalised = torch.where(sub > 0, sub / rep, sub * rep)
            sub = torch.where(self._seen.index_select(0, slots), penalised, sub)
        frequency = [p.frequency_penalty for p in params]
        if any(frequency):
            sub = sub - torch.tensor(frequency, dtype=sub.dtype, device=device).unsqueeze(1) * counts
        presence = [p.presence_penalty for p in params]
        if any(presence):
            sub = sub - torch.tensor(presence, dtype=sub.dtype, device=device).unsqueeze(1) * (counts > 0)
        logits.index_copy_(0, rows, sub)

    def record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """The requests at ``slots`` generated ``tokens``."""
        self._counts.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.float32), accumulate=True)
        self._seen[slots, tokens] = True


class Penalised:
    """The rows one ``apply`` penalised: the tokens chosen for them must be counted."""

    def __init__(self, table: PenaltyTable, rows: torch.Tensor, slots: torch.Tensor) -> None:
        self._table, self._rows, self._slots = table, rows, slots

    @torch.inference_mode()
    def record(self, tokens: torch.Tensor) -> None:
        """``tokens`` [batch] were chosen from the penalised logits: count those of these rows."""
        self._table.record(self._slots, tokens.index_select(0, self._rows))


@dataclass(frozen=True)
class Adjusted:
    """What one ``LogitsProcessing.apply`` leaves the sampler: the penalised rows, whose chosen
    tokens must be counted (None: none), and the rows left with no token to sample."""

    penalised: Penalised | None
    dead: list[int]


class LogitsProcessing:
    """Per engine: the penalty table and the requests' stop tokens (for min_tokens)."""

    def __init__(self, eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.eos_token_ids = tuple(sorted(eos_token_ids))
        self.table: PenaltyTable | None = None  # made on first use, at the logits' width and device
        # Per request that adjusts its logits: its token lists as tensors on the device and its bad
        # words indexed, made once rather than walked at every step (``_Request``).
        self._requests: dict[str, _Request] = {}

    def release(self, request_id: str) -> None:
        """The request left the batch (finished, preempted, aborted, re-admitted): free its row."""
        if self.table is not None:
            self.table.release(request_id)
        self._requests.pop(request_id, None)

    @torch.inference_mode()  # the model's logits are inference tensors, and so is the table
    def apply(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> Adjusted:
        """Change ``logits`` [len(rows), vocab] in place for the rows whose requests ask; the
        penalised rows, whose chosen tokens ``record`` must then count, and the rows left with no
        token to sample (``Adjusted``)."""
        vocab = logits.shape[-1]
        device = logits.device
        masked: tuple[list[int], list[int]] = ([], [])
        biasing: list[int] = []
        penalised: list[int] = []
        allowing: list[int] = []
        # Rows whose grammar's mask something here narrows further (bans, min_tokens' stops): read
        # on the device for whether any token is left.
        narrowed_grammar: list[int] = []
        for i, row in enumerate(rows):
            params = row.params
            if not params.adjusts_logits:
                continue
            if params.bans_tokens or params.logit_bias:  # only these read the request's made tensors
                request = self._request(row, vocab, device)
                if params.allowed_token_ids:
                    allowing.append(i)
                for token in request.bad_words.completing(row.output_ids):
                    if token < vocab:
                        masked[0].append(i)
                        masked[1].append(token)
            holding = len(row.output_ids) < params.min_tokens
            if params.structured_output is not None and (params.bans_tokens or holding):
                # A complete form may allow nothing but EOS, which min_tokens masks.
                narrowed_grammar.append(i)
            if holding:
                # vLLM's MinTokensLogitsProcessor: no stop token until the whole output is long enough,
                # EOS included even where it does not stop the request (ignore_eos), as vLLM and
                # transformers' MinNewTokensLengthLogitsProcessor mask it.
                for token in params.stop_token_ids + self.eos_token_ids:
                    if token < vocab:
                        masked[0].append(i)
                        masked[1].append(token)
            if params.logit_bias:
                biasing.append(i)
            if params.has_penalties:
                penalised.append(i)
        if allowing:
            # Keep the allowed logits, set the whole rows to -inf, put the kept ones back: one pass
            # over each row and two over its allowed ids, where a mask over the vocabulary cost
            # several passes (a 150K vocabulary at 64 rows: 39 ms a step).
            row_ids, col_ids = self._cells(rows, allowing, lambda r: r.allowed, device)
            kept = logits[row_ids, col_ids]
            logits.index_fill_(0, torch.tensor(allowing, dtype=torch.long, device=device), -math.inf)
            logits.index_put_((row_ids, col_ids), kept)
        if masked[0]:
            index = torch.tensor(masked, dtype=torch.long, device=device)
            logits[index[0], index[1]] = -math.inf
        if biasing:
            row_ids, col_ids = self._cells(rows, biasing, lambda r: r.bias_ids, device)
            values = torch.cat([self._requests[rows[i].request_id].bias_values for i in biasing]).to(logits.dtype)
            logits.index_put_((row_ids, col_ids), values, accumulate=True)
        # Bias and penalties leave -inf as it is.
        dead = self._dead_rows(logits, rows, allowing, narrowed_grammar, masked)
        if not penalised:
            return Adjusted(None, dead)
        table = self._table(vocab, device)
        slots = [table.slot(rows[i]) for i in penalised]
        index = torch.tensor([penalised, slots], dtype=torch.long, device=device)
        table.apply(logits, index[0], index[1], [rows[i].params for i in penalised])
        return Adjusted(Penalised(table, index[0], index[1]), dead)

    def _request(self, row: SamplingRow, vocab: int, device: torch.device) -> _Request:
        request = self._requests.get(row.request_id)
        if request is None or request.vocab != vocab or request.allowed.device != device:
            request = self._requests[row.request_id] = _Request.of(row.params, vocab, device)
        return request

    def _cells(
        self,
        rows: Sequence[SamplingRow],
        which: list[int],
        tokens: Callable[[_Request], torch.Tensor],
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The (row, token) cells of the rows ``which`` for each one's ``tokens``, as index tensors."""
        columns = [tokens(self._requests[rows[i].request_id]) for i in which]
        sizes = torch.tensor([len(c) for c in columns], dtype=torch.long, device=device)
        return torch.tensor(which, dtype=torch.long, device=device).repeat_interleave(sizes), torch.cat(columns)

    def _dead_rows(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        allowing: list[int],
        whole: list[int],
        masked: tuple[list[int], list[int]],
    ) -> list[int]:
        """The rows left with no token to sample: what a request bans itself (allowed_token_ids, bad
        words) and what a grammar or min_tokens excludes cover the whole vocabulary, or min_tokens
        masks the EOS that a complete grammar alone allows. (A grammar that accepts nothing at all
        is found where it is applied, ``GrammarMasks.apply``; min_tokens alone always leaves a
        token, and bad words alone a vocabulary's worth less a few.) A row with a grammar is read
        on the device (``whole``); one without is dead only if this step's masks (``masked``:
        min_tokens' stop tokens, bad words' last tokens) cover its allowed ids, which the host knows."""
        dead: list[int] = []
        if whole:
            index = torch.tensor(whole, dtype=torch.long, device=logits.device)
            alive = (logits.index_select(0, index) > -math.inf).any(dim=1).tolist()
            dead += [i for i, ok in zip(whole, alive, strict=True) if not ok]
        narrow = [i for i in allowing if not rows[i].params.structured_output]
        if narrow:
            banned: dict[int, set[int]] = {}
            for i, token in zip(*masked, strict=True):
                banned.setdefault(i, set()).add(token)
            for i in narrow:
                allowed = self._requests[rows[i].request_id].allowed  # within the vocabulary
                covered = banned.get(i, set())
                if len(covered) >= len(allowed) and covered.issuperset(allowed.tolist()):
                    dead.append(i)
        return sorted(dead)

    def _table(self, vocab: int, device: torch.device) -> PenaltyTable:
        if self.table is None or self.table.vocab_size != vocab or self.table.device != device:
            self.table = PenaltyTable(vocab, device)
        return self.table


@dataclass(frozen=True)
class _Request:
    """What one adjusting request's rows read at every step, made once: its allowed ids and biased
    ids (within the logits' width) and bias values on the device, and its bad words indexed."""

    vocab: int
    allowed: torch.Tensor
    bias_ids: torch.Tensor
    bias_values: torch.Tensor
    bad_words: _BadWords

    @staticmethod
    def of(params: SamplingParams, vocab: int, device: torch.device) -> _Request:
        bias = [(t, b) for t, b in params.logit_bias if t < vocab]
        return _Request(
            vocab,
            torch.tensor([t for t in params.allowed_token_ids if t < vocab], dtype=torch.long, device=device),
            torch.tensor([t for t, _ in bias], dtype=torch.long, device=device),
            torch.tensor([b for _, b in bias], dtype=torch.float32, device=device),
            _BadWords.of(params.bad_words_token_ids),
        )


@dataclass(frozen=True)
class _BadWords:
    """A request's bad words, indexed by the last token of each word's head: a step compares only
    the words whose head could end where the output does, so a request with many long words costs
    the others in its batch no more than one with a few."""

    always: tuple[int, ...]  # one-token words
    by_last: dict[int, tuple[tuple[tuple[int, ...], int], ...]]  # head's last token -> (head, word's last)

    @staticmethod
    def of(words: tuple[tuple[int, ...], ...]) -> _BadWords:
        by_last: dict[int, list[tuple[tuple[int, ...], int]]] = {}
        for word in words:
            if len(word) > 1:
                by_last.setdefault(word[-2], []).append((word[:-1], word[-1]))
        always = tuple(word[0] for word in words if len(word) == 1)
        return _BadWords(always, {token: tuple(heads) for token, heads in by_last.items()})

    def completing(self, output: Sequence[int]) -> list[int]:
        out = list(self.always)
        if output:
            for head, last in self.by_last.get(output[-1], ()):
                if len(output) >= len(head) and tuple(output[len(output) - len(head) :]) == head:
                    out.append(last)
        return out
