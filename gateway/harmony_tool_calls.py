"""gpt-oss's calls (the tool-call parser ``openai``, as vLLM names it), as ``harmony.HarmonySplit``
leaves them in the answer: each ``<|start|>functions.NAME<|message|>ARGS<|call|>``, the arguments
JSON (passed on as written where they are not); the text before the first is the answer's content
(a preamble). It reads the answer
of the ``openai_gptoss`` reasoning parser, which the gateway requires beside it.
"""

from __future__ import annotations

from gateway.harmony import CALL, MESSAGE, START
from gateway.hermes_tool_calls import ParsedCall, json_object
from gateway.sectioned_tool_calls import SectionedStream, SectionTags
from gateway.sectioned_tool_calls import parse as parse_sectioned

TAGS = SectionTags(sections=(START,), call=START, end=CALL)
_FUNCTIONS = "functions."


def parse(text: str) -> tuple[str | None, list[ParsedCall]]:
    """The content before the calls (None if empty) and the calls; ``(text, [])`` where it makes none."""
    return parse_sectioned(text, TAGS, read_call)


class HarmonyCallStream(SectionedStream):
    """One streamed answer, read piece by piece."""

    def __init__(self) -> None:
        super().__init__(TAGS, read_call)


def read_call(body: str) -> ParsedCall | None:
    """One call (None: not one). Arguments that are not a JSON object are passed on as written, as
    vLLM's ``openai`` parser passes them: the call stands, and its caller sees what the model wrote."""
    recipient, separator, arguments = body.partition(MESSAGE)
    name = recipient.removeprefix(_FUNCTIONS)
    if not separator or not recipient.startswith(_FUNCTIONS) or not name:
        return None
    return ParsedCall(name, json_object(arguments) or arguments.strip())
