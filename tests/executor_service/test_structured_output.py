"""Structured output in the engine, on the generated tiny model: its random weights make free text
gibberish, so only the grammar's mask keeps the output in form.

Constrained greedy outputs always parse and validate (JSON schemas drawn by hypothesis), match
their regex, or are one of their choices; unconstrained rows batched with them still equal
``model.generate``; a request preempted or migrated mid-output continues its constraint exactly;
and the engine never waits for a compile.
"""

from __future__ import annotations

import json
import random
import re
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
import xgrammar as xgr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.lifecycle import FinishReason
from common.sampling_params import SamplingParams
from common.structured_output import StructuredKind, StructuredOutput
from executor_service.engine import Engine, _first_end, _last_end
from executor_service.engine_io import AdmitSpec, PlanUpdate, StepOutput
from executor_service.grammar_cache import GrammarCache
from executor_service.grammar_masks import OutputGrammar, resume_matcher
from tests.executor_service.reference import assert_matches_reference, load_reference_model, reference_greedy
from tests.executor_service.test_engine import make_engine, prompts

# The same examples every run: a suite that draws anew fails at random on whatever a draw finds
# (one found xgrammar's over-acceptance of ill-formed UTF-8, which the mask now rules out).
_settings = settings(
    max_examples=12,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    return make_engine(tiny_model_dir)


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    reason: FinishReason = FinishReason.NONE
    error: str = ""


def _collect(out: StepOutput, results: dict[str, Result]) -> None:
    for delta in out.tokens:
        result = results.setdefault(delta.request_id, Result())
        result.tokens += delta.token_ids
        result.text += delta.text
    for finish in out.finished:
        result = results.setdefault(finish.request_id, Result())
        result.text += finish.text
        result.reason, result.error = finish.reason, finish.error


def generate(engine: Engine, specs: list[AdmitSpec], max_steps: int = 3000) -> dict[str, Result]:
    """Run ``specs`` together to their ends; their grammars compiled first, so admission is at once."""
    assert engine.grammars is not None
    for spec in specs:
        if spec.params.structured_output is not None:
            engine.grammars.get(spec.params.structured_output).exception(timeout=60)  # compiled, or failed
    engine.apply(PlanUpdate(seq=engine.plan_seq + 1, admit=tuple(specs)))
    results: dict[str, Result] = {}
    for _ in range(max_steps):
        _collect(engine.step() if engine.has_work else engine.drain(), results)
        if all(results.get(s.request_id, Result()).reason is not FinishReason.NONE for s in specs):
            return results
    raise AssertionError(f"unfinished after {max_steps} steps")


def constrained(
    request_id: str,
    prompt: list[int],
    spec: StructuredOutput | None,
    max_tokens: int = 400,
    output: tuple[int, ...] = (),
) -> AdmitSpec:
    # ignore_eos: only the grammar ends these outputs, with the EOS it then forces.
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, structured_output=spec)
    return AdmitSpec(request_id, tuple(prompt), output, params, 0.0)


def json_schema(schema: dict[str, Any]) -> StructuredOutput:
    return StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(schema))


# ---- JSON schemas: objects of bounded strings, integers, booleans, enums and arrays ------------
_NAMES = ["id", "name", "ok", "tags", "n", "kind", "when"]


def _leaves() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.builds(
            lambda lo, span: {"type": "string", "minLength": lo, "maxLength": lo + span},
            st.integers(0, 2),
            st.integers(0, 6),
        ),
        st.builds(
            lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
            st.integers(-50, 50),
            st.integers(0, 1000),
        ),
        st.just({"type": "boolean"}),
        st.lists(st.text("abcxyz -", min_size=1, max_size=6), min_size=1, max_size=4, unique=True).map(
            lambda values: {"enum": values}
        ),
    )


def _values() -> st.SearchStrategy[dict[str, Any]]:
    arrays = st.builds(
        lambda items, lo, span: {"type": "array", "items": items, "minItems": lo, "maxItems": lo + span},
        _leaves(),
        st.integers(0, 2),
        st.integers(0, 3),
    )
    return st.one_of(_leaves(), arrays)


