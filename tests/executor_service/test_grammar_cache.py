"""The executor's grammar cache: compiles on its worker thread, one future per constraint, bounded
by the compiled grammars' memory."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from common.errors import InvalidRequest
from common.structured_output import StructuredKind, StructuredOutput
from executor_service.grammar_cache import GrammarCache

A = StructuredOutput(StructuredKind.REGEX, "[a-z]{3}")
B = StructuredOutput(StructuredKind.CHOICE, choices=("x", "y"))
C = StructuredOutput(StructuredKind.JSON_OBJECT)


@pytest.fixture
def cache(tiny_model_dir: Path) -> Iterator[GrammarCache]:
    grammars = GrammarCache(AutoTokenizer.from_pretrained(tiny_model_dir), 8192, {2})
    yield grammars
    grammars.close()


def test_compiles_on_its_own_thread_once_per_constraint(cache: GrammarCache) -> None:
    threads: list[str] = []
    compile_ = cache._compile

    def recording(spec: StructuredOutput) -> object:
        threads.append(threading.current_thread().name)
        return compile_(spec)

    cache._compile = recording  # type: ignore[method-assign,assignment]
    first = cache.get(A)
    assert cache.get(StructuredOutput(StructuredKind.REGEX, "[a-z]{3}")) is first  # equal values, one entry
    grammar = first.result(timeout=60)
    assert grammar.compiled.tokenizer_info.vocab_size == 8192
    assert len(threads) == 1 and threads[0].startswith("baton-grammar")
    assert threads[0] != threading.current_thread().name
    assert grammar.utf8 is cache.get(B).result(timeout=60).utf8  # one UTF-8 table for the tokenizer


def test_a_constraint_that_does_not_compile_gives_its_error(cache: GrammarCache) -> None:
    error = cache.get(StructuredOutput(StructuredKind.GRAMMAR, "root ::= missing")).exception(timeout=60)
    assert isinstance(error, InvalidRequest) and 'Rule "missing" is not defined' in str(error)


def test_least_recently_used_grammars_go_past_the_memory_bound(cache: GrammarCache) -> None:
    for spec in (A, B, C):
        cache.get(spec).result(timeout=60)
    cache.get(A)  # now the most recently used: B, C, A
    cache.max_bytes = cache.get(A).result().compiled.memory_size_bytes
    cache._evict()
    assert list(cache._entries) == [A]
