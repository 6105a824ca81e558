"""How a ``StructuredOutput`` becomes an xgrammar grammar: parsed (the scheduler's check) or compiled
against a tokenizer (the executor's, for its token masks).

One table per step says, for each kind, the grammar xgrammar builds, so the scheduler rejects
exactly what the executor could not compile:
- json_schema: the schema, written with ", " and ": " between items and no other whitespace
  (``any_whitespace=False``): one layout, the fewest tokens, and no model can stall in an endless
  run of spaces. xgrammar's strict mode: properties and items the schema does not name are not
  generated unless it allows them, and a name an object requires is named for it
  (``required_properties_named``), so the output still validates against the schema. Strings with
  a length bound keep to JSON's string characters (``_json_schema_grammar``).
- json_object: the schema ``{"type": "object"}`` in the same layout, with any properties.
- regex: as given. grammar: EBNF (xgrammar's GBNF-like syntax with a ``root`` rule) or Lark (a
  ``start`` rule), told apart as vLLM tells them: a grammar with a ``::=`` rule is EBNF.
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


def required_properties_named(schema: Any) -> Any:
    """``schema`` with every name an object ``required`` but its ``properties`` left out added to
    them, as the schema its other keywords give such a name (``patternProperties`` it matches, else
    ``additionalProperties``, else any value).

    Why: xgrammar's strict mode generates only the properties an object names, so a required name
    it does not was never written and no output validated. ValueError where the schema forbids the
    name it requires (no output could validate)."""
    if isinstance(schema, list):
        return [required_properties_named(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: value if key in _DATA_KEYS else required_properties_named(value) for key, value in schema.items()}
    required, properties = out.get("required"), out.get("properties", {})
    if not isinstance(required, list) or not isinstance(properties, dict):
        return out
    missing = [name for name in required if isinstance(name, str) and name not in properties]
    if not missing:
        return out
    patterns = out.get("patternProperties")
    patterns = patterns if isinstance(patterns, dict) else {}
    extra = out.get("additionalProperties", True)
    added: dict[str, Any] = {}
    for name in missing:
        matched = [sub for pattern, sub in patterns.items() if _searches(pattern, name)]
        if matched:
            added[name] = matched[0]
        elif extra is False:
            raise ValueError(f"the schema requires {name!r} and allows no such property")
        else:
            added[name] = extra if isinstance(extra, dict) else {}
    return {**out, "properties": {**properties, **added}}


def _searches(pattern: str, name: str) -> bool:
    try:
        return re.search(pattern, name) is not None
    except re.error:
        return False  # xgrammar says what is wrong with it


# xgrammar 0.2.9 writes the characters of a string with a length bound (repeated, or one optional
# character for a bound of 1) with a class that admits raw control characters (a tab, say), which
# JSON forbids inside strings, so strict parsers (Python's ``json.loads``, JavaScript's
# ``JSON.parse``) refuse the output. The grammar's text (``str`` of a Grammar, read back by
# ``Grammar.from_ebnf``: both public) is written again with JSON's string characters in that
# class, which xgrammar writes for nothing else; the repetition stays xgrammar's own, which
# compiles in milliseconds at any bound (as a regular expression, 9,000 took 31 s). Neither writes
# escapes inside a bounded string. tests/common/test_structured_output.py pins the class's text.
_BOUNDED_STRING_CLASS = r"[^\"\\\r\n]"
_JSON_STRING_CLASS = r"[^\0-\x1f\"\\]"


def _json_schema_grammar(schema_text: str) -> xgr.Grammar:
    grammar = xgr.Grammar.from_json_schema(schema_text, any_whitespace=False)
    text = str(grammar)
    if _BOUNDED_STRING_CLASS not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_BOUNDED_STRING_CLASS, _JSON_STRING_CLASS), root_rule_name="root")


# Keywords xgrammar accepts and then does not enforce (0.2.9): an output could break them while
# the request believed it constrained. Refused, as vLLM refuses them for xgrammar, rather than
# served wrongly. (An unknown ``format`` is ignored, as JSON Schema says a validator may.)
_UNENFORCED = ("not", "if", "dependentRequired", "dependentSchemas", "contains")
_LOOKAROUND = re.compile(r"\(\?<?[=!]")
# Escapes that stand for a quote, a backslash or a control character (``\cX`` too, and
# ``\xHH`` or ``\uHHHH`` of one: ``_stands_for_raw``).
_RAW_ESCAPES = frozenset('"\\tnrfv0c')
_HEX_ESCAPE = re.compile(r"x([0-9A-Fa-f]{2})|u([0-9A-Fa-f]{4})")


def _stands_for_raw(pattern: str, at: int) -> tuple[bool, int]:
    """Whether the escape whose backslash is at ``at`` stands for a quote, a backslash or a control
    character, and where the escape ends."""
    if pattern[at + 1] in _RAW_ESCAPES:
        return True, at + 2
    if hex_escape := _HEX_ESCAPE.match(pattern, at + 1):
        code = int(hex_escape[1] or hex_escape[2], 16)
        return code < 0x20 or code in (0x22, 0x5C), hex_escape.end()
    return False, at + 2


def writes_raw_characters(pattern: str) -> bool:
    """Whether a string ``pattern`` can write a quote, a backslash or a control character, as a
    literal or from a class that lists one: xgrammar 0.2.9 puts such a character into the JSON
    string as it is (a quote ends the string early). A negated class, ``.`` and shorthands like
    ``\\s`` it holds to JSON's rules, so they may exclude or span such characters freely."""
    in_class = negated = False
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\" and i + 1 < len(pattern):
            raw, i = _stands_for_raw(pattern, i)
            if raw and not negated:
                return True
            continue
        if char == "[" and not in_class:
            in_class, negated = True, pattern.startswith("^", i + 1)
        elif char == "]" and in_class:
            in_class = negated = False
        elif not negated and (char == '"' or ord(char) < 0x20):
            return True
        i += 1
    return False


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
    if isinstance(schema.get("pattern"), str) and writes_raw_characters(schema["pattern"]):
        return "a 'pattern' that writes a quote, a backslash or a control character (outside a negated class)"
    return next(
        (found for key, value in schema.items() if key not in _DATA_KEYS and (found := unenforced_keyword(value))),
        None,
    )


