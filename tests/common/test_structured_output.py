"""The structured-output constraint: its shape checks, its encodings (Redis JSON inside the sampling
parameters, the wire), and how each kind becomes an xgrammar grammar."""

from __future__ import annotations

import json
from typing import Any

import pytest
import xgrammar as xgr

from common import structured_grammar
from common.errors import InvalidRequest
from common.pb import executor_pb2
from common.pb import generate_pb2 as pb
from common.sampling_params import SamplingParams
from common.structured_output import StructuredKind, StructuredOutput

EVERY_KIND = [
    StructuredOutput(StructuredKind.JSON_SCHEMA, '{"type":"object","properties":{"a":{"type":"integer"}}}'),
    StructuredOutput(StructuredKind.JSON_OBJECT),
    StructuredOutput(StructuredKind.REGEX, r"[a-z]{2,4}\d"),
    StructuredOutput(StructuredKind.GRAMMAR, 'root ::= "yes" | "no"'),
    StructuredOutput(StructuredKind.CHOICE, choices=("red", 'a "quoted" \\ one', "é\n")),
    StructuredOutput(StructuredKind.JSON_OBJECT, starts_after="</think>"),
    StructuredOutput(StructuredKind.CHOICE, choices=("a",), starts_after="</think>"),
    StructuredOutput(StructuredKind.REGEX, "[0-9]", starts_after="</think>"),
    StructuredOutput(StructuredKind.REGEX, "[0-9]", starts_after="</think>", reopened_by="<think>"),
]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kind": StructuredKind.JSON_SCHEMA},
        {"kind": StructuredKind.REGEX, "spec": ""},
        {"kind": StructuredKind.GRAMMAR},
        {"kind": StructuredKind.JSON_OBJECT, "spec": "{}"},
        {"kind": StructuredKind.CHOICE},
        {"kind": StructuredKind.CHOICE, "spec": "x", "choices": ("a",)},
        {"kind": StructuredKind.REGEX, "spec": "a", "choices": ("a",)},
        {"kind": "xml", "spec": "a"},
        {"kind": StructuredKind.JSON_OBJECT, "starts_after": "x" * 65},
        {"kind": StructuredKind.JSON_OBJECT, "reopened_by": "x" * 65},
    ],
)
def test_malformed_constraints_raise(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        StructuredOutput(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("spec", EVERY_KIND, ids=[s.kind.value for s in EVERY_KIND])
def test_encodings_round_trip(spec: StructuredOutput) -> None:
    assert StructuredOutput.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert StructuredOutput.from_pb(pb.StructuredOutput.FromString(spec.to_pb().SerializeToString())) == spec
    params = SamplingParams(max_tokens=5, structured_output=spec)
    assert SamplingParams.from_json(params.to_json()) == params
    wire = executor_pb2.ExecSampling.FromString(params.to_pb().SerializeToString())
    assert SamplingParams.from_pb(wire) == params
    hash(params)


def test_what_a_constraint_waits_for_is_not_part_of_its_grammar() -> None:
    waiting = StructuredOutput(StructuredKind.REGEX, "[0-9]", starts_after="</think>", reopened_by="<think>")
    assert waiting.grammar == StructuredOutput(StructuredKind.REGEX, "[0-9]") != waiting
    assert waiting.size == len("[0-9]") + len("</think>") + len("<think>")


def test_unset_constraint_is_none_everywhere() -> None:
    assert StructuredOutput.from_pb(pb.StructuredOutput()) is None
    assert SamplingParams.from_pb(SamplingParams().to_pb()).structured_output is None
    assert not SamplingParams().to_pb().HasField("structured_output")
    assert json.loads(SamplingParams().to_json())["structured_output"] is None
    assert SamplingParams.from_json('{"max_tokens": 3}').structured_output is None  # a record from before it


def test_where_a_constraint_starts_without_a_constraint_is_refused() -> None:
    for empty in (pb.StructuredOutput(starts_after="</think>"), pb.StructuredOutput(reopened_by="<think>")):
        with pytest.raises(InvalidRequest, match="no kind of constraint"):
            StructuredOutput.from_pb(empty)


def test_json_object_false_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="json_object must be true"):
        StructuredOutput.from_pb(pb.StructuredOutput(json_object=False))


def test_min_tokens_may_come_with_a_constrained_output() -> None:
    # As in vLLM: where the form is complete before min_tokens, its request ends with an error.
    assert SamplingParams(max_tokens=8, min_tokens=2, structured_output=EVERY_KIND[1]).min_tokens == 2


@pytest.mark.parametrize("spec", EVERY_KIND, ids=[s.kind.value for s in EVERY_KIND])
def test_every_kind_parses(spec: StructuredOutput) -> None:
    assert isinstance(structured_grammar.parse(spec), xgr.Grammar)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutput(StructuredKind.JSON_SCHEMA, "{not json"), "Failed to parse JSON"),
        (StructuredOutput(StructuredKind.JSON_SCHEMA, '{"type": "nonsense"}'), 'Unsupported type "nonsense"'),
        (StructuredOutput(StructuredKind.JSON_SCHEMA, "[1]"), "Schema should be an object or bool"),
        (StructuredOutput(StructuredKind.REGEX, "(ab"), "parenthesis is not closed"),
        (StructuredOutput(StructuredKind.GRAMMAR, 'start ::= "a"'), 'root rule with name "root" is not found'),
        (StructuredOutput(StructuredKind.GRAMMAR, "root ::= other"), 'Rule "other" is not defined'),
    ],
)
def test_invalid_specs_say_why_without_source_locations(spec: StructuredOutput, message: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        structured_grammar.parse(spec)
    text = str(err.value)
    assert text.startswith(f"structured_output {spec.kind}: ") and message in text
    assert ".cc:" not in text and "Check failed" not in text


def test_choices_match_exactly_themselves() -> None:
    """Quotes, backslashes, newlines and non-ASCII text survive the EBNF literals."""
    spec = EVERY_KIND[-1]
    grammar = structured_grammar.parse(spec)
    info = xgr.TokenizerInfo([chr(c) for c in range(32, 127)] + ["é", "\n", "</s>"], stop_token_ids=[98])
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_grammar(grammar)
    for text in [*spec.choices, "re", "red!", "é"]:
        matcher = xgr.GrammarMatcher(compiled)
        accepted = matcher.accept_string(text) and matcher.is_completed()
        assert accepted == (text in spec.choices), text


def test_json_schema_output_layout_is_fixed() -> None:
    """One space after ',' and ':', no other whitespace; properties beyond the schema's are not generated."""
    spec = StructuredOutput(StructuredKind.JSON_SCHEMA, '{"type":"object","properties":{"a":{"type":"integer"}}}')
    info = xgr.TokenizerInfo([chr(c) for c in range(32, 127)] + ["</s>"], stop_token_ids=[95])
    compiled = structured_grammar.compile_grammar(xgr.GrammarCompiler(info, max_threads=1), spec)
    for text, ok in [('{"a": 1}', True), ('{"a":1}', False), ('{ "a": 1}', False), ('{"a": 1, "b": 2}', False)]:
        matcher = xgr.GrammarMatcher(compiled)
        assert (matcher.accept_string(text) and matcher.is_completed()) == ok, text


def test_required_names_the_properties_leave_out_are_named() -> None:
    """xgrammar's strict mode writes only the properties an object names: a required name it did
    not was never written, and no output validated."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "o": {"type": "object", "required": ["deep"]}},
        "patternProperties": {"^n_": {"type": "number"}},
        "required": ["a", "b", "n_1"],
        "additionalProperties": {"type": "boolean"},
        "enum": [{"required": ["data"]}],  # data, not a schema
    }
    out = structured_grammar.required_properties_named(schema)
    assert out["properties"]["b"] == {"type": "boolean"} and out["properties"]["n_1"] == {"type": "number"}
    assert out["properties"]["o"]["properties"] == {"deep": {}}  # any value, as JSON Schema allows
    assert out["enum"] == schema["enum"]
    with pytest.raises(InvalidRequest, match="requires 'b' and allows no such property"):
        strict = {"type": "object", "properties": {}, "required": ["b"], "additionalProperties": False}
        structured_grammar.parse(StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(strict)))
    info = xgr.TokenizerInfo([chr(c) for c in range(32, 127)] + ["</s>"], stop_token_ids=[95])
    spec = StructuredOutput(StructuredKind.JSON_SCHEMA, '{"type":"object","properties":{},"required":["b"]}')
    matcher = xgr.GrammarMatcher(structured_grammar.compile_grammar(xgr.GrammarCompiler(info, max_threads=1), spec))
    assert matcher.accept_string('{"b": [1]}') and matcher.is_completed()


def test_choices_past_the_basic_multilingual_plane_stay_utf8() -> None:
    # Escaped as JSON escapes them (a surrogate pair), xgrammar read two lone surrogates.
    assert structured_grammar.choice_ebnf(("😀", 'a"b')) == 'root ::= "😀" | "a\\"b"'
    info = xgr.TokenizerInfo(["😀", "a", "</s>"], stop_token_ids=[2])
    spec = StructuredOutput(StructuredKind.CHOICE, choices=("😀",))
    matcher = xgr.GrammarMatcher(structured_grammar.compile_grammar(xgr.GrammarCompiler(info, max_threads=1), spec))
    assert matcher.accept_string("😀") and matcher.is_completed()


@pytest.mark.parametrize("most", [1, 3, 9_000])
def test_bounded_strings_never_hold_raw_control_characters(most: int) -> None:
    """JSON forbids them inside strings; strict parsers refuse the output. xgrammar's own class for
    a bounded string let them through at any bound (its text, rewritten, is pinned here; a bound of
    1 is one optional character rather than a repetition)."""
    info = xgr.TokenizerInfo([chr(c) for c in range(0, 127)] + ["é", "</s>"], stop_token_ids=[128])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 1, "maxLength": most}}}
    spec = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps({**schema, "required": ["s"]}))
    grammar = str(structured_grammar.parse(spec))
    assert '[^\\0-\\x1f\\"\\\\]' in grammar and '[^\\"\\\\\\r\\n]' not in grammar
    compiled = structured_grammar.compile_grammar(compiler, spec)
    cases = [("\t", False), ("\x01", False), ("é", True), ("", False), ("a" * (most + 1), False)]
    cases += [("a\tb", False), ("abc", True), ("éa", True)] if most >= 3 else []
    for text, ok in cases:
        matcher = xgr.GrammarMatcher(compiled)
        assert (matcher.accept_string(f'{{"s": "{text}"}}') and matcher.is_completed()) == ok, repr(text)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        {"type": "array", "contains": {"const": 5}},
        {"type": "integer", "not": {"const": 1}},
        {"type": "object", "dependentRequired": {"a": ["b"]}},
        {"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 6}},
        {"allOf": [{"type": "integer", "minimum": 3}, {"maximum": 5}]},
        {"type": "string", "pattern": "a+", "maxLength": 3},
        {"type": "object", "properties": {"e": {"type": "string", "format": "email", "minLength": 5}}},
        {"type": "string", "pattern": "(?=x)y"},
        # A quote, a backslash or a control character written literally went into the JSON as it is.
        {"type": "string", "pattern": '^"[a-z]+"$'},
        {"type": "string", "pattern": "^a\\\\b$"},
        {"type": "string", "pattern": "^a\\tb$"},
    ],
)
def test_keywords_the_grammar_would_not_enforce_are_refused(schema: dict[str, Any]) -> None:
    # xgrammar accepts each and lets an output break it: refused as vLLM refuses them for xgrammar.
    with pytest.raises(InvalidRequest, match="could not enforce"):
        structured_grammar.parse(StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(schema)))


def test_a_schema_nested_past_the_limit_is_refused_and_one_at_it_served() -> None:
    """Parsing costs about the cube of a schema's inline nesting: past the limit it is refused at
    once (it took seconds to minutes), and the same depth through $ref is served."""

    def arrays(depth: int) -> str:
        return '{"type":"array","items":' * depth + '{"type":"integer"}' + "}" * depth

    assert structured_grammar.nesting_depth(json.loads(arrays(3))) == 4 and structured_grammar.nesting_depth(5) == 0
    at_limit = StructuredOutput(StructuredKind.JSON_SCHEMA, arrays(structured_grammar.MAX_SCHEMA_DEPTH - 1))
    assert structured_grammar.parse(at_limit)
    with pytest.raises(InvalidRequest, match=r"nests 461 levels deep, more than 128: .*\$defs"):
        structured_grammar.parse(StructuredOutput(StructuredKind.JSON_SCHEMA, arrays(460)))
    defs = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(460)}
    chained = {"$defs": {**defs, "d460": {"type": "integer"}}, "$ref": "#/$defs/d0"}
    assert structured_grammar.parse(StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(chained)))


def test_what_the_grammar_enforces_or_may_ignore_is_served() -> None:
    for schema in (
        {"allOf": [{"type": "integer", "maximum": 5}]},  # one schema: Pydantic's way of describing a $ref
        {"type": "string", "format": "int32"},  # an unknown format is an annotation
        {"enum": [{"not": 1}]},  # data, not a schema
        {"type": "array", "uniqueItems": False},
    ):
        assert structured_grammar.parse(StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(schema)))


@pytest.mark.parametrize(
    "pattern",
    ['a\\"b', "a\\u0022b", "a\\x5cb", "a\\u0009b", "a\\cIb", "a\\0b", 'a["]b', "a[\\t]b", "a[\\\\]b", "a[\\n ]b"],
)
def test_patterns_that_write_a_raw_quote_backslash_or_control_character_are_found(pattern: str) -> None:
    # Each went into the JSON as it is: a literal, an escape of one, or a class listing one (a
    # one-member class is a literal to xgrammar).
    assert structured_grammar.writes_raw_characters(pattern)


def test_patterns_that_only_exclude_or_span_such_characters_are_served() -> None:
    # A negated class, ``.``, shorthands and ranges are held to JSON's rules by xgrammar itself.
    for pattern in ('^[^@"]+@[a-z]+$', "^[\\w\\s]+$", "^a\\.b$", "^[^\\\\/]+$", "^[ -~]{3}$", "^\\x41\\u00e9$"):
        assert not structured_grammar.writes_raw_characters(pattern), pattern


def test_lark_grammars_are_told_from_ebnf_as_vllm_tells_them() -> None:
    info = xgr.TokenizerInfo(["yes", "no", "maybe", "</s>"], stop_token_ids=[3])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    for grammar in ('start: "yes" | "no"', '// a comment with ::= in it\nstart: "yes" | "no"', 'root ::= "yes" | "no"'):
        compiled = structured_grammar.compile_grammar(compiler, StructuredOutput(StructuredKind.GRAMMAR, grammar))
        for text, ok in (("yes", True), ("maybe", False)):
            matcher = xgr.GrammarMatcher(compiled)
            assert (matcher.accept_string(text) and matcher.is_completed()) == ok, (grammar, text)