@st.composite
def object_schemas(draw: st.DrawFn, nested: bool = True) -> dict[str, Any]:
    names = draw(st.lists(st.sampled_from(_NAMES), min_size=1, max_size=4, unique=True))
    values = st.one_of(_values(), object_schemas(nested=False)) if nested else _values()
    properties = {name: draw(values) for name in names}
    required = draw(st.lists(st.sampled_from(names), unique=True))
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


@_settings
@given(schemas=st.lists(object_schemas(), min_size=1, max_size=3), seed=st.integers(0, 10_000))
def test_json_schema_outputs_parse_and_validate(engine: Engine, schemas: list[dict[str, Any]], seed: int) -> None:
    batch = prompts(len(schemas), seed=seed)
    specs = [constrained(f"j{i}", p, json_schema(s)) for i, (p, s) in enumerate(zip(batch, schemas, strict=True))]
    results = generate(engine, specs)
    for spec, schema in zip(specs, schemas, strict=True):
        result = results[spec.request_id]
        assert result.reason is FinishReason.STOP, (schema, result)
        assert result.tokens[-1] in engine.limits.eos_token_ids  # the end the grammar forced
        jsonschema.validate(json.loads(result.text), schema)


def test_a_json_string_takes_only_well_formed_utf8(engine: Engine) -> None:
    """xgrammar's matcher alone takes the overlong sequence E0 88 88 as one character of a string
    whose pattern is one character (it decodes to three U+FFFD); the engine's mask keeps the output
    well-formed."""
    assert engine.grammars is not None and engine.grammar_masks is not None
    schema = {"type": "array", "items": {"type": "string", "pattern": "^.$"}}
    grammar = engine.grammars.get(json_schema(schema)).result(timeout=60)
    tokenizer = engine.tokenizer
    # Byte-level tokens for '["', the bytes E0 88 88, then '"]': found by a drawn schema, greedy.
    ids = tokenizer.convert_tokens_to_ids(["[", '"', "à", "Ī", "Ī", '"', "]"])  # type: ignore[attr-defined]
    loose = xgr.GrammarMatcher(grammar.compiled)
    assert all(loose.accept_token(token) for token in ids), "xgrammar now refuses it: the mask's work is upstream"
    matcher = resume_matcher(grammar, ids[:3])  # '["' and the lead byte E0
    logits = torch.zeros(1, engine.grammars.vocab_size)
    engine.grammar_masks.apply(logits, [matcher])
    allowed = {i for i in range(logits.shape[1]) if logits[0, i] == 0}
    decoded = grammar.compiled.tokenizer_info.decoded_vocab
    # Only A0-BF may follow E0 (below is overlong); each of those bytes' own token is allowed.
    assert allowed and all(0xA0 <= decoded[i][0] <= 0xBF for i in allowed)
    assert {decoded.index(bytes([b])) for b in range(0xA0, 0xC0)} <= allowed
    assert decoded[ids[3]] == b"\x88" and ids[3] not in allowed


def test_string_outputs_stay_well_formed_utf8(engine: Engine) -> None:
    """Greedy outputs of one-character strings over many prompts: the case that found xgrammar's
    over-acceptance. Every output decodes without a replacement character and validates."""
    schema = {"type": "array", "items": {"type": "string", "maxLength": 1}, "minItems": 4, "maxItems": 8}
    batch = prompts(24, seed=11)
    specs = [constrained(f"u{i}", p, json_schema(schema)) for i, p in enumerate(batch)]
    results = generate(engine, specs)
    tokenizer = engine.tokenizer
    for spec in specs:
        result = results[spec.request_id]
        assert result.reason is FinishReason.STOP, result
        raw = tokenizer.convert_tokens_to_string(tokenizer.convert_ids_to_tokens(result.tokens[:-1]))  # type: ignore[attr-defined]
        assert "\ufffd" not in raw and "\ufffd" not in result.text, result.text
        jsonschema.validate(json.loads(result.text), schema)


REGEXES = [
    r"[a-z]{3,6}-\d{2}",
    r"\d{4}-\d{2}-\d{2}",
    r"(yes|no|maybe)!?",
    r"[A-Z][a-z]{0,5}( [A-Z][a-z]{0,5}){0,2}",
    r"0x[0-9a-f]{1,8}",
    r"(ab|cd){2,4}[.?]",
]


