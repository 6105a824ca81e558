"""DeepSeek's tool-call syntax, as DeepSeek-V3, R1 (0528) and V3.1 write their calls: a section of
calls between special tokens, each call its function's name and JSON arguments,

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>weather
    ```json
    {"city": "Oslo"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

(V3 and R1), or from V3.1 on ``<｜tool▁call▁begin｜>weather<｜tool▁sep｜>{"city": "Oslo"}<｜tool▁call▁end｜>``.
Both forms are read, whichever the model writes: vLLM's ``deepseek_v3`` and ``deepseek_v31``
parsers read one each. The arguments must be a JSON object; a body that is not such a call is
dropped (``sectioned_tool_calls``).
"""

from __future__ import annotations

import re

from gateway.hermes_tool_calls import ParsedCall, json_object
from gateway.sectioned_tool_calls import SectionedStream, SectionTags
from gateway.sectioned_tool_calls import parse as parse_sectioned

# DeepSeek's special tokens are written with fullwidth bars (U+FF5C) and the block "▁" (U+2581).
TAGS = SectionTags(
    sections=("<\uff5ctool\u2581calls\u2581begin\uff5c>",),
    call="<\uff5ctool\u2581call\u2581begin\uff5c>",
    end="<\uff5ctool\u2581call\u2581end\uff5c>",
)
SEPARATOR = "<\uff5ctool\u2581sep\uff5c>"
_FENCED = re.compile(r"([^\n]+)\n```(?:json)?\n(.*)\n```\s*", re.DOTALL)  # V3's "name\n```json\n{...}\n```"


def parse(text: str) -> tuple[str | None, list[ParsedCall]]:
    """The content before the calls (None if empty) and the calls; ``(text, [])`` where it makes none."""
    return parse_sectioned(text, TAGS, read_call)


class DeepSeekStream(SectionedStream):
    """One streamed output, read piece by piece."""

    def __init__(self) -> None:
        super().__init__(TAGS, read_call)


def read_call(body: str) -> ParsedCall | None:
    """One call's body in either form (None: it is not a call, or is cut short)."""
    kind, separator, rest = body.partition(SEPARATOR)
    if not separator:
        return None
    fenced = _FENCED.fullmatch(rest) if kind.strip() == "function" else None
    name, arguments = (fenced.group(1), fenced.group(2)) if fenced else (kind, rest)
    name, arguments = name.strip(), json_object(arguments)
    return ParsedCall(name, arguments) if name and arguments is not None else None
