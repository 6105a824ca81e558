"""Structured output, as OpenAI and vLLM clients ask for it, in Baton's ``StructuredOutput`` message.

- OpenAI's ``response_format``: ``{"type": "json_object"}`` (any JSON object), and ``{"type":
  "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`` (a value valid
  under the schema; ``strict`` changes nothing, as the output is always held to the schema; without
  a ``schema``, which OpenAI's API makes optional, any JSON object);
  ``{"type": "text"}`` asks for nothing.
- vLLM's ``structured_outputs`` extension (send it with the client's ``extra_body``): one of
  ``json`` (a schema, as an object or as JSON text), ``regex``, ``choice`` (a list of strings),
  ``grammar`` (EBNF or Lark) or ``json_object`` (true). Its options that ask for what Baton does
  anyway are accepted (``disable_any_whitespace``: Baton writes no optional whitespace;
  ``disable_additional_properties``: objects hold only the properties a schema allows;
  ``disable_fallback``: there is one backend); the others (a whitespace pattern, a backend,
  structural tags) are refused rather than ignored.
- vLLM's older top-level names: ``guided_json``, ``guided_regex``, ``guided_choice`` and
  ``guided_grammar``.

A request may ask in one of these ways only. Whether a schema, expression or grammar is valid is
Baton's to say (400 from the scheduler), as it compiles them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from common.pb import generate_pb2 as pb
from gateway.errors import BadRequest

# vLLM's older request fields -> the ``structured_outputs`` key each stands for.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's options that ask for what Baton does whatever they say (see the module's docstring).
_MOOT = ("disable_any_whitespace", "disable_additional_properties", "disable_fallback")


def _schema_text(schema: Any, param: str) -> str:
    """A JSON schema given as an object (or a boolean), or as JSON text, as compact JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise BadRequest(f"{param} is not valid JSON: {exc}", param=param) from exc
    if not isinstance(schema, dict | bool):
        raise BadRequest(f"{param} must be a JSON schema (an object)", param=param)
    return json.dumps(schema, separators=(",", ":"))


def _from_response_format(value: Any) -> pb.StructuredOutput | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise BadRequest("response_format must be an object with a type", param="response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return pb.StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise BadRequest("response_format json_schema needs a json_schema object", param="response_format")
        if spec.get("schema") is None:  # optional in OpenAI's API: any JSON object, as json_object asks
            return pb.StructuredOutput(json_object=True)
        return pb.StructuredOutput(json_schema=_schema_text(spec["schema"], "response_format.json_schema.schema"))
    raise BadRequest(f"response_format type {kind!r} is not supported by this server", param="response_format")


def _from_vllm(options: Mapping[str, Any], param: str) -> pb.StructuredOutput:
    """vLLM's ``structured_outputs`` object: exactly one kind."""
    unknown = sorted(k for k, v in options.items() if k not in _KINDS and v not in (None, False) and k not in _MOOT)
    moot = [k for k in _MOOT if not isinstance(options.get(k, False), bool | None)]
    if moot:
        raise BadRequest(f"{param}.{moot[0]} must be true or false", param=param)
    if unknown:
        raise BadRequest(f"{param} options {unknown} are not supported by this server", param=param)
    kinds = [k for k in _KINDS if options.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise BadRequest(f"{param} must set exactly one of {', '.join(_KINDS)}", param=param)
    kind = kinds[0]
    value = options[kind]
    where = param if param in _GUIDED else f"{param}.{kind}"  # what the client named
    if kind == "json":
        return pb.StructuredOutput(json_schema=_schema_text(value, where))
    if kind == "json_object":
        if value is not True:
            raise BadRequest(f"{where} must be true", param=where)
        return pb.StructuredOutput(json_object=True)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise BadRequest(f"{where} must be a non-empty list of strings", param=where)
        return pb.StructuredOutput(choice=pb.StructuredChoice(choices=value))
    if not isinstance(value, str):
        raise BadRequest(f"{where} must be a string", param=where)
    return pb.StructuredOutput(regex=value) if kind == "regex" else pb.StructuredOutput(grammar=value)


def structured_output(body: Mapping[str, Any]) -> pb.StructuredOutput | None:
    """The request's constraint, or None when it asks for none."""
    found: list[tuple[str, pb.StructuredOutput]] = []
    if body.get("response_format") is not None:
        asked = _from_response_format(body["response_format"])
        if asked is not None:
            found.append(("response_format", asked))
    options = body.get("structured_outputs")
    if options is not None:
        if not isinstance(options, dict):
            raise BadRequest("structured_outputs must be an object", param="structured_outputs")
        found.append(("structured_outputs", _from_vllm(options, "structured_outputs")))
    for name, kind in _GUIDED.items():
        if body.get(name) is not None:
            found.append((name, _from_vllm({kind: body[name]}, name)))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise BadRequest(f"ask for structured output one way only, not with {names}", param=found[1][0])
    return found[0][1] if found else None