@_settings
@given(pattern=st.sampled_from(REGEXES), seed=st.integers(0, 10_000))
def test_regex_outputs_match(engine: Engine, pattern: str, seed: int) -> None:
    spec = constrained("re", prompts(1, seed=seed)[0], StructuredOutput(StructuredKind.REGEX, pattern))
    result = generate(engine, [spec])["re"]
    assert result.reason is FinishReason.STOP
    assert re.fullmatch(pattern, result.text), (pattern, result.text)


def test_choice_grammar_and_json_object_outputs(engine: Engine) -> None:
    choices = ("red", "green", "dark blue", 'say "hi"')
    grammar = 'root ::= "(" digit ("+" digit){0,3} ")"\ndigit ::= [0-9]'
    batch = prompts(9, seed=5)
    specs = [
        constrained(f"c{i}", p, StructuredOutput(StructuredKind.CHOICE, choices=choices))
        for i, p in enumerate(batch[:3])
    ]
    specs += [
        constrained(f"g{i}", p, StructuredOutput(StructuredKind.GRAMMAR, grammar)) for i, p in enumerate(batch[3:6])
    ]
    specs += [constrained(f"o{i}", p, StructuredOutput(StructuredKind.JSON_OBJECT)) for i, p in enumerate(batch[6:])]
    results = generate(engine, specs)
    assert all(r.reason is FinishReason.STOP for r in results.values()), results
    for i in range(3):
        assert results[f"c{i}"].text in choices
        assert re.fullmatch(r"\(\d(\+\d){0,3}\)", results[f"g{i}"].text)
        assert isinstance(json.loads(results[f"o{i}"].text), dict)


def test_unconstrained_rows_batched_with_constrained_ones_equal_generate(engine: Engine, tiny_model_dir: Path) -> None:
    model = load_reference_model(tiny_model_dir)
    rng = random.Random(3)
    batch = prompts(8, seed=11)
    schema = json_schema({"type": "object", "properties": {"a": {"type": "string", "maxLength": 5}}})
    regex = StructuredOutput(StructuredKind.REGEX, r"[a-z ]{20,40}")
    specs = [
        constrained(f"r{i}", p, [None, schema, regex][i % 3], max_tokens=rng.randrange(8, 30))
        for i, p in enumerate(batch)
    ]
    free = [s for s in specs if s.params.structured_output is None]
    results = generate(engine, specs)
    for spec in free:
        reference = reference_greedy(model, list(spec.prompt_ids), spec.params.max_tokens)
        assert_matches_reference(results[spec.request_id].tokens, reference, spec.request_id)


LONG = StructuredOutput(StructuredKind.REGEX, r"[a-z]{4}( [a-z]{2,6}){30,40}\.")


def _step_until(engine: Engine, request_id: str, count: int) -> list[int]:
    got: list[int] = []
    while len(got) < count:
        got += [t for d in engine.step().tokens if d.request_id == request_id for t in d.token_ids]
    return got


def test_preempted_request_continues_its_constraint_exactly(engine: Engine) -> None:
    prompt = prompts(1, seed=31)[0]
    whole = generate(engine, [constrained("w", prompt, LONG)])["w"]
    assert whole.reason is FinishReason.STOP and re.fullmatch(LONG.spec, whole.text)
    engine.apply(PlanUpdate(seq=engine.plan_seq + 1, admit=(constrained("p", prompt, LONG),)))
    got = _step_until(engine, "p", 17)
    engine.apply(PlanUpdate(seq=engine.plan_seq + 1, preempt=("p",)))
    assert engine.drain().preempted == ("p",)
    rest = generate(engine, [constrained("p", prompt, LONG, output=tuple(got))])["p"]
    assert got + rest.tokens == whole.tokens
    assert rest.reason is FinishReason.STOP


def test_migrated_request_continues_on_a_fresh_engine(engine: Engine, tiny_model_dir: Path) -> None:
    """Another executor, with no grammar compiled yet: it compiles, replays the output, continues."""
    prompt = prompts(1, seed=32)[0]
    whole = generate(engine, [constrained("m", prompt, LONG)])["m"]
    other = make_engine(tiny_model_dir)
    rest = generate(other, [constrained("m", prompt, LONG, output=tuple(whole.tokens[:23]))])["m"]
    assert whole.tokens[:23] + rest.tokens == whole.tokens


