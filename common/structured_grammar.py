"""How a ``StructuredOutput`` becomes an xgrammar grammar: parsed (the scheduler's check) or compiled
against a tokenizer (the executor's, for its token masks).

One table per step says, for each kind, the grammar xgrammar builds, so the scheduler rejects
exactly what the executor could not compile:
- json_schema: the schema, written with ", " and ": " between items and no other whitespace
  (``any_whitespace=False``): one layout, the fewest tokens, and no model can stall in an endless
  run of spaces. xgrammar's strict mode: properties and items the schema does not name are not
  generated unless it allows them (the output still validates against the schema). Strings with a
  length bound go to xgrammar as the equivalent ``pattern`` (``bounded_strings_as_patterns``).
- json_object: the schema ``{"type": "object"}`` in the same layout, with any properties.
- regex, grammar (EBNF, xgrammar's GBNF-like syntax with a ``root`` rule): as given.
- choice: the EBNF alternation of the choices as string literals.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import xgrammar as xgr

from common.errors import InvalidRequest
from common.structured_output import StructuredKind, StructuredOutput

_JSON_OBJECT_SCHEMA = '{"type": "object"}'
# xgrammar prefixes its messages with a time and a C++ source location: not the client's business.
_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: (Check failed: \(.*?\) is false: )?")


def choice_ebnf(choices: tuple[str, ...]) -> str:
    """``root ::= "a" | "b"``: JSON's string escapes are EBNF's (quotes, backslashes, \\n); other
    characters go as they are, since a character past the Basic Multilingual Plane escaped as JSON
    escapes it (a surrogate pair) is two lone surrogates to xgrammar, and the output not UTF-8."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# Keys whose values are data, not schemas: nothing under them is rewritten.
_DATA_KEYS = frozenset({"enum", "const", "default", "examples"})
# The largest bound written as a pattern: xgrammar expands ``.{a,b}`` into b states, and compiling
# it grows with b squared (9,000: 31 s of one core; 256: about 0.02 s). Larger bounds stay xgrammar's.
_MOST_PATTERN_BOUND = 256


def bounded_strings_as_patterns(schema: Any) -> Any:
    """``schema`` with each ``{"type": "string", "minLength": a, "maxLength": b}`` (no pattern or
    format of its own) written as ``{"type": "string", "pattern": "^.{a,b}$"}``, which accepts the
    same strings.

    Why: xgrammar 0.2.9 turns a length-bounded string into a repetition of one character class that
    admits raw control characters (a tab, say), which JSON forbids inside strings, so strict parsers
    (Python's ``json.loads``, JavaScript's ``JSON.parse``) refuse the output. Its pattern path keeps
    to JSON's string rules. Neither writes escapes inside a bounded string. Bounds above
    ``_MOST_PATTERN_BOUND`` are left as they are: as a pattern, their compile time would let one
    request hold the executor's compile thread (and the scheduler's check) for minutes.
    """
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: value if key in _DATA_KEYS else bounded_strings_as_patterns(value) for key, value in schema.items()}
    low, high = out.get("minLength"), out.get("maxLength")
    low = low if isinstance(low, int) and not isinstance(low, bool) else None
    high = high if isinstance(high, int) and not isinstance(high, bool) else None
    bounded = (low is not None or high is not None) and max(low or 0, high or 0) <= _MOST_PATTERN_BOUND
    if out.get("type") == "string" and bounded and "pattern" not in out and "format" not in out:
        low = low or 0
        high = "" if high is None else high
        out.pop("minLength", None)
        out.pop("maxLength", None)
        out["pattern"] = f"^.{{{low},{high}}}$"
    return out


# Keywords xgrammar accepts and then does not enforce (0.2.9): an output could break them while
# the request believed it constrained. Refused, as vLLM refuses them for xgrammar, rather than
# served wrongly. (An unknown ``format`` is ignored, as JSON Schema says a validator may.)
_UNENFORCED = ("not", "if", "dependentRequired", "dependentSchemas", "contains")
_LOOKAROUND = re.compile(r"\(\?<?[=!]")


def unenforced_keyword(schema: Any) -> str | None:
    """The first keyword of ``schema`` that xgrammar would not enforce, described; None if none."""
    if isinstance(schema, list):
        return next((found for item in schema if (found := unenforced_keyword(item)) is not None), None)
    if not isinstance(schema, dict):
        return None
    for key in _UNENFORCED:
        if key in schema:
            return f"{key!r}"
    if schema.get("uniqueItems") is True:
        return "'uniqueItems'"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return "'allOf' with more than one schema"
    if ("pattern" in schema or "format" in schema) and ("minLength" in schema or "maxLength" in schema):
        return "'minLength' or 'maxLength' beside a 'pattern' or 'format'"
    if isinstance(schema.get("pattern"), str) and _LOOKAROUND.search(schema["pattern"]):
        return "a lookahead or lookbehind in a 'pattern'"
    return next(
        (found for key, value in schema.items() if key not in _DATA_KEYS and (found := unenforced_keyword(value))),
        None,
    )


def _schema(spec: StructuredOutput) -> str:
    try:
        schema = json.loads(spec.spec)
    except ValueError:
        return spec.spec  # xgrammar says what is wrong with it
    if (keyword := unenforced_keyword(schema)) is not None:
        raise ValueError(f"the schema uses {keyword}, which the grammar could not enforce")
    return json.dumps(bounded_strings_as_patterns(schema))


_PARSE: dict[StructuredKind, Callable[[StructuredOutput], xgr.Grammar]] = {
    StructuredKind.JSON_SCHEMA: lambda s: xgr.Grammar.from_json_schema(_schema(s), any_whitespace=False),
    StructuredKind.JSON_OBJECT: lambda s: xgr.Grammar.from_json_schema(
        _JSON_OBJECT_SCHEMA, any_whitespace=False, strict_mode=False
    ),
    StructuredKind.REGEX: lambda s: xgr.Grammar.from_regex(s.spec),
    StructuredKind.GRAMMAR: lambda s: xgr.Grammar.from_ebnf(s.spec),
    StructuredKind.CHOICE: lambda s: xgr.Grammar.from_ebnf(choice_ebnf(s.choices)),
}


def _invalid(spec: StructuredOutput, exc: Exception) -> InvalidRequest:
    message = _LOCATION.sub("", str(exc).strip()).strip()
    return InvalidRequest(f"structured_output {spec.kind}: {message}")


def parse(spec: StructuredOutput) -> xgr.Grammar:
    """The grammar of ``spec``, without a tokenizer: every syntax error, at a small part of a
    compile's cost (the compile adds the per-token tables). InvalidRequest when it does not parse."""
    try:
        return _PARSE[spec.kind](spec)
    except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar raises RuntimeError from C++
        raise _invalid(spec, exc) from exc


def compile_grammar(compiler: xgr.GrammarCompiler, spec: StructuredOutput) -> xgr.CompiledGrammar:
    """``spec`` compiled for ``compiler``'s tokenizer; InvalidRequest when it does not compile.

    The grammar is the one ``parse`` gives, so the scheduler's check refuses exactly what the
    executor could not compile."""
    grammar = parse(spec)
    try:
        return compiler.compile_grammar(grammar)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise _invalid(spec, exc) from exc
