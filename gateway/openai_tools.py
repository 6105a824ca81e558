"""OpenAI's tool calling on the chat route: the tools go to the model's chat template (Baton's
``Chat.tools``), a forced call is Baton's structured output, and the output comes back in
OpenAI's ``tool_calls`` shape.

``tool_choice``:

- ``"none"``: the template still lists the tools (as vLLM's default), and the answer is text.
- ``{"type": "function", "function": {"name": N}}``: the output is forced to N's ``parameters``
  (a JSON schema); the answer is one call of N, with ``finish_reason`` ``"stop"`` as OpenAI
  answers a forced function.
- ``"required"``: the output is forced to a JSON array of one or more ``{"name", "parameters"}``
  objects, each one of the tools (at most one with ``parallel_tool_calls`` false, as vLLM builds
  the schema); each becomes a call, and ``finish_reason`` is ``"tool_calls"``.
- ``"auto"``, the default once tools are given: whether to call is the model's, written in a
  syntax of its own that the gateway must parse: ``baton gateway --tool-call-parser`` ``hermes``
  (``hermes_tool_calls``), ``llama3_json`` (``llama3_tool_calls``), ``mistral``
  (``mistral_tool_calls``), ``pythonic`` (``pythonic_tool_calls``), ``qwen3_coder``
  (``qwen3_coder_tool_calls``), ``glm45``/``glm47`` (``glm_tool_calls``),
  ``deepseek_v3``/``deepseek_v31`` (``deepseek_tool_calls``), ``kimi_k2`` (``kimi_k2_tool_calls``),
  ``granite`` (``granite_tool_calls``) or ``openai`` (gpt-oss's harmony calls,
  ``harmony_tool_calls``; a named or "required" choice is read as "auto" there), as vLLM's
  ``--enable-auto-tool-choice --tool-call-parser``. The
  answer's content is the text before the first call, and ``finish_reason`` is ``"tool_calls"``
  where it calls. Without a parser, ``"auto"`` is a 400, as vLLM answers without its flags. The
  parser needs the calls' tags in the text, so special tokens' text is kept unless the request
  says otherwise (as vLLM's parsers ask).

Streamed, a named call's arguments go out as they are generated (the first delta carries the
call's id and name); the calls of ``"required"`` go out together once the array is complete, and
those of ``"auto"`` each once it closes, since a call's arguments are only known to be whole then.
An array of calls cut short by ``max_tokens`` is no call: it comes back as text, with
``finish_reason`` ``"length"``; a named call cut short is still that call, its ``finish_reason``
``"length"``.

Messages carry earlier calls (an assistant message's ``tool_calls``) and their results (a tool
message's ``tool_call_id``) to the template; ``chat_messages`` reads them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from common.pb import generate_pb2 as pb
from gateway import (
    deepseek_tool_calls,
    glm_tool_calls,
    granite_tool_calls,
    harmony_tool_calls,
    hermes_tool_calls,
    kimi_k2_tool_calls,
    llama3_tool_calls,
    mistral_tool_calls,
    pythonic_tool_calls,
    qwen3_coder_tool_calls,
)
from gateway.errors import BadRequest
from gateway.hermes_tool_calls import ParsedCall

NAMED = "named"
REQUIRED = "required"
AUTO = "auto"
NONE = "none"


class CallStream(Protocol):
    """Reads one streamed output in a model's tool-call syntax."""

    calls: int  # calls sent so far

    def feed(self, text: str, final: bool) -> tuple[str, list[ParsedCall]]: ...


def openai_call_id(_name: str = "", _index: int = 0) -> str:
    """A call id in OpenAI's form."""
    return f"call_{uuid.uuid4().hex[:24]}"


Schemas = Mapping[str, Mapping[str, Any]]  # each tool's parameters' JSON schema, by name


@dataclass(frozen=True)
class ToolSyntax:
    """A model family's tool-call syntax: how to read a whole output and a streamed one (given the
    tools' schemas, which a syntax of untyped values reads its values by), and the ids its calls
    get where the model writes none (some templates accept only their own kind), from the called
    function's name and the call's index in the conversation."""

    parse: Callable[[str, Schemas], tuple[str | None, list[ParsedCall]]]
    stream: Callable[[Schemas], CallStream]
    call_id: Callable[[str, int], str] = openai_call_id


