"""Rejects a structured output whose schema, expression or grammar is invalid, before it is queued.

The check parses the constraint with xgrammar (``common.structured_grammar.parse``), which finds
every error a compile would, without the per-token tables a compile builds over the whole
vocabulary: those are the executor's work, done once per executor, and would cost the scheduler
most of a CPU second per new schema on a large vocabulary. Parsing runs in a worker thread, off
the event loop, and each verdict is remembered (a bounded LRU keyed by the constraint itself):
clients tend to send the same few schemas again and again.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from common import structured_grammar
from common.errors import InvalidRequest
from common.structured_output import StructuredOutput


class GrammarCheck:
    def __init__(self, capacity: int = 1024) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        # Constraint -> "" when it parses, else the client's error message; most recently used last.
        self._verdicts: OrderedDict[StructuredOutput, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._verdicts)

    async def check(self, spec: StructuredOutput) -> None:
        """Raise InvalidRequest when ``spec`` does not parse."""
        spec = spec.grammar  # what it waits for does not change what compiles
        verdict = self._verdicts.get(spec)
        if verdict is None:
            verdict = await asyncio.to_thread(self._verdict, spec)
            self._verdicts[spec] = verdict
            while len(self._verdicts) > self.capacity:
                self._verdicts.popitem(last=False)
        else:
            self._verdicts.move_to_end(spec)
        if verdict:
            raise InvalidRequest(verdict)

    @staticmethod
    def _verdict(spec: StructuredOutput) -> str:
        try:
            structured_grammar.parse(spec)
        except InvalidRequest as exc:
            return str(exc)
        return ""
