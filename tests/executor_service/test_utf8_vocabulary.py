"""The UTF-8 table agrees with Python's strict incremental decoder on which tokens keep an output
well-formed from each state and where they leave it, and packs its rows as xgrammar's bitmask."""

from __future__ import annotations

import codecs

import torch
import xgrammar as xgr
from hypothesis import given, settings
from hypothesis import strategies as st

from executor_service import utf8_vocabulary as u
from executor_service.utf8_vocabulary import Utf8Vocabulary, pack_bits

# A pending prefix that puts the decoder in each state.
PENDING = {
    u.BETWEEN: b"",
    u.TAIL1: b"\xc3",
    u.TAIL2: b"\xe1",
    u.TAIL3: b"\xf1",
    u.AFTER_E0: b"\xe0",
    u.AFTER_ED: b"\xed",
    u.AFTER_F0: b"\xf0",
    u.AFTER_F4: b"\xf4",
}


def decoder_state(data: bytes) -> int | None:
    """The state after ``data``, by Python's strict decoder; None if ``data`` holds an ill-formed
    sequence, or ends in bytes that no continuation can make well-formed (the incremental decoder
    waits on ``ED A0``, which only a surrogate could complete)."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    try:
        decoder.decode(data, final=False)
    except UnicodeDecodeError:
        return None
    pending = decoder.getstate()[0]  # the bytes of a character not yet complete
    if not pending:
        return u.BETWEEN
    lead = pending[0]
    due = (2 if lead < 0xE0 else 3 if lead < 0xF0 else 4) - len(pending)
    if not any(completes(pending + bytes([b]) + b"\x80" * (due - 1)) for b in range(0x80, 0xC0)):
        return None
    if len(pending) == 1:
        narrowed = {0xE0: u.AFTER_E0, 0xED: u.AFTER_ED, 0xF0: u.AFTER_F0, 0xF4: u.AFTER_F4}
        return narrowed.get(lead, [u.BETWEEN, u.TAIL1, u.TAIL2, u.TAIL3][due])
    return [u.BETWEEN, u.TAIL1, u.TAIL2][due]


def completes(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


# Bytes drawn mostly from the interesting ranges: ASCII, continuations, and every kind of lead.
_BYTE = st.one_of(st.integers(0x00, 0x7F), st.integers(0x80, 0xBF), st.integers(0xC0, 0xFF))
TOKENS = st.lists(
    st.binary(min_size=1, max_size=6) | st.lists(_BYTE, min_size=1, max_size=5).map(bytes), min_size=1, max_size=40
)


@settings(max_examples=150, deadline=None, database=None, derandomize=True)
@given(tokens=TOKENS)
def test_agrees_with_pythons_strict_decoder(tokens: list[bytes]) -> None:
    vocab = [b"", *tokens]  # id 0 has no bytes of its own: neutral, as a special token
    words = (len(vocab) + 31) // 32
    table = Utf8Vocabulary(vocab, neutral_ids=[], words=words)
    allowed = unpack(table.allowed_words, len(vocab))
    for state, prefix in PENDING.items():
        assert decoder_state(prefix) == state
        assert allowed[state][0] and table.after(state, 0) == state
        for token, data in enumerate(tokens, start=1):
            expected = decoder_state(prefix + data)
            assert allowed[state][token] == (expected is not None), (prefix, data)
            if expected is not None:
                assert table.after(state, token) == expected, (prefix, data)


def test_ill_formed_tokens_resynchronise_as_a_decoder_does() -> None:
    table = Utf8Vocabulary([b"\x88a", b"\xe0\x80\xe1", b"\xc0"], neutral_ids=[], words=1)
    assert table.after(u.AFTER_E0, 0) == u.BETWEEN  # 88 cannot follow E0, 'a' starts afresh
    assert table.after(u.BETWEEN, 1) == u.TAIL2  # E0 80 is ill-formed; E1 then waits for two
    assert table.after(u.TAIL1, 2) == u.BETWEEN  # C0 never starts anything


def test_neutral_ids_are_allowed_everywhere_and_bits_past_the_vocabulary_never() -> None:
    table = Utf8Vocabulary([b"a", b"</s>", b"\x80"], neutral_ids=[1], words=2)
    allowed = unpack(table.allowed_words, 64)
    assert allowed[:, 1].all() and not allowed[:, 3:].any()
    assert allowed[u.BETWEEN, 0] and not allowed[u.TAIL1, 0]
    assert not allowed[u.BETWEEN, 2] and allowed[u.TAIL1, 2]
    assert table.after(u.TAIL2, 1) == u.TAIL2 and table.after(u.TAIL2, 40) == u.TAIL2


def test_packs_rows_as_xgrammars_bitmask() -> None:
    generator = torch.Generator().manual_seed(0)
    allowed = torch.rand(3, 70, generator=generator) < 0.5
    words = pack_bits(allowed, 3)
    logits = torch.zeros(3, 96)
    xgr.apply_token_bitmask_inplace(logits, words)
    assert torch.equal(logits[:, :70] == 0, allowed) and bool(torch.isinf(logits[:, 70:]).all())


def unpack(words: torch.Tensor, tokens: int) -> torch.Tensor:
    bits = (words.long().unsqueeze(-1) >> torch.arange(32)) & 1
    return bits.flatten(1)[:, :tokens].bool()