def _untyped(
    parse: Callable[[str], tuple[str | None, list[ParsedCall]]],
    stream: Callable[[], CallStream],
    call_id: Callable[[str, int], str] = openai_call_id,
) -> ToolSyntax:
    """A syntax whose arguments are JSON already: it reads no schemas."""
    return ToolSyntax(lambda text, _schemas: parse(text), lambda _schemas: stream(), call_id)


# The tool-call syntaxes the gateway can read, for "auto" (``--tool-call-parser``).
_SYNTAXES = {
    "hermes": _untyped(hermes_tool_calls.parse, hermes_tool_calls.HermesStream),
    "llama3_json": _untyped(llama3_tool_calls.parse, llama3_tool_calls.Llama3Stream),
    "mistral": _untyped(
        mistral_tool_calls.parse, mistral_tool_calls.MistralStream, lambda _name, _index: mistral_tool_calls.call_id()
    ),
    "pythonic": _untyped(pythonic_tool_calls.parse, pythonic_tool_calls.PythonicStream),
    "qwen3_coder": ToolSyntax(qwen3_coder_tool_calls.parse, qwen3_coder_tool_calls.Qwen3CoderStream),
    # vLLM names a parser for each form of DeepSeek's calls; one reads both.
    "deepseek_v3": _untyped(deepseek_tool_calls.parse, deepseek_tool_calls.DeepSeekStream),
    "deepseek_v31": _untyped(deepseek_tool_calls.parse, deepseek_tool_calls.DeepSeekStream),
    "glm45": ToolSyntax(glm_tool_calls.parse, glm_tool_calls.GlmStream),
    "glm47": ToolSyntax(glm_tool_calls.parse, glm_tool_calls.GlmStream),
    "kimi_k2": _untyped(kimi_k2_tool_calls.parse, kimi_k2_tool_calls.KimiK2Stream, kimi_k2_tool_calls.call_id),
    "granite": _untyped(granite_tool_calls.parse, granite_tool_calls.GraniteStream),
    # gpt-oss: reads the calls the openai_gptoss reasoning parser leaves in the answer (the gateway
    # refuses the one without the other).
    "openai": _untyped(harmony_tool_calls.parse, harmony_tool_calls.HarmonyCallStream),
}
TOOL_CALL_PARSERS = tuple(_SYNTAXES)
# Syntaxes whose calls no grammar here can force: gpt-oss writes its calls as harmony messages,
# whose answer a structured output cannot hold (``reasoning``), so a named or "required" choice is
# read as "auto" is, from the calls the model writes.
_UNFORCED = frozenset({"openai"})