def test_readmitted_over_itself_restarts_from_the_schedulers_tokens(engine: Engine) -> None:
    prompt = prompts(1, seed=33)[0]
    whole = generate(engine, [constrained("x", prompt, LONG)])["x"]
    engine.apply(PlanUpdate(seq=engine.plan_seq + 1, admit=(constrained("x", prompt, LONG),)))
    _step_until(engine, "x", 12)
    rest = generate(engine, [constrained("x", prompt, LONG, output=tuple(whole.tokens[:5]))])["x"]
    assert rest.tokens[-(len(whole.tokens) - 5) :] == whole.tokens[5:]


def test_resumed_output_that_breaks_or_completes_the_grammar(engine: Engine) -> None:
    tokenizer = engine.tokenizer
    spec = StructuredOutput(StructuredKind.CHOICE, choices=("yes", "no"))
    broken = tuple(tokenizer.encode("maybe", add_special_tokens=False))  # type: ignore[attr-defined]
    done = (*tokenizer.encode("no", add_special_tokens=False), min(engine.limits.eos_token_ids))  # type: ignore[attr-defined]
    results = generate(
        engine, [constrained("b", [1, 5, 6], spec, output=broken), constrained("d", [1, 5, 6], spec, output=done)]
    )
    assert results["b"].reason is FinishReason.ERROR and "does not follow" in results["b"].error
    assert results["d"].reason is FinishReason.STOP and not results["d"].tokens


class GatedCache(GrammarCache):
    """Compiles only once the test opens the gate: a compile that takes as long as the test likes."""

    def __init__(self, base: GrammarCache) -> None:
        super().__init__(base._tokenizer, base.vocab_size, base._stop_token_ids)
        self.gate = threading.Event()

    def _compile(self, spec: StructuredOutput) -> OutputGrammar:
        assert self.gate.wait(timeout=60)
        return super()._compile(spec)


@pytest.fixture
def gated(tiny_model_dir: Path) -> Iterator[tuple[Engine, GatedCache]]:
    engine = make_engine(tiny_model_dir)
    assert engine.grammars is not None
    cache = GatedCache(engine.grammars)
    engine.grammars = cache
    yield engine, cache
    cache.gate.set()
    cache.close()


def test_a_compile_never_holds_the_engine(gated: tuple[Engine, GatedCache]) -> None:
    engine, cache = gated
    batch = prompts(4, seed=34)
    regex = StructuredOutput(StructuredKind.REGEX, r"[a-z]{5}")
    specs = [constrained(f"q{i}", p, regex) for i, p in enumerate(batch[:3])]
    free = constrained("free", batch[3], None, max_tokens=6)
    engine.apply(PlanUpdate(seq=1, admit=(*specs, free)))
    assert set(engine.running) == {"free"} and engine.has_work
    results: dict[str, Result] = {}
    while engine.has_work:  # the free request runs to its end while the grammar compiles
        _collect(engine.step(), results)
    assert results["free"].reason is FinishReason.LENGTH and not engine.has_work
    engine.apply(PlanUpdate(seq=2, abort=("q0",), preempt=("q1",)))
    out = engine.drain()
    assert [(f.request_id, f.reason) for f in out.finished] == [("q0", FinishReason.CANCELLED)]
    assert out.preempted == ("q1",)
    cache.gate.set()
    future: Future[xgr.CompiledGrammar] = cache.get(regex)
    future.result(timeout=60)
    assert engine.has_work  # compiled: the next step admits q2
    for _ in range(100):
        _collect(engine.step() if engine.has_work else engine.drain(), results)
        if "q2" in results and results["q2"].reason is not FinishReason.NONE:
            break
    assert re.fullmatch(regex.spec, results["q2"].text) and set(results) == {"free", "q2"}


def test_a_constraint_that_does_not_compile_ends_with_an_error(engine: Engine) -> None:
    """The scheduler refuses these; an executor that gets one anyway ends that request alone."""
    bad = constrained("bad", [1, 5, 6], StructuredOutput(StructuredKind.REGEX, "(unclosed"))
    ok = constrained("ok", [1, 5, 7], StructuredOutput(StructuredKind.REGEX, "[0-9]{3}"))
    assert engine.grammars is not None
    with pytest.raises(ValueError):
        engine.grammars.get(StructuredOutput(StructuredKind.REGEX, "(unclosed")).result(timeout=60)
    results = generate(engine, [bad, ok])
    assert results["bad"].reason is FinishReason.ERROR and "parenthesis is not closed" in results["bad"].error
    assert re.fullmatch("[0-9]{3}", results["ok"].text)


