"""Incremental detokenisation and stop-string matching for one request.

Decoding one token at a time is wrong for most tokenizers: a byte-level BPE token can hold half of a UTF-8
character, and SentencePiece-style decoders drop the leading space of the first token they see. So, like HF TGI
and vLLM, we decode a small window of tokens (``prefix_offset..end``) and emit only what it adds beyond its
already-emitted head (``prefix_offset..read_offset``), and only once it no longer ends in an incomplete character.

Stop strings are matched against all text generated so far. Until one matches, the last ``max_stop_len - 1``
characters are held back, since they might be the start of a stop string: streamed text never has to be retracted.
As in vLLM, a request's ``min_tokens`` keeps stop strings from matching until the output holds more tokens than
that (text completed up to then is never searched), and ``include_stop_str_in_output`` keeps a matched stop string
at the end of the text instead of cutting it off.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import tokenizers
from tokenizers.decoders import DecodeStream

logger = logging.getLogger(__name__)

# What decoders produce for bytes that are not (yet) a whole UTF-8 character.
_REPLACEMENT = "\ufffd"
# Prompt tokens decoded as context before the first generated token (TGI and vLLM use 5 as well).
_CONTEXT_TOKENS = 5
# A UTF-8 character spans at most 4 bytes, so an unfinished one ends at most 3 tokens before its end.
_MAX_CHAR_BYTES = 4


def rust_tokenizer(tokenizer: Any) -> tokenizers.Tokenizer | None:
    """The ``tokenizers.Tokenizer`` under a transformers fast tokenizer whose ``decode`` adds nothing to it.

    A fast tokenizer's ``decode`` converts its argument, checks types and then calls its Rust tokenizer;
    with ``clean_up_tokenization_spaces`` off it changes nothing after. None for any other tokenizer.
    """
    backend = getattr(tokenizer, "_tokenizer", None)
    if isinstance(backend, tokenizers.Tokenizer) and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return backend
    return None


def ids_decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """``tokenizer.decode`` for a list of ids, straight to the Rust tokenizer where that is all it would do.

    The transformers wrapper took twice the Rust call's time (2.6 µs against 0.9). Any other tokenizer
    keeps its own ``decode``.
    """
    backend = rust_tokenizer(tokenizer)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@dataclass(frozen=True)
class DetokenizedDelta:
    """New text that is safe to stream to the client, and whether a stop string ended the output."""

    text: str
    stopped: bool


class IncrementalDetokenizer:
    """Turns one request's generated token ids into streamable text. Not thread-safe: one owner, the engine."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str],
        skip_special_tokens: bool = True,
        output_token_ids: Sequence[int] | None = None,
        min_tokens: int = 0,
        include_stop_str_in_output: bool = False,
    ) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._decode_ids = ids_decoder(tokenizer, skip_special_tokens)
        self._skip_special_tokens = skip_special_tokens
        self._rust = rust_tokenizer(tokenizer)
        self._stop = tuple(stop)
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._ids: list[int] = [*prompt_token_ids, *(output_token_ids or ())]
        self._stopped = False
        self._matched: str | None = None  # the stop string that ended the output
        # Stop strings match only once the output holds more tokens than this (the request's whole
        # output, resumed tokens included).
        self._match_after = len(prompt_token_ids) + min_tokens
        self._keep_stop = include_stop_str_in_output

        prompt_len = len(prompt_token_ids)
        read = self._complete_end(prompt_len)
        self._prefix_offset = self._context_start(read)
        self._read_offset = read

        # All generated text so far (self._text) and how much of it the caller has been given (self._emitted).
        # Resumed output counts as delivered but for the tail its stop strings held back, which no client got
        # (the output was handed back before it was safe): that tail goes out again once it is. The text is
        # kept so a stop string straddling the resume point is found.
        if read > prompt_len:
            context = self._context_start(prompt_len)
            head = self._decode(context, prompt_len)
            self._text = self._decode(context, read)[len(head) :]
        else:
            self._text = ""
        self._emitted = max(len(self._text) - max(self._max_stop_len - 1, 0), 0)
        self._scanned = len(self._text)  # stop strings were already searched for in text[:_scanned]
        self._stream = self._start_stream()

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the output (None while none has)."""
        return self._matched

    @property
    def text(self) -> str:
        """All text emitted so far, including resumed output (without the held-back tail)."""
        return self._text[: self._emitted]

    def push(self, token_ids: Sequence[int]) -> DetokenizedDelta:
        """Add newly sampled tokens; returns the text that may be streamed now.

        Once a stop string matched, further pushes return an empty stopped delta.
        """
        if self._stopped:
            return DetokenizedDelta("", True)
        for token_id in token_ids:
            self._ids.append(token_id)
            self._text += self._step() if self._stream is not None else self._advance(final=False)
        return self._release()

    def push_token(self, token_id: int) -> str:
        """``push([token_id])`` for the engine's hot path: one token, the streamable text returned, whether a stop
        string ended the output left in ``stopped``. The same text as ``push``, with no delta object or list
        (per token of every running request, these were a fifth of the engine thread's postprocessing).
        """
        if self._stopped:
            return ""
        self._ids.append(token_id)
        new = self._step() if self._stream is not None else self._advance(final=False)
        if self._stop:
            self._text += new
            return self._release().text
        if new:  # no stop strings: nothing is held back
            self._text += new
            self._emitted = len(self._text)
        return new

    def flush(self) -> str:
        """At finish: the held-back text, plus any tokens that never completed a character (decoded lossily)."""
        if self._stopped:
            return ""
        self._text += self._advance(final=True)
        delta = self._release()
        if delta.stopped:
            return delta.text
        rest = self._text[self._emitted :]
        self._emitted = len(self._text)
        return delta.text + rest

    def _advance(self, final: bool) -> str:
        """The text the tokens after ``read_offset`` add, or "" while they end inside a character (unless final)."""
        if self._read_offset == len(self._ids):
            return ""
        head = self._decode(self._prefix_offset, self._read_offset)
        window = self._decode(self._prefix_offset, len(self._ids))
        if len(window) <= len(head) or (window.endswith(_REPLACEMENT) and not final):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return window[len(head) :]

    def _start_stream(self) -> DecodeStream | None:
        """tokenizers' own incremental decoder, primed with the context window, where the Rust tokenizer
        decodes as ``tokenizer.decode`` would (``rust_tokenizer``). It decodes what ``_advance`` does in
        one call instead of two decodes and their Python (0.5 µs a token against 2.1 on the generated
        tokenizer), which runs on the engine thread for every token of every request.
        """
        if self._rust is None:
            return None
        stream = DecodeStream(
            ids=self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip_special_tokens
        )
        try:
            for token_id in self._ids[self._read_offset :]:  # a resumed output's unfinished character, if any
                if stream.step(self._rust, token_id) is not None:  # not expected: the tail ends inside a character
                    return None
        except Exception:  # a decoder the stream cannot follow: windows, as in ``_step``
            logger.debug("incremental decode stream failed to start; decoding windows", exc_info=True)
            return None
        return stream

    def _step(self) -> str:
        """``_advance(final=False)`` for the newest token, through the stream; the offsets follow it, so that
        ``flush`` decodes any unfinished tail as ``_advance`` would."""
        stream, rust = self._stream, self._rust
        if stream is None or rust is None:
            return self._advance(final=False)
        try:
            chunk = stream.step(rust, self._ids[-1])
        except Exception:  # a decoder the stream cannot follow (tokenizers raises plain exceptions)
            logger.debug("incremental decode stream failed; decoding windows from here on", exc_info=True)
            self._stream = None
            return self._advance(final=False)
        if chunk is None:
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return chunk

    def _release(self) -> DetokenizedDelta:
        """Search the new text for stop strings and hand out what can no longer turn into one."""
        if len(self._ids) <= self._match_after:
            self._scanned = len(self._text)  # min_tokens: this text never ends the output
        match = self._find_stop()
        if match is not None:
            self._stopped = True
            self._matched = self._text[match[0] : match[1]]
            cut = match[1] if self._keep_stop else match[0]
            delta = self._text[self._emitted : cut]
            self._text = self._text[:cut]
            self._emitted = cut
            return DetokenizedDelta(delta, True)
        safe_end = len(self._text) - max(self._max_stop_len - 1, 0)
        if safe_end <= self._emitted:
            return DetokenizedDelta("", False)
        delta = self._text[self._emitted : safe_end]
        self._emitted = safe_end
        return DetokenizedDelta(delta, False)

    def _find_stop(self) -> tuple[int, int] | None:
        """Start and end of the stop string that completes first in the text not yet searched, if any.

        "Completes first" (earliest end, then earliest start) is what a character-by-character stream would see,
        so the outcome does not depend on how many tokens each push carried: with stops "abcd" and "bc", text
        "abcd" stops at "bc" whether "d" arrived in the same push or later.
        """
        if not self._stop or len(self._text) == self._scanned:
            return None
        # Text before _scanned held no whole stop string, so any match must end after it.
        start = max(self._scanned - self._max_stop_len + 1, 0)
        self._scanned = len(self._text)
        best: tuple[int, int] | None = None
        for stop in self._stop:
            i = self._text.find(stop, start)
            if i >= 0 and (best is None or (i + len(stop), i) < best):
                best = (i + len(stop), i)
        return None if best is None else (best[1], best[0])

    def _complete_end(self, prompt_len: int) -> int:
        """Where the resumed output's last whole character ends (the token count, prompt included).

        A resumed output may stop inside a character the client never received: those trailing tokens are left
        unread, so the character is emitted whole once it completes. If stepping back a few tokens does not help,
        the text really ends in U+FFFD (or invalid bytes) that the client already got, so nothing is left unread.
        """
        end = len(self._ids)
        for read in range(end, max(end - _MAX_CHAR_BYTES, prompt_len - 1), -1):
            # Output only: a prompt ending in broken bytes never merged with the output (see _context_start).
            if read == prompt_len or not self._decode(max(read - _CONTEXT_TOKENS, prompt_len), read).endswith(
                _REPLACEMENT
            ):
                return read
        return end

    def _context_start(self, end: int) -> int:
        """Where to start decoding for context before token ``end``: a few tokens back, or none at all.

        Slicing the window's text by the length of the context's text is only sound when the context ends on a
        whole character; a context ending in broken bytes is dropped, and the new tokens are decoded on their own.
        """
        start = max(end - _CONTEXT_TOKENS, 0)
        return end if self._decode(start, end).endswith(_REPLACEMENT) else start

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._decode_ids(self._ids[start:end])
