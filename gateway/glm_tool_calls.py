"""GLM-4.5's tool-call syntax (GLM-4.5, 4.6 and 4.7): Hermes's tags around the function's name and
each argument as a key and a value between tags of their own,

    <tool_call>weather
    <arg_key>city</arg_key>
    <arg_value>Oslo</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

(GLM-4.7 may write the first ``<arg_key>`` right after the name). The text before the first call is
the message's content. A value is read as vLLM's ``glm45`` parser reads it: a parameter the tool's
JSON schema types as a string keeps its text as written; any other value is read as JSON, then as a
Python literal (``ast.literal_eval``: never run), and stays the text where neither reads (or has no
JSON form: NaN, the infinities, sets, bytes). As in vLLM, a body that is not a call, or has no
``</tool_call>`` (cut short by the end of the output, or a tag the text only mentions), is dropped
and the other calls stand.

``parse`` reads a whole output, ``GlmStream`` one as it streams (``sectioned_tool_calls``: each
call once it closes).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping
from typing import Any

from gateway.hermes_tool_calls import ParsedCall
from gateway.sectioned_tool_calls import SectionedStream, SectionTags
from gateway.sectioned_tool_calls import parse as parse_sectioned

Schemas = Mapping[str, Mapping[str, Any]]  # each function's parameters' JSON schema
TAGS = SectionTags(sections=("<tool_call>",), call="<tool_call>", end="</tool_call>")
_NAME = re.compile(r"\s*([^\s<>{}]+)\s*")
# A key or a value ends at its first closing tag, so a body reads one way only.
_ARGUMENT = re.compile(
    r"<arg_key>((?:(?!</arg_key>).)*)</arg_key>\s*<arg_value>((?:(?!</arg_value>).)*)</arg_value>\s*", re.DOTALL
)


def parse(text: str, schemas: Schemas) -> tuple[str | None, list[ParsedCall]]:
    """The content before the first call (None if empty) and the calls; ``(text, [])`` where the
    output makes none."""
    return parse_sectioned(text, TAGS, lambda body: read_call(body, schemas))


class GlmStream(SectionedStream):
    """One streamed output, read piece by piece."""

    def __init__(self, schemas: Schemas) -> None:
        super().__init__(TAGS, lambda body: read_call(body, schemas))


def read_call(body: str, schemas: Schemas) -> ParsedCall | None:
    """One call's body, its values read by the function's schema (None: a body that is not a call,
    or is cut short before its last ``</arg_value>``)."""
    named = _NAME.match(body)
    if named is None:
        return None
    name, at = named.group(1), named.end()
    properties = schemas.get(name, {}).get("properties", {})
    arguments = {}
    while at < len(body):
        pair = _ARGUMENT.match(body, at)
        if pair is None:  # something else after the name, or a pair cut short
            return None
        key, value = pair.group(1).strip(), pair.group(2)
        schema = properties.get(key, {}) if isinstance(properties, Mapping) else {}
        is_string = isinstance(schema, Mapping) and schema.get("type") == "string"
        arguments[key] = value if is_string else _value(value.strip())
        at = pair.end()
    return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))


def _value(text: str) -> Any:
    """``text`` as JSON, else as a Python literal, where it reads as one with a JSON form; else the
    text itself."""
    for read in (json.loads, ast.literal_eval):
        try:
            value = read(text)
            json.dumps(value, allow_nan=False)  # NaN, an infinity, a set, bytes or a complex: no JSON form
            return value
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
    return text