def test_bans_narrow_a_grammar_and_a_grammar_they_empty_ends_alone(engine: Engine) -> None:
    """allowed_token_ids and bad words apply inside the grammar's mask; where together they leave
    no token, that request ends with an error and its batch-mates go on."""
    choice = StructuredOutput(StructuredKind.CHOICE, choices=("0", "1"))
    digits = StructuredOutput(StructuredKind.REGEX, "[0-9]{3}")
    tokenizer = engine.tokenizer
    zero, one = (tokenizer.encode(c, add_special_tokens=False) for c in "01")  # type: ignore[attr-defined]
    prompt = prompts(1, seed=6)[0]
    banned = SamplingParams(max_tokens=8, ignore_eos=True, structured_output=choice, bad_words_token_ids=(tuple(zero),))
    emptied = SamplingParams(max_tokens=8, ignore_eos=True, structured_output=digits, allowed_token_ids=(1,))
    results = generate(
        engine,
        [
            AdmitSpec("banned", tuple(prompt), (), banned, 0.0),
            AdmitSpec("emptied", tuple(prompt), (), emptied, 0.0),
            constrained("ok", prompt, digits),
        ],
    )
    assert len(one) == 1 and results["banned"].text == "1" and results["banned"].reason is FinishReason.STOP
    assert results["emptied"].reason is FinishReason.ERROR and "no token may be sampled" in results["emptied"].error
    assert re.fullmatch("[0-9]{3}", results["ok"].text)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_grammar_at_a_dead_end_ends_its_request_alone(engine: Engine, temperature: float) -> None:
    """A pattern no string matches compiles, and its grammar then accepts no token at all. Sampled,
    the row of -inf was NaN and the step failed, the engine thread with it (and the request,
    re-queued, took down every executor it met); greedy, it took token 0."""
    dead_end = StructuredOutput(StructuredKind.REGEX, r"a[^\s\S]")
    params = SamplingParams(max_tokens=8, ignore_eos=True, structured_output=dead_end, temperature=temperature, seed=1)
    prompt = prompts(1, seed=7)[0]
    digits = StructuredOutput(StructuredKind.REGEX, "[0-9]{3}")
    results = generate(engine, [AdmitSpec("stuck", tuple(prompt), (), params, 0.0), constrained("ok", prompt, digits)])
    assert results["stuck"].reason is FinishReason.ERROR and "no token may be sampled" in results["stuck"].error
    assert results["stuck"].text in ("", "a")
    assert re.fullmatch("[0-9]{3}", results["ok"].text)


def test_a_constraint_waiting_for_the_end_of_thinking_holds_only_after_it(engine: Engine) -> None:
    """vLLM's reasoning models: the grammar holds the answer, after ``</think>``, not the thinking."""
    tokenizer = engine.tokenizer
    end = tuple(tokenizer.encode("</think>", add_special_tokens=False))  # type: ignore[attr-defined]
    assert len(end) > 1  # several tokens here, so a step can write the last of them
    waiting = StructuredOutput(StructuredKind.REGEX, "[0-9]{3}", starts_after="</think>", reopened_by="<think>")
    prompt = prompts(1, seed=7)[0]

    def spec(request_id: str, prompt: list[int], output: tuple[int, ...] = (), **params: object) -> AdmitSpec:
        sampling = SamplingParams(max_tokens=12, ignore_eos=True, structured_output=waiting, **params)  # type: ignore[arg-type]
        return AdmitSpec(request_id, tuple(prompt), output, sampling, 0.0)

    thinking = (*prompt[:3], *end[:-1])  # the output so far stops one token short of the end tag
    start = tuple(tokenizer.encode("<think>", add_special_tokens=False))  # type: ignore[attr-defined]
    results = generate(
        engine,
        [
            spec("closed-in-prompt", [*prompt, *end]),  # a template that switched the thinking off
            spec("closed-then-reopened", [*end, *prompt, *start]),  # earlier turns closed theirs; this one opens
            spec("reopened-then-closed", [*prompt, *start, *end]),  # a template that wrote an empty thinking
            spec("thought-before", prompt, (*prompt[:4], *end)),  # re-admitted after its thinking
            spec("thinking", prompt),  # never writes the tag: free text to max_tokens
            spec("ends-thinking", prompt, thinking, logit_bias=((end[-1], 100.0),)),  # writes the last tag token
        ],
    )
    assert re.fullmatch("[0-9]{3}", results["closed-in-prompt"].text)
    assert re.fullmatch("[0-9]{3}", results["reopened-then-closed"].text)
    reopened = results["closed-then-reopened"]
    assert reopened.reason is FinishReason.LENGTH and not re.fullmatch("[0-9]{3}", reopened.text)
    assert re.fullmatch("[0-9]{3}", results["thought-before"].text)
    assert results["thinking"].reason is FinishReason.LENGTH and len(results["thinking"].tokens) == 12
    assert not re.fullmatch("[0-9]{3}", results["thinking"].text)
    ends = results["ends-thinking"]
    answer = tokenizer.decode(ends.tokens[1:], skip_special_tokens=True)  # type: ignore[attr-defined]
    assert ends.tokens[0] == end[-1] and re.fullmatch("[0-9]{3}", answer)
    assert ends.reason is FinishReason.STOP


