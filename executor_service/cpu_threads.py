"""How many cores torch uses on CPU, decided step by step (``executor.torch_threads: 0``).

Why adaptive: the executor shares its machine with its own gRPC thread and, on small hosts, with
the scheduler, Redis and the clients, which need a few milliseconds of CPU per step. Measured on
2 cores (docs/performance.md, "Fifth round"):

- the tiny model, whose steps are 15-60 ms of work: one torch thread, the other core left to the
  rest of the stack, ran end to end about 10 % faster than two;
- the small model, whose steps are 200-600 ms: two threads ran end to end 1.6x faster
  (115 -> 181 output tok/s), because the stack's few milliseconds per step are small next to a
  step, while a second core nearly halves it.

So a heavy step gets every core and a light one leaves one core free. The next step is judged by
the last one's work (its forward-pass seconds times the threads it had), with a gap between the
two thresholds so that halving a step's time by doubling its threads does not flip it back.

Idle OpenMP workers must sleep, not spin, for the free core to be of use to anyone:
``prefer_passive_openmp`` sets ``OMP_WAIT_POLICY=PASSIVE`` unless the operator chose a policy. It
must run before torch is imported, as libgomp reads the variable once, when it loads; this module
therefore does not import torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable, MutableMapping

HEAVY_STEP_CPU_MS = 100.0  # a step with at least this much work: every core next time
LIGHT_STEP_CPU_MS = 60.0  # below this: all cores but one next time


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, which a container's cpuset narrows)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def prefer_passive_openmp(env: MutableMapping[str, str] = os.environ) -> None:
    """Let idle OpenMP workers sleep at once (unless ``OMP_WAIT_POLICY`` is already set).

    With the default policy a worker spins after each parallel region, taking the core the
    scheduler's and gRPC's threads are waiting for; measured on the small model with two threads,
    end to end went from 30.2 s to 26.2 s with PASSIVE.
    """
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")


class ThreadGovernor:
    """Chooses each step's torch thread count from the previous step's work; no I/O of its own."""

    def __init__(self, cores: int, set_threads: Callable[[int], None]) -> None:
        if cores < 1:
            raise ValueError(f"cores must be >= 1, got {cores}")
        self.few = max(1, cores - 1)
        self.many = cores
        self.current = self.few
        self._set_threads = set_threads
        self._applied: int | None = None

    def before_step(self) -> None:
        """Apply the current choice (a no-op when it has not changed); call from the engine thread."""
        if self._applied != self.current:
            self._set_threads(self.current)
            self._applied = self.current

    def after_step(self, forward_seconds: float) -> None:
        work_ms = forward_seconds * 1000.0 * self.current
        if work_ms >= HEAVY_STEP_CPU_MS:
            self.current = self.many
        elif work_ms < LIGHT_STEP_CPU_MS:
            self.current = self.few
