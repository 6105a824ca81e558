"""DecodeStream against window decoding on a Llama-2 style tokenizer (Metaspace,
byte fallback, a Strip decoder), which the module's own test (byte-level BPE) does not cover."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executor_service.detokenizer import IncrementalDetokenizer
from tests.executor_service.test_detokenizer import _WORDS_TEXT, _CountingTokenizer, stream


@pytest.fixture(scope="module")
def spm_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    words = _WORDS_TEXT.split()
    corpus = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) + "." for _ in range(400)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    import json

    state = json.loads(tok.to_str())
    vocab = state["model"]["vocab"]
    for b in range(256):  # byte-fallback pieces as ordinary vocabulary, as in Llama 2's tokenizer
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [(a, b) for a, b in (m.split(" ") if isinstance(m, str) else m for m in state["model"]["merges"])]
    model = models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True)
    trained = tok
    tok = Tokenizer(model)
    tok.normalizer, tok.pre_tokenizer, tok.decoder = trained.normalizer, trained.pre_tokenizer, trained.decoder
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    assert "<0x" in "".join(tok.encode("Ω€ 🦀").tokens), tok.encode("Ω€ 🦀").tokens
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", clean_up_tokenization_spaces=False
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_decode_stream_matches_windows_on_spm(spm_tokenizer: Any, data: st.DataObject) -> None:
    tokenizer = spm_tokenizer
    top = len(tokenizer) - 1
    ids = data.draw(st.lists(st.integers(min_value=0, max_value=top), max_size=30))
    prompt = data.draw(st.lists(st.integers(min_value=0, max_value=top), max_size=8))
    resumed = data.draw(st.integers(min_value=0, max_value=len(ids)))
    skip = data.draw(st.booleans())
    windowed = _CountingTokenizer(tokenizer, clean_up=True)
    fast = IncrementalDetokenizer(tokenizer, prompt, stop=[], output_token_ids=ids[:resumed], skip_special_tokens=skip)
    slow = IncrementalDetokenizer(windowed, prompt, stop=[], output_token_ids=ids[:resumed], skip_special_tokens=skip)
    assert slow._stream is None
    rest = ids[resumed:]
    assert stream(fast, rest) == stream(slow, rest)
