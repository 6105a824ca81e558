"""CUDA graphs of the static-shape decode step: captured once per shape, replayed after.

Why: a decode step of a small model on a GPU is hundreds of short kernels, and launching them
one by one from Python takes longer than running them; the device idles between launches. A
graph records the launches once and replays them in one call.

What is captured is ``DecodeStep.forward`` for one ``(batch, width)`` and nothing else: the
function the CPU tests run eagerly, token for token against ``model.generate``. Its inputs are
tensors at fixed addresses (the decode rows, the step's row list, the KV pool, the weights), which
the eager ``prepare`` writes before each replay; its logits land in one output buffer all graphs
share. All graphs share one memory pool, as nano-vllm's do: replays never overlap, and each
graph's intermediates are dead once its logits are copied out.

When: before serving, every batch bucket at every table width up to a context length
(``ModelRunner.capture_decode_graphs``), largest first so the pool is sized once, with every row
the scratch row (a capture runs the step eagerly first; padding writes only the scratch block).
A step of a shape not captured yet (a longer context) captures it on first use, on its real
inputs (the K/V the eager run writes are the ones a replay would write again): a one-off pause of
a few tens of milliseconds, since torch empties its allocator's cache for each capture.

A capture that fails (an op the installed torch cannot capture) is logged and turns graphs off
for the run; the step it was for returns the logits of its eager run, so serving goes on eagerly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)


class DecodeGraphs:
    """``run(batch, width)``: the logits of ``forward(batch, width)``, replayed from a graph where one is captured."""

    def __init__(self, forward: Callable[[int, int], torch.Tensor], max_batch: int) -> None:
        self._forward = forward
        self._max_batch = max_batch
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool: Any = None  # the memory pool every graph shares, from the first capture
        self._logits: torch.Tensor | None = None  # [max_batch, vocab], every graph's output
        self.disabled = ""  # why graphs are off for this run; empty while they are on

    @property
    def captured(self) -> tuple[tuple[int, int], ...]:
        """The ``(batch, width)`` shapes that have a graph."""
        return tuple(self._graphs)

    def run(self, batch: int, width: int) -> torch.Tensor:
        if self.disabled:
            return self._forward(batch, width)
        graph, out = self._graphs.get((batch, width)), self._logits
        if graph is None or out is None:  # the first capture sets both
            return self.capture(batch, width)
        graph.replay()
        return out[:batch]

    def capture(self, batch: int, width: int) -> torch.Tensor:
        """Run ``forward(batch, width)`` eagerly, then capture it; return the eager run's logits."""
        started = time.perf_counter()
        logits = self._forward(batch, width)  # warm-up on the live inputs; also this step's answer
        if self._logits is None:
            self._logits = logits.new_empty((self._max_batch, logits.shape[1]))
        try:
            graph = torch.cuda.CUDAGraph()
            # thread_local: the executor's other threads (gRPC, load metrics) may touch CUDA meanwhile.
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self._logits[:batch].copy_(self._forward(batch, width))
        except RuntimeError as exc:
            self.disabled = f"capturing the decode step (batch {batch}, width {width}) failed: {exc}"
            log.warning("CUDA graphs off for this run, decode steps run eagerly: %s", self.disabled)
            return logits
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[(batch, width)] = graph
        log.info(
            "captured the decode step for batch %d, width %d blocks in %.0f ms (%d graphs)",
            batch,
            width,
            (time.perf_counter() - started) * 1000,
            len(self._graphs),
        )
        return logits
