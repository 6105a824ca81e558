"""A request's structured-output constraint: what form its output must take.

One value type for both services, like ``SamplingParams`` that carries it: the scheduler builds it
from the public ``baton.v1.StructuredOutput`` (``from_pb``) and checks that it compiles
(``scheduler_service.grammar_check``); Redis keeps it inside the parameters' JSON (``to_dict``); the
executor gets the same message back in ``ExecSampling`` and compiles it
(``executor_service.grammar_cache``). Being frozen and hashable, the value itself is the key of
both sides' grammar caches. Turning it into an xgrammar grammar is ``common.structured_grammar``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from common.errors import InvalidRequest
from common.pb import generate_pb2 as pb


class StructuredKind(StrEnum):
    """The kinds of constraint; the values are the proto oneof's field names."""

    JSON_SCHEMA = "json_schema"  # spec: a JSON schema, as JSON text
    JSON_OBJECT = "json_object"  # any JSON object; no spec
    REGEX = "regex"  # spec: a regular expression the whole output matches
    GRAMMAR = "grammar"  # spec: an EBNF grammar with a ``root`` rule
    CHOICE = "choice"  # choices: the output is exactly one of them


# A reasoning model's end-of-thinking tag is a few characters; the executor tokenises it alone.
MAX_STARTS_AFTER_CHARS = 64
_WITH_SPEC = frozenset({StructuredKind.JSON_SCHEMA, StructuredKind.REGEX, StructuredKind.GRAMMAR})


@dataclass(frozen=True)
class StructuredOutput:
    """One constraint. Shape errors raise InvalidRequest; whether the spec itself is a valid schema,
    expression or grammar is the compiler's to say."""

    kind: StructuredKind
    # The schema, expression or grammar text; empty for json_object and choice.
    spec: str = ""
    # The allowed outputs of a choice; empty for every other kind.
    choices: tuple[str, ...] = ()
    # Text the constraint waits for (a reasoning model's end of thinking); empty: none.
    starts_after: str = ""
    # The text that opens what starts_after closes ("<think>"): in the prompt after starts_after's
    # last occurrence, the prompt has not closed it. Empty: any occurrence of starts_after counts.
    reopened_by: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", StructuredKind(self.kind))
        object.__setattr__(self, "choices", tuple(self.choices))
        if self.kind in _WITH_SPEC and not self.spec:
            raise InvalidRequest(f"structured output {self.kind} needs a non-empty specification")
        if self.kind not in _WITH_SPEC and self.spec:
            raise InvalidRequest(f"structured output {self.kind} takes no specification text")
        if self.kind is StructuredKind.CHOICE:
            if not self.choices:
                raise InvalidRequest("structured output choice needs at least one choice")
            if any(not isinstance(c, str) for c in self.choices):
                raise InvalidRequest("structured output choices must be strings")
        elif self.choices:
            raise InvalidRequest(f"structured output {self.kind} takes no choices")
        for name, text in (("starts_after", self.starts_after), ("reopened_by", self.reopened_by)):
            if len(text) > MAX_STARTS_AFTER_CHARS:
                raise InvalidRequest(f"structured output {name} has at most {MAX_STARTS_AFTER_CHARS} characters")

    @property
    def size(self) -> int:
        """Characters of specification (for the request's limit)."""
        return len(self.spec) + sum(len(c) for c in self.choices) + len(self.starts_after) + len(self.reopened_by)

    @property
    def grammar(self) -> StructuredOutput:
        """The constraint without its ``starts_after``: what compiles, and so the caches' key."""
        return replace(self, starts_after="", reopened_by="") if self.starts_after or self.reopened_by else self

    # ---- Redis (inside the sampling parameters' JSON) ----------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind.value}
        if self.spec:
            out["spec"] = self.spec
        if self.choices:
            out["choices"] = list(self.choices)
        if self.starts_after:
            out["starts_after"] = self.starts_after
        if self.reopened_by:
            out["reopened_by"] = self.reopened_by
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> StructuredOutput:
        return cls(
            StructuredKind(raw["kind"]),
            raw.get("spec", ""),
            tuple(raw.get("choices", ())),
            raw.get("starts_after", ""),
            raw.get("reopened_by", ""),
        )

    # ---- the wire (the public message, which ExecSampling carries as it is) --------------
    def to_pb(self) -> pb.StructuredOutput:
        msg = pb.StructuredOutput()
        if self.kind is StructuredKind.JSON_OBJECT:
            msg.json_object = True
        elif self.kind is StructuredKind.CHOICE:
            msg.choice.choices.extend(self.choices)
        else:
            setattr(msg, self.kind.value, self.spec)
        msg.starts_after = self.starts_after
        msg.reopened_by = self.reopened_by
        return msg

    @classmethod
    def from_pb(cls, msg: pb.StructuredOutput) -> StructuredOutput | None:
        """The message's constraint; None when the field is left empty."""
        which = msg.WhichOneof("kind")
        if which is None:
            if msg.starts_after or msg.reopened_by:  # where a constraint starts, but none to start
                raise InvalidRequest("structured_output sets starts_after or reopened_by but no kind of constraint")
            return None
        kind = StructuredKind(which)
        after, reopened = msg.starts_after, msg.reopened_by
        if kind is StructuredKind.JSON_OBJECT:
            if not msg.json_object:
                raise InvalidRequest("structured_output.json_object must be true when set")
            return cls(kind, starts_after=after, reopened_by=reopened)
        if kind is StructuredKind.CHOICE:
            return cls(kind, choices=tuple(msg.choice.choices), starts_after=after, reopened_by=reopened)
        return cls(kind, getattr(msg, which), starts_after=after, reopened_by=reopened)
