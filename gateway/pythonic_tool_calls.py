"""The pythonic tool-call syntax, as Llama 3.2's and Llama 4's pythonic templates (and ToolACE
and other models trained on them) write calls: the whole output is a Python list of calls with
keyword arguments, ``[weather(city="Oslo"), clock()]``, optionally between Llama 4's
``<|python_start|>`` and ``<|python_end|>``. vLLM's ``pythonic`` and ``llama4_pythonic`` parsers
read the same syntax.

The output is parsed with Python's own parser (``ast``) and each argument read as a literal
(``ast.literal_eval``): nothing in it is ever run. An output that is not such a list (positional
arguments, a value that is not a literal, a call of an attribute) is text. The arguments go out as
JSON: ``True``, ``None`` and tuples become ``true``, ``null`` and arrays.

``parse`` reads a whole output, ``PythonicStream`` one as it streams (``whole_output_calls``).
"""

from __future__ import annotations

import ast
import json

from gateway.hermes_tool_calls import ParsedCall
from gateway.whole_output_calls import WholeOutputStream

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"


def parse(text: str) -> tuple[str | None, list[ParsedCall]]:
    """``(None, calls)`` where the whole output is a list of calls; ``(text, [])`` otherwise."""
    body = text.strip()
    if body.startswith(PYTHON_START):
        body = body[len(PYTHON_START) :].removesuffix(PYTHON_END).strip()
    if not body.startswith("["):
        return text, []
    try:
        tree = ast.parse(body, mode="eval")
    except (SyntaxError, ValueError, RecursionError):  # not Python, a NUL byte, nested too deep
        return text, []
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return text, []
    calls = []
    for node in tree.body.elts:
        call = _call(node)
        if call is None:
            return text, []
        calls.append(call)
    return None, calls


def _call(node: ast.expr) -> ParsedCall | None:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **mapping
            return None
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    try:
        return ParsedCall(node.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False))
    except (TypeError, ValueError):  # a literal JSON has no form for: a set, bytes, a complex, inf
        return None


class PythonicStream(WholeOutputStream):
    """One streamed output, read piece by piece."""

    def __init__(self) -> None:
        super().__init__(parse, ("[", PYTHON_START))