def test_a_resumed_answer_that_writes_the_waited_text_replays_from_where_it_began(engine: Engine) -> None:
    """The prompt closed the thinking, so the constraint held from the output's start; the answer
    itself writes ``</think>``. Resumed, its grammar replays the whole output, not what follows
    the tag (which wrote the form twice, or broke it)."""
    tokenizer = engine.tokenizer
    end = tuple(tokenizer.encode("</think>", add_special_tokens=False))  # type: ignore[attr-defined]
    seven = tuple(tokenizer.encode("7", add_special_tokens=False))  # type: ignore[attr-defined]
    form = StructuredOutput(StructuredKind.REGEX, "[0-9]</think>[0-9]{2}", starts_after="</think>")
    params = SamplingParams(max_tokens=12, ignore_eos=True, structured_output=form)
    prompt = [*prompts(1, seed=9)[0], *end]
    results = generate(engine, [AdmitSpec("resumed", tuple(prompt), (*seven, *end), params, 0.0)])
    assert results["resumed"].reason is FinishReason.STOP and re.fullmatch("[0-9]{2}", results["resumed"].text)


@pytest.mark.parametrize(
    ("ids", "part", "first"),
    [([1, 2, 3, 1, 2, 3, 4], (1, 2), 2), ([3, 3, 3], (3, 3), 2), ([1, 2], (2, 3), None), ([], (1,), None)],
)
def test_the_first_end_of_a_waited_text(ids: list[int], part: tuple[int, ...], first: int | None) -> None:
    assert _first_end(ids, part) == first


@pytest.mark.parametrize(
    ("ids", "part", "end"),
    [
        ([1, 2, 3, 1, 2, 3, 4], (1, 2), 5),
        ((5, 1, 2), (1, 2), 3),
        ([1, 2], (2, 3), None),
        ([], (1,), None),
        ([3, 3, 3], (3, 3), 3),
    ],
)
def test_the_last_end_of_a_waited_text(ids: list[int], part: tuple[int, ...], end: int | None) -> None:
    assert _last_end(ids, part) == end


def test_a_form_complete_before_min_tokens_ends_its_request_alone(engine: Engine) -> None:
    """As vLLM accepts it: min_tokens masks the EOS that a complete form alone allows, so nothing is
    left to sample there; that request ends with an error, sampled or greedy, its batch-mates go on."""
    one_digit = StructuredOutput(StructuredKind.REGEX, "[0-9]")
    params = SamplingParams(max_tokens=8, min_tokens=4, structured_output=one_digit, temperature=0.7, seed=2)
    prompt = prompts(1, seed=8)[0]
    digits = StructuredOutput(StructuredKind.REGEX, "[0-9]{3}")
    results = generate(engine, [AdmitSpec("held", tuple(prompt), (), params, 0.0), constrained("ok", prompt, digits)])
    assert results["held"].reason is FinishReason.ERROR and "no token may be sampled" in results["held"].error
    assert re.fullmatch("[0-9]{3}", results["ok"].text)