@dataclass(frozen=True)
class ToolCalling:
    """What one chat request asked of tools: the mode, and for a named call the function's name."""

    mode: str  # NAMED, REQUIRED, AUTO or NONE
    name: str = ""
    parser: str = ""  # the syntax the model writes its calls in (``TOOL_CALL_PARSERS``); "auto" reads it
    # parallel_tool_calls: false keeps "auto" to the first call the model writes ("required"'s
    # schema allows only one), as vLLM does.
    parallel: bool = True
    # "auto": the tools' parameter schemas, for a syntax that types its values by them.
    schemas: Schemas = field(default_factory=dict, compare=False)
    earlier_calls: int = 0  # the calls the conversation's messages already hold (Kimi's ids count them)

    def call_id(self, name: str, position: int = 0) -> str:
        """A new id for the answer's ``position``-th call, of ``name``, of the kind the model's
        template takes back."""
        make = _SYNTAXES[self.parser].call_id if self.parser else openai_call_id
        return make(name, self.earlier_calls + position)

    @property
    def shapes_answer(self) -> bool:
        """Whether the answer may be calls rather than text."""
        return self.mode != NONE

    def whole_message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message and finish reason of a whole answer whose output is ``text``."""
        if self.mode == AUTO:
            content, parsed = _SYNTAXES[self.parser].parse(text, self.schemas)
            parsed = parsed if self.parallel else parsed[:1]
            if not parsed:
                return {"role": "assistant", "content": text}, finish_reason
            made = [self.call(found.name, found.arguments, found.call_id, i) for i, found in enumerate(parsed)]
            return {"role": "assistant", "content": content, "tool_calls": made}, "tool_calls"
        calls = self.forced_calls(text, finish_reason)
        if calls is None:
            return {"role": "assistant", "content": text}, finish_reason
        message = {"role": "assistant", "content": None, "tool_calls": calls}
        return message, "tool_calls" if self.mode == REQUIRED else finish_reason

    def forced_calls(self, text: str, finish_reason: str | None) -> list[dict[str, Any]] | None:
        """The forced calls ``text`` makes; None where it makes none (not forced, or an array of calls cut
        short). A named call is one whatever its end: a cut one says so by its finish reason."""
        if self.mode == NAMED:
            return [self.call(self.name, text)]
        if self.mode == NONE or finish_reason != "stop":
            return None
        try:
            items = json.loads(text)
        except ValueError:  # the grammar held it to the schema, so only a cut could break it
            return None
        return [
            self.call(item["name"], json.dumps(item["parameters"], ensure_ascii=False), position=i)
            for i, item in enumerate(items)
        ]

    def call(self, name: str, arguments: str, call_id: str = "", position: int = 0) -> dict[str, Any]:
        """The answer's ``position``-th call in OpenAI's ``tool_calls`` shape, with the id the model
        wrote for it or a new one."""
        made = call_id or self.call_id(name, position)
        return {"id": made, "type": "function", "function": {"name": name, "arguments": arguments}}


class ToolCallStream:
    """One streamed choice's deltas where the answer may be calls (``ToolCalling.shapes_answer``),
    message by message."""

    def __init__(self, calling: ToolCalling) -> None:
        self.calling = calling
        self._text = ""
        self._id = ""
        self._written = _SYNTAXES[calling.parser].stream(calling.schemas) if calling.mode == AUTO else None

    def feed(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any] | None, str | None, str]:
        """``(tool_calls delta or None, finish reason to send, text to send as content)`` for one
        message of output ``text`` ending with ``finish_reason``."""
        if self._written is not None:
            sent = self._written.calls
            content, parsed = self._written.feed(text, final=finish_reason is not None)
            if not self.calling.parallel:
                parsed = parsed[: max(0, 1 - sent)]
            deltas = [
                {"index": sent + i, **self.calling.call(c.name, c.arguments, c.call_id, sent + i)}
                for i, c in enumerate(parsed)
            ]
            finish = "tool_calls" if finish_reason is not None and self._written.calls else finish_reason
            return ({"tool_calls": deltas} if deltas else None), finish, content
        self._text += text
        if self.calling.mode == NAMED:
            if not text and (self._id or finish_reason):
                return None, finish_reason, ""
            function: dict[str, Any] = {"arguments": text}
            delta: dict[str, Any] = {"index": 0, "function": function}
            if not self._id:  # the call's first delta names it
                self._id = self.calling.call_id(self.calling.name)
                delta.update(id=self._id, type="function")
                function["name"] = self.calling.name
            return {"tool_calls": [delta]}, finish_reason, ""
        if self.calling.mode == REQUIRED and finish_reason is None:
            return None, None, ""  # held until the array is whole
        calls = self.calling.forced_calls(self._text, finish_reason)
        if calls is None:  # cut short: what was held goes out as text
            return None, finish_reason, self._text
        deltas = [{"index": i, **call} for i, call in enumerate(calls)]
        return {"tool_calls": deltas}, "tool_calls", ""


def parse_tools(
    body: Mapping[str, Any], parser: str = ""
) -> tuple[ToolCalling | None, str, pb.StructuredOutput | None]:
    """The request's tool calling, its tools as ``Chat.tools`` JSON, and the structured output that
    forces a call (None: nothing forced). No tools: ``(None, "", None)``. ``parser``: the syntax
    "auto" is read in (empty: "auto" is refused)."""
    tools_json = template_tools(body)
    choice = body.get("tool_choice")
    if not tools_json:
        if choice not in (None, "none"):
            raise BadRequest("tool_choice needs tools", param="tool_choice")
        return None, "", None
    functions = _functions(body["tools"])
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise BadRequest("parallel_tool_calls must be true or false", param="parallel_tool_calls")
    messages = body.get("messages")
    earlier = sum(
        len(m["tool_calls"]) for m in messages or () if isinstance(m, dict) and isinstance(m.get("tool_calls"), list)
    )
    if choice == "none":
        return ToolCalling(NONE, parser=parser, parallel=parallel, earlier_calls=earlier), tools_json, None
    if (choice is None or choice == "auto") and parser:
        calling = ToolCalling(AUTO, parser=parser, parallel=parallel, schemas=functions, earlier_calls=earlier)
        return calling, tools_json, None
    if choice is None or choice == "auto":
        raise BadRequest(
            'tool_choice "auto" (the default with tools) needs a parser of the model\'s own tool-call syntax, '
            'which this gateway was started without (--tool-call-parser): send tool_choice "required", "none", '
            "or a named function",
            param="tool_choice",
        )
    name = "" if choice == "required" else _named(choice)
    if choice != "required" and name not in functions:
        raise BadRequest(f"tool_choice names {name!r}, which is not one of the tools", param="tool_choice")
    if parser in _UNFORCED:  # named or "required": read as the model writes its calls
        calling = ToolCalling(AUTO, parser=parser, parallel=parallel, schemas=functions, earlier_calls=earlier)
        return calling, tools_json, None
    if choice == "required":
        calling = ToolCalling(REQUIRED, parser=parser, parallel=parallel, earlier_calls=earlier)
        return calling, tools_json, _schema(_required_schema(functions, parallel))
    return ToolCalling(NAMED, name, parser, parallel, earlier_calls=earlier), tools_json, _schema(functions[name])


def template_tools(body: Mapping[str, Any]) -> str:
    """The body's tools as ``Chat.tools`` JSON (empty: none), checked, for a prompt alone (``/tokenize``);
    a tool that names no type is a function's, as in vLLM."""
    tools = body.get("tools")
    if tools is None or tools == []:
        return ""
    _functions(tools)
    return json.dumps([{"type": "function", **tool} for tool in tools], ensure_ascii=False)


