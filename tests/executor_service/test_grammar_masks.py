"""The step's token masks: only constrained rows change, to exactly what their matchers accept, and
ids past the grammars' vocabulary (a padded logits width) are never allowed."""

from __future__ import annotations

import math

import pytest
import torch
import xgrammar as xgr

from executor_service.grammar_masks import _SPARSE_WORDS, GrammarBroken, GrammarMasks, OutputGrammar, resume_matcher
from executor_service.kernels import token_mask
from executor_service.utf8_vocabulary import Utf8Vocabulary

VOCAB = [chr(c) for c in range(97, 123)] + ["0", "1", "</s>"]  # a-z, 0, 1, EOS (id 28)
EOS = 28


def for_vocab(info: xgr.TokenizerInfo, compiled: xgr.CompiledGrammar) -> OutputGrammar:
    words = xgr.allocate_token_bitmask(1, info.vocab_size).shape[1]
    return OutputGrammar(compiled, Utf8Vocabulary(info.decoded_vocab, info.stop_token_ids, words))


def compiled(regex: str) -> OutputGrammar:
    info = xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOS])
    return for_vocab(info, xgr.GrammarCompiler(info, max_threads=1).compile_regex(regex))


def test_only_constrained_rows_are_masked_to_their_next_tokens() -> None:
    digits, word = compiled("[01]{2}"), compiled("ab")
    matchers = [None, resume_matcher(digits, []), None, resume_matcher(word, [0])]  # "a" already out
    width = len(VOCAB) + 3  # the model's logits are wider than the tokenizer's vocabulary
    logits = torch.randn(4, width)
    before = logits.clone()
    GrammarMasks(len(VOCAB)).apply(logits, matchers)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = {1: {26, 27}, 3: {1}}  # "0" or "1"; then only "b"
    for row, ids in allowed.items():
        finite = {i for i in range(width) if not math.isinf(float(logits[row, i]))}
        assert finite == ids
        assert all(logits[row, i] == before[row, i] for i in ids)


def test_a_complete_output_allows_only_its_end() -> None:
    matcher = resume_matcher(compiled("ab"), [0, 1])
    logits = torch.zeros(1, len(VOCAB))
    GrammarMasks(len(VOCAB)).apply(logits, [matcher])
    assert [i for i in range(len(VOCAB)) if logits[0, i] == 0] == [EOS]


def test_the_buffer_grows_with_the_batch() -> None:
    masks = GrammarMasks(len(VOCAB))
    grammar = compiled("[a-z]")
    logits = torch.zeros(9, len(VOCAB))
    masks.apply(logits, [resume_matcher(grammar, []) for _ in range(9)])
    assert bool(torch.isinf(logits[:, 26:]).all()) and bool((logits[:, :26] == 0).all())


def test_resuming_replays_the_output_or_says_where_it_broke() -> None:
    grammar = compiled("ab")
    assert resume_matcher(grammar, [0, 1, EOS]).is_terminated()
    with pytest.raises(GrammarBroken, match=r"output token 1 \(id 2\)"):
        resume_matcher(grammar, [0, 2])


@pytest.mark.parametrize("width", [768, 700, 800])  # the grammars' 24 words exactly, fewer logits, more
def test_sparse_and_dense_rows_mask_as_xgrammars_kernel(width: int) -> None:
    """Rows allowing few tokens take the whole-row path, the others the kernel: the same logits."""
    generator = torch.Generator().manual_seed(0)
    words = 3 * _SPARSE_WORDS  # 768 tokens: a sparse row allows tokens in at most 3 words
    bitmask = torch.zeros(6, words, dtype=torch.int32)
    bitmask[0, 5] = 1 << 7  # one token
    bitmask[1, [0, 2, 23]] = torch.tensor([-1, 0x00F0F0F0, -(2**31)], dtype=torch.int32)  # three words; bit 31 too
    bitmask[2] = -1  # everything
    bitmask[3] = torch.randint(-(2**31), 2**31 - 1, (words,), dtype=torch.int32, generator=generator)
    bitmask[4, 21] = 1 << 30  # token 702, past narrower logits
    logits = torch.randn(6, width, generator=generator)
    covered = min(width, words * 32)
    expected = logits.clone()
    rows = [0, 1, 2, 3, 4]
    xgr.apply_token_bitmask_inplace(expected, bitmask, vocab_size=covered, indices=rows)
    GrammarMasks._mask_on_host(logits, bitmask, rows, covered)
    assert torch.equal(logits[:, :covered], expected[:, :covered])
    assert torch.equal(logits[5], expected[5])  # a row not asked about


def test_rows_keep_their_output_well_formed_utf8() -> None:
    """After the lead byte E0 only A0-BF may follow (80-9F would be overlong), though xgrammar's
    matcher takes both; tokens that would end a character already due are ruled out."""
    vocab = [b"\xe0", b"\x88", b"\xa0", b"\xa0\x80", b"\xa0a", b"a", b"</s>"]
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[6])  # type: ignore[arg-type]  # raw bytes are tokens too
    grammar = for_vocab(info, xgr.GrammarCompiler(info, max_threads=1).compile_regex(".{0,4}"))
    matcher = resume_matcher(grammar, [0])
    logits = torch.zeros(1, len(vocab))
    GrammarMasks(len(vocab)).apply(logits, [matcher])
    assert [i for i in range(len(vocab)) if logits[0, i] == 0] == [2, 3]  # A0 (one due after), A0 80
    assert matcher.accept_token(3) and matcher.utf8_state == 0  # the character is complete


def test_a_row_with_no_well_formed_continuation_keeps_the_grammars_mask() -> None:
    # xgrammar takes the surrogate ED A0 80 as a character; here nothing else could be one.
    vocab = [b"\xed\xa0\x80", b"</s>"]
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[1])  # type: ignore[arg-type]  # raw bytes are tokens too
    grammar = for_vocab(info, xgr.GrammarCompiler(info, max_threads=1).compile_regex("."))
    logits = torch.zeros(1, len(vocab))
    GrammarMasks(len(vocab)).apply(logits, [resume_matcher(grammar, [])])
    assert [i for i in range(len(vocab)) if logits[0, i] == 0] == [0]  # the grammar's, not a dead end


def test_the_native_kernel_and_the_fallback_mask_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    grammars = [compiled("[01]{2}"), compiled("ab"), compiled("[a-z]+"), compiled("a|b0")]
    logits = torch.randn(6, len(VOCAB) + 3, generator=torch.Generator().manual_seed(2))
    results = []
    for native in (True, False):
        monkeypatch.setattr(token_mask, "available", lambda native=native: native)
        out = logits.clone()
        matchers = [None, *(resume_matcher(g, []) for g in grammars), resume_matcher(grammars[1], [0])]
        GrammarMasks(len(VOCAB)).apply(out, matchers)
        results.append(out)
    assert torch.equal(results[0], results[1]) and not torch.equal(results[0], logits)
