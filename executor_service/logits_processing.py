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
from collections.abc import Sequence
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


class LogitsProcessing:
    """Per engine: the penalty table and the requests' stop tokens (for min_tokens)."""

    def __init__(self, eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.eos_token_ids = tuple(sorted(eos_token_ids))
        self.table: PenaltyTable | None = None  # made on first use, at the logits' width and device
        # Per request with allowed_token_ids: the tokens it may not sample, as a row mask, made once.
        self._disallowed: dict[str, torch.Tensor] = {}

    def release(self, request_id: str) -> None:
        """The request left the batch (finished, preempted, aborted, re-admitted): free its row."""
        if self.table is not None:
            self.table.release(request_id)
        self._disallowed.pop(request_id, None)

    @torch.inference_mode()  # the model's logits are inference tensors, and so is the table
    def apply(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> Penalised | None:
        """Change ``logits`` [len(rows), vocab] in place for the rows whose requests ask; the
        penalised rows, whose chosen tokens ``record`` must then count."""
        vocab = logits.shape[-1]
        masked: tuple[list[int], list[int]] = ([], [])
        biased: tuple[list[int], list[int], list[float]] = ([], [], [])
        penalised: list[int] = []
        allowing: list[int] = []
        for i, row in enumerate(rows):
            params = row.params
            if not params.adjusts_logits:
                continue
            if params.allowed_token_ids:
                allowing.append(i)
            for token in _completing_bad_words(row.output_ids, params.bad_words_token_ids):
                if token < vocab:
                    masked[0].append(i)
                    masked[1].append(token)
            if len(row.output_ids) < params.min_tokens:
                # vLLM's MinTokensLogitsProcessor: no stop token until the whole output is long enough.
                stops = params.stop_token_ids if params.ignore_eos else params.stop_token_ids + self.eos_token_ids
                for token in stops:
                    if token < vocab:
                        masked[0].append(i)
                        masked[1].append(token)
            for token, bias in params.logit_bias:
                if token < vocab:
                    biased[0].append(i)
                    biased[1].append(token)
                    biased[2].append(bias)
            if params.has_penalties:
                penalised.append(i)
        device = logits.device
        if allowing:
            index = torch.tensor(allowing, dtype=torch.long, device=device)
            disallowed = torch.stack([self._disallowed_of(rows[i], vocab, device) for i in allowing])
            logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(disallowed, -math.inf))
        if masked[0]:
            index = torch.tensor(masked, dtype=torch.long, device=device)
            logits[index[0], index[1]] = -math.inf
        if biased[0]:
            index = torch.tensor(biased[:2], dtype=torch.long, device=device)
            values = torch.tensor(biased[2], dtype=logits.dtype, device=device)
            logits.index_put_((index[0], index[1]), values, accumulate=True)
        if not penalised:
            return None
        table = self._table(vocab, device)
        slots = [table.slot(rows[i]) for i in penalised]
        index = torch.tensor([penalised, slots], dtype=torch.long, device=device)
        table.apply(logits, index[0], index[1], [rows[i].params for i in penalised])
        return Penalised(table, index[0], index[1])

    def _disallowed_of(self, row: SamplingRow, vocab: int, device: torch.device) -> torch.Tensor:
        mask = self._disallowed.get(row.request_id)
        if mask is None or mask.shape[0] != vocab or mask.device != device:
            mask = torch.ones(vocab, dtype=torch.bool, device=device)
            allowed = [t for t in row.params.allowed_token_ids if t < vocab]
            mask[torch.tensor(allowed, dtype=torch.long, device=device)] = False
            self._disallowed[row.request_id] = mask
        return mask

    @torch.inference_mode()
    def dead_rows(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
        """The rows of requests that ban tokens themselves (allowed_token_ids, bad words) left with
        no token to sample: what they exclude and what a grammar or min_tokens excludes cover the
        whole vocabulary. Only such rows can be: a grammar alone, and min_tokens alone, always
        leave a token."""
        banning = [i for i, row in enumerate(rows) if row.params.bans_tokens]
        if not banning:
            return []
        index = torch.tensor(banning, dtype=torch.long, device=logits.device)
        alive = (logits.index_select(0, index) > -math.inf).any(dim=1).tolist()
        return [i for i, ok in zip(banning, alive, strict=True) if not ok]

    def _table(self, vocab: int, device: torch.device) -> PenaltyTable:
        if self.table is None or self.table.vocab_size != vocab or self.table.device != device:
            self.table = PenaltyTable(vocab, device)
        return self.table


def _completing_bad_words(output: Sequence[int], bad_words: Sequence[Sequence[int]]) -> list[int]:
    """The tokens that would complete one of ``bad_words`` after ``output``: each word's last
    token, where the output already ends with the rest of the word (a one-token word always)."""
    out = []
    for word in bad_words:
        head = len(word) - 1
        if head == 0 or (len(output) >= head and list(output[len(output) - head :]) == list(word[:head])):
            out.append(word[-1])
    return out