# The deepest nesting of a schema's JSON served. xgrammar's parse of a schema costs about the cube of
# its inline nesting (0.15 s at 128 levels on a 2-vCPU machine, 17 s at 480), first in a scheduler's
# thread and then again in every executor's compile: a few such requests would hold both for
# minutes. Real schemas nest a few levels; ``$defs`` and ``$ref`` nest any deeper at no such cost.
MAX_SCHEMA_DEPTH = 128


def nesting_depth(value: Any) -> int:
    """How deep objects and arrays nest in a decoded JSON ``value`` (0 for a scalar)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def _schema(spec: StructuredOutput) -> str:
    try:
        schema = json.loads(spec.spec)
    except ValueError:
        return spec.spec  # xgrammar says what is wrong with it
    if (depth := nesting_depth(schema)) > MAX_SCHEMA_DEPTH:
        raise ValueError(
            f"the schema nests {depth} levels deep, more than {MAX_SCHEMA_DEPTH}: "
            "name deep parts in $defs and point to them with $ref"
        )
    if (keyword := unenforced_keyword(schema)) is not None:
        raise ValueError(f"the schema uses {keyword}, which the grammar could not enforce")
    return json.dumps(required_properties_named(schema))


def _grammar(text: str) -> xgr.Grammar:
    """EBNF or Lark, as vLLM tells them apart: a grammar with a ``::=`` on a line (comments aside)
    is EBNF."""
    if any("::=" in re.sub(r"(#|//).*$", "", line) for line in text.splitlines()):
        return xgr.Grammar.from_ebnf(text)
    return xgr.Grammar.from_lark(text)


_PARSE: dict[StructuredKind, Callable[[StructuredOutput], xgr.Grammar]] = {
    StructuredKind.JSON_SCHEMA: lambda s: _json_schema_grammar(_schema(s)),
    StructuredKind.JSON_OBJECT: lambda s: xgr.Grammar.from_json_schema(
        _JSON_OBJECT_SCHEMA, any_whitespace=False, strict_mode=False
    ),
    StructuredKind.REGEX: lambda s: xgr.Grammar.from_regex(s.spec),
    StructuredKind.GRAMMAR: lambda s: _grammar(s.spec),
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
