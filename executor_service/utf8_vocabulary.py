"""Which tokens keep a structured output well-formed UTF-8, by where the output's last character stands.

xgrammar's grammars are over Unicode characters, but its matcher checks their UTF-8 loosely: it
takes an overlong sequence (``E0 88 88``, three bytes for a two-byte character), a surrogate
(``ED A0 80``) or a lead byte past U+10FFFF as a character. A model that emits one breaks what the
grammar promised: the bytes decode to U+FFFD replacement characters, so a JSON string with
``maxLength: 1`` comes out three characters long, and the text no longer holds the character the
grammar counted. Byte-level tokenizers offer every byte as a token, so greedy decoding of a weak
model finds such sequences.

This table closes that gap from outside xgrammar. A UTF-8 decoder's state after the output so far
is one of eight (between characters, or inside one with some continuation bytes still due, four of
them narrowed as Unicode's table of well-formed byte sequences narrows the second byte after
``E0``, ``ED``, ``F0`` and ``F4``). For each state the table holds a token bitmask, in xgrammar's
layout, of the tokens whose bytes continue the output without an ill-formed sequence, and the state
each token leaves. ``grammar_masks`` intersects a constrained row's grammar mask with its state's
row here: one ``&`` per step for all constrained rows.

Tokens with no bytes of their own (special and stop tokens, the ids that pad the model's vocabulary)
are allowed from every state and leave it as it was: the grammar alone decides them. The decoded
vocabulary covers every id the grammars' bitmask does (xgrammar's ``TokenizerInfo`` is built for
the model's logits width), so the bits past it stand for no token and stay clear. Byte order is
what the tokenizer's decoded vocabulary says (xgrammar's ``TokenizerInfo.decoded_vocab``, which
already maps byte-level and byte-fallback tokens to their raw bytes).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

# Decoder states. BETWEEN: at a character boundary. TAIL1-3: that many continuation bytes (80-BF)
# due. AFTER_E0 / AFTER_ED / AFTER_F0 / AFTER_F4: a lead byte whose next byte has a narrower range
# (no overlong three- or four-byte forms, no surrogates, nothing past U+10FFFF).
BETWEEN, TAIL1, TAIL2, TAIL3, AFTER_E0, AFTER_ED, AFTER_F0, AFTER_F4 = range(8)
STATES = 8
_ILL_FORMED = STATES
_PAD = 256  # a byte value past any real one: pads token byte rows to one length, changes no state


def _transitions() -> torch.Tensor:
    """[STATES + 1, 257]: the next state from each state on each byte (or on the padding)."""
    table = torch.full((STATES + 1, _PAD + 1), _ILL_FORMED, dtype=torch.long)

    def on(state: int, low: int, high: int, to: int) -> None:
        table[state, low : high + 1] = to

    on(BETWEEN, 0x00, 0x7F, BETWEEN)
    on(BETWEEN, 0xC2, 0xDF, TAIL1)
    on(BETWEEN, 0xE0, 0xE0, AFTER_E0)
    on(BETWEEN, 0xE1, 0xEC, TAIL2)
    on(BETWEEN, 0xED, 0xED, AFTER_ED)
    on(BETWEEN, 0xEE, 0xEF, TAIL2)
    on(BETWEEN, 0xF0, 0xF0, AFTER_F0)
    on(BETWEEN, 0xF1, 0xF3, TAIL3)
    on(BETWEEN, 0xF4, 0xF4, AFTER_F4)
    on(TAIL1, 0x80, 0xBF, BETWEEN)
    on(TAIL2, 0x80, 0xBF, TAIL1)
    on(TAIL3, 0x80, 0xBF, TAIL2)
    on(AFTER_E0, 0xA0, 0xBF, TAIL1)
    on(AFTER_ED, 0x80, 0x9F, TAIL1)
    on(AFTER_F0, 0x90, 0xBF, TAIL2)
    on(AFTER_F4, 0x80, 0x8F, TAIL2)
    table[:, _PAD] = torch.arange(STATES + 1)
    return table


_TRANSITIONS = _transitions()


def pack_bits(allowed: torch.Tensor, words: int) -> torch.Tensor:
    """[rows, tokens] booleans as xgrammar's token bitmask, [rows, words] int32: token i is bit
    i % 32 of word i // 32. Bits past ``allowed``'s width are clear: no token has them, so a row's
    mask is empty exactly when no token is left."""
    rows, tokens = allowed.shape
    if tokens > words * 32:
        raise ValueError(f"{tokens} tokens do not fit {words} bitmask words")
    bits = torch.zeros(rows, words * 32, dtype=torch.long)
    bits[:, :tokens] = allowed.long()
    packed = (bits.view(rows, words, 32) << torch.arange(32)).sum(dim=-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


class Utf8Vocabulary:
    """Per tokenizer: for each decoder state, the tokens that keep the output well-formed and the
    state each token leaves. Built once, on the grammar compiler's thread (``GrammarCache``)."""

    def __init__(self, decoded_vocab: Sequence[bytes], neutral_ids: Collection[int], words: int) -> None:
        """``decoded_vocab``: each token id's bytes; ``neutral_ids``: ids the grammar alone decides
        (special and stop tokens); ``words``: the bitmask's width in int32 words."""
        vocab = len(decoded_vocab)
        allowed = torch.ones(STATES, vocab, dtype=torch.bool)
        ends = torch.arange(STATES).unsqueeze(1).repeat(1, vocab)  # a neutral token keeps its state
        neutral = set(neutral_ids)
        ascii_ids: list[int] = []
        wide_ids: list[int] = []
        for token, data in enumerate(decoded_vocab):
            if token in neutral or not data:
                continue
            (wide_ids if max(data) >= 0x80 else ascii_ids).append(token)
        if ascii_ids:  # the common case, without a walk: fine between characters, ill-formed inside one
            index = torch.tensor(ascii_ids)
            allowed[1:, index] = False
            ends[:, index] = BETWEEN
        if wide_ids:
            wide_allowed, wide_ends = self._walk([decoded_vocab[t] for t in wide_ids])
            index = torch.tensor(wide_ids)
            allowed[:, index], ends[:, index] = wide_allowed, wide_ends
        self.allowed_words = pack_bits(allowed, words)  # [STATES, words] int32
        self.allowed_words_np = self.allowed_words.numpy()  # the same memory, for numpy's small ops
        # Per start state, each token's end state: a bytes object, read per accepted token.
        self._ends = [bytes(row.to(torch.uint8).tolist()) for row in ends]

    @staticmethod
    def _walk(tokens: list[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's bytes run through the decoder from every state at once: [STATES, len(tokens)]
        whether no ill-formed sequence occurs, and the end state. Past an ill-formed byte the walk
        resynchronises as a decoder does (the byte starts afresh, or is skipped), so a token the mask
        did let through (``grammar_masks`` falls back to the grammar's mask alone where nothing
        well-formed is left) still leaves a state to go on from."""
        length = max(len(t) for t in tokens)
        data = torch.full((len(tokens), length), _PAD, dtype=torch.long)
        for i, token in enumerate(tokens):
            data[i, : len(token)] = torch.tensor(list(token))
        state = torch.arange(STATES).unsqueeze(1).repeat(1, len(tokens))
        ill_formed = torch.zeros(STATES, len(tokens), dtype=torch.bool)
        for column in data.T:
            byte = column.expand(STATES, -1)
            step = _TRANSITIONS[state, byte]
            bad = step == _ILL_FORMED
            fresh = _TRANSITIONS[BETWEEN, byte]
            state = torch.where(bad, torch.where(fresh == _ILL_FORMED, BETWEEN, fresh), step)
            ill_formed |= bad
        return ~ill_formed, state

    def after(self, state: int, token: int) -> int:
        """The decoder's state once ``token`` follows ``state``; an id past the vocabulary keeps it."""
        ends = self._ends[state]
        return ends[token] if token < len(ends) else state
