"""Compiled grammars of structured outputs, compiled on a worker thread and kept by constraint.

Compiling a grammar walks the whole vocabulary (xgrammar precomputes which tokens each grammar
position accepts), milliseconds for a small schema and far more for a large one over a large
vocabulary. The engine thread never waits for that: ``get`` hands back a future at once, and the
engine admits the request only once it is done (``Engine._admit``). One worker thread compiles,
one grammar at a time, so compiles never take more than one core from the model's steps.

The constraint value itself (``StructuredOutput``, frozen) is the key. Entries are kept most
recently used last and dropped from the front past ``max_bytes`` of compiled grammar; one still
compiling is never dropped (its size is unknown), and a request holds its own grammar whatever the
cache drops. xgrammar's own compiler cache is off: this one is the only copy.

The compiler, with its view of the tokenizer (``xgrammar.TokenizerInfo``, a pass over the
vocabulary), and the tokenizer's UTF-8 table (``utf8_vocabulary.py``) are built by the worker on
the first compile, so an executor that never sees a structured request never pays for them.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar as xgr

from common import structured_grammar
from common.structured_output import StructuredOutput
from executor_service.grammar_masks import OutputGrammar
from executor_service.utf8_vocabulary import Utf8Vocabulary

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 256 * 1024 * 1024


class GrammarCache:
    def __init__(
        self,
        tokenizer: object,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        """``vocab_size``: the model's logits width (may exceed the tokenizer's: padded ids are
        never allowed); ``stop_token_ids``: the tokens that end a complete output (EOS)."""
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self.max_bytes = max_bytes
        self._tokenizer = tokenizer
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None  # the worker's alone
        self._utf8: Utf8Vocabulary | None = None  # the worker's alone
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="baton-grammar")
        self._entries: OrderedDict[StructuredOutput, Future[OutputGrammar]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, spec: StructuredOutput) -> Future[OutputGrammar]:
        """The compiled grammar of ``spec``, compiled or on its way. Engine thread only. A spec that
        does not compile gives a future holding InvalidRequest."""
        future = self._entries.get(spec)
        if future is not None:
            self._entries.move_to_end(spec)
            return future
        future = self._pool.submit(self._compile, spec)
        self._entries[spec] = future
        self._evict()
        return future

    def _evict(self) -> None:
        total = sum(self._size(f) for f in self._entries.values())
        for spec, future in list(self._entries.items()):
            if total <= self.max_bytes:
                return
            if future.done():
                total -= self._size(future)
                del self._entries[spec]

    @staticmethod
    def _size(future: Future[OutputGrammar]) -> int:
        if not future.done() or future.exception() is not None:
            return 0
        return int(future.result().compiled.memory_size_bytes)

    def _compile(self, spec: StructuredOutput) -> OutputGrammar:
        started = time.perf_counter()
        if self._compiler is None or self._utf8 is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer,  # type: ignore[arg-type]  # the engine's Hugging Face tokenizer
                vocab_size=self.vocab_size,
                stop_token_ids=self._stop_token_ids,
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            words = xgr.allocate_token_bitmask(1, self.vocab_size).shape[1]
            neutral = [*info.special_token_ids, *info.stop_token_ids]
            self._utf8 = Utf8Vocabulary(info.decoded_vocab, neutral, words)
        compiled = structured_grammar.compile_grammar(self._compiler, spec)
        log.info("compiled a %s grammar in %.1f ms", spec.kind, (time.perf_counter() - started) * 1000)
        return OutputGrammar(compiled, self._utf8)

    def close(self) -> None:
        """Stop the worker; compiles not started are cancelled."""
        self._pool.shutdown(wait=False, cancel_futures=True)
