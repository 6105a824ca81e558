from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executor_service.detokenizer import IncrementalDetokenizer, ids_decoder

REPLACEMENT = "\ufffd"
_WORDS_TEXT = (
    "the a of and to in river mill boat bridge morning light tree seed question answer number code quiet small old "
    "ünïcödé 東京 🙂 café naïve Ελληνικά русский 日本語 señor 👍🏽 mañana"
)
# Non-ASCII characters of 2, 3 and 4 UTF-8 bytes, plus ASCII; all rare enough to be split across tokens.
SAFE_ALPHABET = "abcdefghijklmnopqrstuvwxyz ABC.,!?-\nüïöé東京日本🙂👍ñλж"
_settings = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """A real byte-level BPE fast tokenizer, trained here in memory: nothing is downloaded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    words = _WORDS_TEXT.split()
    corpus = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) + "." for _ in range(400)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", clean_up_tokenization_spaces=False
    )


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def expected(tokenizer: Any, ids: Sequence[int], stops: Sequence[str]) -> str:
    """The full decode, cut at the stop string that completes first (earliest end, then earliest start)."""
    full = tokenizer.decode(list(ids), skip_special_tokens=True)
    hits = [(full.find(s) + len(s), full.find(s)) for s in stops if s in full]
    return full[: min(hits)[1]] if hits else full


def stream(
    detok: IncrementalDetokenizer, ids: Sequence[int], chunks: Sequence[int] | None = None
) -> tuple[list[str], bool]:
    """Push ``ids`` (one at a time, or in the given chunk sizes); returns the deltas, flush included, and stopped."""
    deltas: list[str] = []
    sizes = list(chunks or [1] * len(ids))
    pos = 0
    while pos < len(ids):
        size = sizes.pop(0) if sizes else 1
        delta = detok.push(ids[pos : pos + size])
        pos += size
        deltas.append(delta.text)
        if delta.stopped:
            return deltas, True
    deltas.append(detok.flush())
    return deltas, False


def test_deltas_join_to_full_decode_and_never_split_characters(tokenizer: Any) -> None:
    text = "The river ünïcödé 東京 🙂 ran past the mill, naïve café 👍🏽 日本語."
    ids = encode(tokenizer, text)
    emoji_ids = encode(tokenizer, "🙂")
    assert len(emoji_ids) > 1, "the test needs a character split across tokens"
    deltas, stopped = stream(IncrementalDetokenizer(tokenizer, [], stop=[]), ids)
    assert not stopped
    assert "".join(deltas) == text == tokenizer.decode(ids, skip_special_tokens=True)
    assert all(REPLACEMENT not in d for d in deltas)


def test_prompt_context_does_not_leak_into_output(tokenizer: Any) -> None:
    prompt = encode(tokenizer, "Question: 東京?")
    ids = encode(tokenizer, " answer 🙂 the bridge")
    deltas, _ = stream(IncrementalDetokenizer(tokenizer, prompt, stop=[]), ids)
    assert "".join(deltas) == " answer 🙂 the bridge"


def test_stop_string_spanning_tokens_is_trimmed(tokenizer: Any) -> None:
    text = "the quiet river and the small boat"
    ids = encode(tokenizer, text)
    stop = "er and t"
    assert not any(stop in tokenizer.decode([i]) for i in ids), "the stop must span several tokens"
    detok = IncrementalDetokenizer(tokenizer, [], stop=[stop])
    deltas, stopped = stream(detok, ids)
    assert stopped and detok.stopped
    assert "".join(deltas) == "the quiet riv"
    assert detok.push(encode(tokenizer, " more")).text == "" and detok.flush() == ""


def test_multibyte_stop_string(tokenizer: Any) -> None:
    ids = encode(tokenizer, "a café 東京 🙂 boat")
    deltas, stopped = stream(IncrementalDetokenizer(tokenizer, [], stop=["京 🙂"]), ids)
    assert stopped and "".join(deltas) == "a café 東"


def test_flush_returns_held_back_text(tokenizer: Any) -> None:
    text = "the small boat"
    detok = IncrementalDetokenizer(tokenizer, [], stop=["xyz", "boats"])  # "boat" could still become "boats"
    streamed = "".join(detok.push([i]).text for i in encode(tokenizer, text))
    assert streamed == "the small "  # longest stop has 5 characters: the last 4 are held back
    assert detok.flush() == "boat"
    assert detok.flush() == ""


def test_stop_completing_first_wins_whatever_the_chunking(tokenizer: Any) -> None:
    ids = encode(tokenizer, "the river and the mill")
    for chunks in ([1] * len(ids), [len(ids)], [2, 3, 100]):
        detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["river and", "ver"])
        deltas, stopped = stream(detokenizer, ids, chunks)
        assert stopped and "".join(deltas) == "the ri" and detokenizer.matched_stop == "ver"  # vLLM's stop_reason


def test_special_tokens_are_skipped(tokenizer: Any) -> None:
    eos = tokenizer.eos_token_id
    ids = [*encode(tokenizer, "a boat"), eos, *encode(tokenizer, " 東京")]
    deltas, _ = stream(IncrementalDetokenizer(tokenizer, [], stop=[]), ids)
    assert "".join(deltas) == "a boat 東京"


def test_resume_emits_only_new_text(tokenizer: Any) -> None:
    ids = encode(tokenizer, "the river 東京 and the mill")
    k = len(ids) // 2
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "Hi:"), stop=[], output_token_ids=ids[:k])
    deltas, _ = stream(detok, ids[k:])
    assert "".join(deltas) == tokenizer.decode(ids)[len(tokenizer.decode(ids[:k])) :]


def test_resume_inside_a_character_emits_it_whole(tokenizer: Any) -> None:
    ids = encode(tokenizer, "boat 🙂 mill")
    # A cut whose decoded text ends inside the emoji: the client was shown text only up to the last whole
    # character, i.e. up to the last cut that decodes cleanly.
    k = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith(REPLACEMENT))
    clean = max(j for j in range(k + 1) if not tokenizer.decode(ids[:j]).endswith(REPLACEMENT))
    delivered = tokenizer.decode(ids[:clean])
    detok = IncrementalDetokenizer(tokenizer, [], stop=[], output_token_ids=ids[:k])
    deltas, _ = stream(detok, ids[k:])
    assert delivered + "".join(deltas) == "boat 🙂 mill"
    assert all(REPLACEMENT not in d for d in deltas)


def test_stop_straddling_the_resume_point_is_found(tokenizer: Any) -> None:
    text = "the quiet river and the boat"
    ids = encode(tokenizer, text)
    k = len(ids) // 2
    cut = len(tokenizer.decode(ids[:k]))
    stop = text[cut - 2 : cut + 2]
    assert text.count(stop) == 1
    before = IncrementalDetokenizer(tokenizer, [], stop=[stop])
    delivered = "".join(before.push([i]).text for i in ids[:k])  # then handed back, unflushed
    detok = IncrementalDetokenizer(tokenizer, [], stop=[stop], output_token_ids=ids[:k])
    deltas, stopped = stream(detok, ids[k:])
    assert stopped and delivered + "".join(deltas) == text[: cut - 2] == detok.text


@_settings
@given(
    text=st.text(alphabet=SAFE_ALPHABET, min_size=1, max_size=50),
    stops=st.lists(st.text(alphabet=SAFE_ALPHABET, min_size=1, max_size=5), max_size=2),
    data=st.data(),
)
def test_a_hand_back_loses_and_repeats_no_text(
    tokenizer: Any, text: str, stops: list[str], data: st.DataObject
) -> None:
    # Preempted or migrated after k tokens: what the client got then, plus what the resumed request sends,
    # is what an uninterrupted request sends (the tail stop strings held back included).
    ids = encode(tokenizer, text)
    k = data.draw(st.integers(min_value=0, max_value=len(ids)))
    before = IncrementalDetokenizer(tokenizer, [], stop=stops)
    delivered: list[str] = []
    for token_id in ids[:k]:
        delta = before.push([token_id])
        delivered.append(delta.text)
        if delta.stopped:
            return  # it ended before the hand-back
    resumed, _ = stream(IncrementalDetokenizer(tokenizer, [], stop=stops, output_token_ids=ids[:k]), ids[k:])
    whole, _ = stream(IncrementalDetokenizer(tokenizer, [], stop=stops), ids)
    assert "".join(delivered) + "".join(resumed) == "".join(whole)


def test_include_stop_str_in_output_keeps_the_stop_string(tokenizer: Any) -> None:
    ids = encode(tokenizer, "the quiet river and the small boat")
    for chunks in ([1] * len(ids), [len(ids)]):
        detok = IncrementalDetokenizer(tokenizer, [], stop=["er and t", "zzz"], include_stop_str_in_output=True)
        deltas, stopped = stream(detok, ids, chunks)
        assert stopped and "".join(deltas) == "the quiet river and t" == detok.text


def test_min_tokens_keeps_stop_strings_from_matching_until_then(tokenizer: Any) -> None:
    """As vLLM: text completed while the output holds at most min_tokens tokens never matches."""
    ids = encode(tokenizer, "the boat and the boat and the boat")
    early = next(n for n in range(1, len(ids)) if "boat" in tokenizer.decode(ids[:n]))
    deltas, stopped = stream(IncrementalDetokenizer(tokenizer, [], stop=["boat"]), ids)
    assert stopped and "".join(deltas) == "the "
    detok = IncrementalDetokenizer(tokenizer, [], stop=["boat"], min_tokens=early)
    deltas, stopped = stream(detok, ids)
    assert stopped and "".join(deltas) == "the boat and the "
    # Resumed output counts toward min_tokens.
    resumed = IncrementalDetokenizer(tokenizer, [], stop=["boat"], output_token_ids=ids[:2], min_tokens=early)
    deltas, stopped = stream(resumed, ids[2:])
    assert stopped and resumed.text == "the boat and the "


def test_empty_stop_string_is_rejected(tokenizer: Any) -> None:
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tokenizer, [], stop=["ok", ""])


@_settings
@given(
    text=st.text(alphabet=SAFE_ALPHABET, min_size=0, max_size=60),
    stops=st.lists(st.text(alphabet=SAFE_ALPHABET, min_size=1, max_size=4), max_size=3),
    chunk=st.integers(min_value=1, max_value=4),
)
def test_join_invariant_on_text(tokenizer: Any, text: str, stops: list[str], chunk: int) -> None:
    ids = encode(tokenizer, text)
    deltas, _ = stream(IncrementalDetokenizer(tokenizer, [], stop=stops), ids, [chunk] * len(ids))
    assert "".join(deltas) == expected(tokenizer, ids, stops)
    assert all(REPLACEMENT not in d for d in deltas)


@_settings
@given(data=st.data())
def test_join_invariant_on_arbitrary_ids(tokenizer: Any, data: st.DataObject) -> None:
    # Arbitrary ids include special tokens and byte sequences that are not valid UTF-8 at all.
    ids = data.draw(st.lists(st.integers(min_value=0, max_value=len(tokenizer) - 1), max_size=40))
    full = tokenizer.decode(ids, skip_special_tokens=True)
    stop_from_text = st.integers(0, max(len(full) - 1, 0)).flatmap(lambda i: st.just(full[i : i + 3]))
    stops = [s for s in data.draw(st.lists(stop_from_text, max_size=2)) if s]
    deltas, _ = stream(IncrementalDetokenizer(tokenizer, [], stop=stops), ids)
    assert "".join(deltas) == expected(tokenizer, ids, stops)


class _CountingTokenizer:
    """The fixture's tokenizer behind a ``decode`` that counts its calls, with a chosen clean-up flag."""

    def __init__(self, inner: Any, clean_up: bool) -> None:
        self._inner = inner
        self._tokenizer = inner._tokenizer
        self.clean_up_tokenization_spaces = clean_up
        self.calls = 0

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        self.calls += 1
        return self._inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_ids_decoder_decodes_as_the_tokenizer_does(tokenizer: Any) -> None:
    ids = [tokenizer.bos_token_id, *encode(tokenizer, "the river café 東京 🙂"), tokenizer.eos_token_id]
    for skip in (True, False):
        for window in (ids, ids[1:4], ids[-3:], []):
            assert ids_decoder(tokenizer, skip)(window) == tokenizer.decode(window, skip_special_tokens=skip)


