"""The Qwen3-Coder tool-call syntax, as Qwen3-Coder (and Qwen3.5's agentic templates) write their
calls: Hermes's tags around an XML-like body, each argument's value as plain text,

    <tool_call>
    <function=weather>
    <parameter=city>
    Oslo
    </parameter>
    </function>
    </tool_call>

The text before the first call is the message's content. A value is typed by the tool's JSON
schema, as vLLM's ``qwen3_coder`` parser types it: an integer, number or boolean parameter's text
is read as one, an object or array parameter's as JSON, anything else (a string, or a parameter
the schema does not name) stays the text. A value that does not read as its type stays the text.

``parse`` reads a whole output, ``Qwen3CoderStream`` one as it streams (``hermes_tool_calls``'s
reading: each call once it closes).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from gateway.hermes_tool_calls import HermesStream, ParsedCall
from gateway.hermes_tool_calls import parse as parse_tagged

Schemas = Mapping[str, Mapping[str, Any]]  # each function's parameters' JSON schema
_FUNCTION = re.compile(r"\s*<function=([^>\s]+)>(.*)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)
_BOOLEANS = {"true": True, "false": False}


def parse(text: str, schemas: Schemas) -> tuple[str | None, list[ParsedCall]]:
    """The content before the first call (None if empty) and the calls; ``(text, [])`` where the
    output makes no call, or a body between the tags is not one."""
    return parse_tagged(text, lambda body: read_call(body, schemas))


class Qwen3CoderStream(HermesStream):
    """One streamed output, read piece by piece."""

    def __init__(self, schemas: Schemas) -> None:
        super().__init__(lambda body: read_call(body, schemas))


def read_call(body: str, schemas: Schemas) -> ParsedCall | None:
    """One ``<function=...>`` body as a call, its values typed by the function's schema (None: a
    body that is not one, or is cut short before ``</function>``)."""
    function = _FUNCTION.fullmatch(body)
    if function is None:
        return None
    name, inner = function.group(1), function.group(2)
    properties = schemas.get(name, {}).get("properties", {})
    arguments = {
        key: _typed(value, properties.get(key, {}) if isinstance(properties, Mapping) else {})
        for key, value in _PARAMETER.findall(inner)
    }
    return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))


def _typed(text: str, schema: Any) -> Any:
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    kinds = kind if isinstance(kind, list) else [kind]
    value = text.strip()
    if value == "null" and "null" in kinds:
        return None
    try:
        return _json_form(_read(value, kinds))
    except (ValueError, RecursionError, OverflowError):  # not its type, nested too deep, or no JSON form
        return text


def _read(value: str, kinds: list[Any]) -> Any:
    if "integer" in kinds and re.fullmatch(r"-?\d+", value):
        return int(value)
    if "number" in kinds:
        number = float(value)
        return int(number) if number.is_integer() and "." not in value and "e" not in value.lower() else number
    if "boolean" in kinds and value.lower() in _BOOLEANS:
        return _BOOLEANS[value.lower()]
    if "object" in kinds or "array" in kinds:
        return json.loads(value)
    raise ValueError("a string")


def _json_form(value: Any) -> Any:
    json.dumps(value, allow_nan=False)  # NaN and the infinities have none: ValueError
    return value
