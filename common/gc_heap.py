"""Take a service's startup heap out of the garbage collector's full passes.

A started service holds 300,000-400,000 long-lived objects: torch, transformers, grpc and the
model's modules in an executor; grpc, redis and the tokenizer in a scheduler. Python's oldest-
generation collection walks every one of them while holding the GIL. Measured in both services:
210-250 ms a pass, at 9-35 s of serving in one run, and each pass stalls every stream of the process
at once (an executor's engine thread included). None of those objects is ever garbage, so once the
service is up (and an executor warm) they move to the permanent generation that the collector
skips (``gc.freeze``). vLLM, SGLang and TensorRT-LLM do the same after their warm-up.

Only the process entry points call this (``serve``, ``baton gateway``): a test that starts servers
in its own process keeps its collector as it was. The scheduler freezes again once the tokenizer
has loaded with its first request: that collection walks only what came after the first freeze
(about 45 ms, once). The cost of freezing: an object alive at a freeze that later becomes part of
an unreachable cycle (a connection rebuilt after a failure, say) is never reclaimed. That is bounded
by what was alive at the freezes; reference counting still frees everything else.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect once (so no garbage is kept for good), freeze what is left; return how many objects."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("froze %d startup objects out of the garbage collector's full passes", frozen)
    return frozen