def test_ids_decoder_calls_the_rust_tokenizer_only_when_decode_would_add_nothing(tokenizer: Any) -> None:
    ids = encode(tokenizer, "the old mill")
    plain, cleaning = _CountingTokenizer(tokenizer, clean_up=False), _CountingTokenizer(tokenizer, clean_up=True)
    assert ids_decoder(plain, True)(ids) == ids_decoder(cleaning, True)(ids) == tokenizer.decode(ids)
    assert (plain.calls, cleaning.calls) == (0, 1)  # clean-up spaces on: the tokenizer's own decode


@_settings
@given(data=st.data())
def test_decode_stream_gives_the_deltas_of_window_decoding(tokenizer: Any, data: st.DataObject) -> None:
    # The fast path (tokenizers' DecodeStream) and the window path (any other tokenizer's decode) must hand
    # out the same text at the same pushes: prompts, resumed outputs and broken UTF-8 included.
    ids = data.draw(st.lists(st.integers(min_value=0, max_value=len(tokenizer) - 1), max_size=30))
    prompt = data.draw(st.lists(st.integers(min_value=0, max_value=len(tokenizer) - 1), max_size=8))
    resumed = data.draw(st.integers(min_value=0, max_value=len(ids)))
    chunk = data.draw(st.integers(min_value=1, max_value=3))
    windowed = _CountingTokenizer(tokenizer, clean_up=True)
    fast = IncrementalDetokenizer(tokenizer, prompt, stop=[], output_token_ids=ids[:resumed])
    slow = IncrementalDetokenizer(windowed, prompt, stop=[], output_token_ids=ids[:resumed])
    assert fast._stream is not None and slow._stream is None
    rest = ids[resumed:]
    assert stream(fast, rest, [chunk] * len(rest)) == stream(slow, rest, [chunk] * len(rest))