def _functions(tools: Any) -> dict[str, dict[str, Any]]:
    """Each function's name to its parameters' JSON schema (an empty object's where it has none)."""
    if not isinstance(tools, list):
        raise BadRequest("tools must be a list", param="tools")
    out: dict[str, dict[str, Any]] = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise BadRequest('each tool must be {"type": "function", "function": {...}}', param="tools")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise BadRequest("each tool's function needs a name", param="tools")
        if name in out:
            raise BadRequest(f"two tools are named {name!r}", param="tools")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise BadRequest(f"the parameters of {name!r} must be a JSON schema (an object)", param="tools")
        out[name] = parameters
    return out


def _named(choice: Any) -> str:
    function = choice.get("function") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type", "function") == "function" and isinstance(function, dict)):
        raise BadRequest(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    name = function.get("name")
    if not isinstance(name, str):
        raise BadRequest("tool_choice's function needs a name", param="tool_choice")
    return name


def _required_schema(functions: Mapping[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """An array of calls, each a ``{"name", "parameters"}`` object of one of the functions. Each
    function's definitions (``$defs``, ``definitions``) move to the root, as vLLM moves them: its
    ``#/$defs/...`` references name the root of the whole schema, where its parameters now nest."""
    hoisted: dict[str, dict[str, Any]] = {}
    calls = []
    for name, parameters in functions.items():
        parameters = dict(parameters)
        for keyword in ("$defs", "definitions"):
            definitions = parameters.get(keyword)
            if not isinstance(definitions, dict):
                continue
            del parameters[keyword]
            for key, definition in definitions.items():
                if hoisted.setdefault(keyword, {}).setdefault(key, definition) != definition:
                    raise BadRequest(f"tools define {keyword} {key!r} differently", param="tools")
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, **hoisted}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _schema(schema: dict[str, Any]) -> pb.StructuredOutput:
    return pb.StructuredOutput(json_schema=json.dumps(schema, ensure_ascii=False))


def chat_messages(messages: Any, chat: pb.Chat, content: Any) -> None:
    """Each message of ``messages`` into ``chat``, its tool calls and the call it answers included;
    ``content`` reads a message's text."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", param="messages")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest("each message must be an object with a role", param="messages")
        added = chat.messages.add(role=message["role"], content=content(message))
        for name in ("tool_call_id", "name"):
            value = message.get(name)
            if value is not None:
                if not isinstance(value, str):
                    raise BadRequest(f"a message's {name} must be a string", param="messages")
                setattr(added, name, value)
        calls = message.get("tool_calls")
        if calls is None:
            continue
        if not isinstance(calls, list):
            raise BadRequest("a message's tool_calls must be a list", param="messages")
        for call in calls:
            added.tool_calls.append(_tool_call(call))


def _tool_call(call: Any) -> pb.ToolCall:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise BadRequest(
            'each tool call must be {"id", "type": "function", "function": {"name", "arguments"}}', param="messages"
        )
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):  # some clients send the object itself
        arguments = json.dumps(arguments, ensure_ascii=False)
    call_id = call.get("id", "")
    if not isinstance(call_id, str):
        raise BadRequest("a tool call's id must be a string", param="messages")
    return pb.ToolCall(id=call_id, name=function["name"], arguments=arguments)
