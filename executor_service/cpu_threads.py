"""How many cores torch uses on CPU, decided step by step (``executor.torch_threads: 0``).

Why adaptive: the executor shares its machine with its own gRPC thread and, on small hosts, with
the scheduler, Redis and the clients, which need a few milliseconds of CPU per step. Measured on
2 cores (docs/performance.md, "Fifth round"):

- the tiny model, whose steps are 15-60 ms of work: one torch thread, the other core left to the
  rest of the stack, ran end to end about 10 % faster than two;
- the small model, whose steps are 200-600 ms: two threads ran end to end 1.6x faster
  (115 -> 181 output tok/s), because the stack's few milliseconds per step are small next to a
  step, while a second core nearly halves it.

So a heavy step gets every core and a light one leaves one core free, but only while something
else on the machine uses it: an executor alone on its host (the scheduler elsewhere) gives light
steps every core too. A heavy step leaves out the cores other processes keep busy, though. Two
executors of the small model on 2 cores (bfloat16, AVX-512), each giving its heavy steps both
cores, were slower in 7 of 8 alternated runs (five end to end, three of the engine alone) than
with one thread each, by up to 12 % (performance.md, "Twelfth round"). Four threads on two cores
wait on each other at every parallel region, and the other executor already keeps the second
core busy.

While the others' load is unknown (at start, and after a pause, when they are idle too), a heavy
step leaves a core to each other executor on the same cores (``host_peers``): a burst reaches every
executor at once, and two executors each taking both cores of a 2-core host ran the burst's first
steps about twice as long as one thread each.

The next step is judged by the last one's work (its forward-pass seconds
times the threads it had), with a gap between the two thresholds so that halving a step's time by
doubling its threads does not flip it back. A large prefill is also judged before it runs, from its
token count and the work per token of earlier large steps: a long prompt reaching a quiet executor
would otherwise run its first, heaviest step on the light steps' threads (2,000 tokens of the tiny
model in float32 on 2 cores: 245 ms on one thread against 128 ms on two).

Idle OpenMP workers must soon sleep, not spin, for the free core to be of use to anyone:
``prefer_brief_openmp_spin`` sets ``OMP_WAIT_POLICY=PASSIVE`` and a short spin before sleeping unless
the operator chose a policy. It must run before torch is imported, as libgomp reads the variables
once, when it loads; this module therefore does not import torch.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, MutableMapping

import psutil

HEAVY_STEP_CPU_MS = 100.0  # a step with at least this much work: every core next time
LIGHT_STEP_CPU_MS = 60.0  # below this: all cores but one next time, if others use that core
# Other processes using less than this share of one core do not need one left free. The co-located
# stack of the benchmarks (scheduler, client, Redis) used about 0.55 of a core beside tiny's steps
# and 0.09 beside small's, where the choice for its few light steps (the tail of a round) made no
# difference measurable here; an idle machine's background is about 0.02.
OTHERS_BUSY_CORES = 0.05
# Others using at least this many cores' worth (rounded to whole cores) take those cores from a
# heavy step as well: another executor uses about 1.0 beside its own steps, the benchmarks' stack
# (scheduler, client, Redis) 0.09 beside small's heavy steps, where a second thread is 1.6x faster.
OTHERS_HOLD_A_CORE = 0.5
# Steps of at least this many tokens are mostly prompt tokens, whose cost per token (their matrix
# products) predicts a later large step's; a decode step's fixed cost would overstate it.
LARGE_STEP_TOKENS = 256


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, which a container's cpuset narrows)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


# libgomp's spins before a worker sleeps: 20,000 took 0.22 ms on the 2-core machine these figures
# come from. With none, a heavy step's workers fell asleep between the dozens of parallel regions of
# every layer and each region paid a futex wake-up: the small model's shared-prefix workload end to
# end, alternated four times on 2 cores, ran 1.08-1.10x faster with this spin than with none (and
# within noise of ten times as many); the tiny model's workloads, whose light steps run one thread,
# were unchanged. libgomp's own default without a policy, 300,000 spins (about 3 ms after every
# region), is what kept a core from the scheduler between steps.
OPENMP_SPIN_COUNT = 20_000


def prefer_brief_openmp_spin(env: MutableMapping[str, str] = os.environ) -> None:
    """Let idle OpenMP workers spin briefly, then sleep (unless the operator chose ``OMP_WAIT_POLICY``).

    With the default policy a worker spins for milliseconds after each parallel region, taking the
    core the scheduler's and gRPC's threads are waiting for; measured on the small model with two
    threads, end to end went from 30.2 s to 26.2 s with PASSIVE. ``GOMP_SPINCOUNT`` (libgomp's; an
    Intel OpenMP ignores it) is set only with the policy, as it overrides the policy's own spin.
    """
    if "OMP_WAIT_POLICY" in env:
        return
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    env.setdefault("GOMP_SPINCOUNT", str(OPENMP_SPIN_COUNT))


class OtherLoad:
    """How many cores' worth of CPU other processes used on this process's cores while it stepped.

    Called after each step; re-sampled at most every ``interval_s`` (two /proc reads, about 75 us),
    from the kernel's per-CPU busy time minus this process's own CPU time. Steal time is not
    counted: no process of this machine gets it back if a core is left free. A window in which the
    engine sat idle says nothing about the load beside a step (the scheduler and its clients are
    idle then too), so after a pause the figure is unknown, counted as busy, until a window of
    stepping has passed.
    """

    def __init__(self, interval_s: float = 0.25, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval = interval_s
        self._clock = clock
        self._process = psutil.Process()
        self._cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        self._start(clock())

    def _start(self, now: float) -> None:
        self._window = (now, *self._read())
        self._last_call = now
        self.busy_cores = math.inf

    def __call__(self, stepped_s: float = 0.0) -> float:
        """The figure after a step that took ``stepped_s``: a step longer than the window is no pause."""
        now = self._clock()
        if now - self._last_call - stepped_s > self._interval:
            self._start(now)  # the engine paused: begin a new window
        self._last_call = now
        started, machine_then, own_then = self._window
        if now - started >= self._interval:
            machine, own = self._read()
            self.busy_cores = max(0.0, (machine - machine_then) - (own - own_then)) / (now - started)
            self._window = (now, machine, own)
        return self.busy_cores

    def _read(self) -> tuple[float, float]:
        per_cpu = psutil.cpu_times(percpu=True)
        mine = per_cpu if self._cpus is None else [per_cpu[i] for i in self._cpus if i < len(per_cpu)]
        machine = sum(t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0) for t in mine)
        own = self._process.cpu_times()
        return machine, own.user + own.system


class ThreadGovernor:
    """Chooses each step's torch thread count from the previous step's work and the others' load."""

    def __init__(
        self,
        cores: int,
        set_threads: Callable[[int], None],
        # Given the last step's seconds; math.inf when unknown: light steps leave a core, heavy ones
        # leave one to each other executor on these cores (``peers``).
        others_busy_cores: Callable[[float], float] = lambda stepped_s: math.inf,
        # How many other executors of this host share these cores (``host_peers.HostPeers``).
        peers: Callable[[], int] = lambda: 0,
    ) -> None:
        if cores < 1:
            raise ValueError(f"cores must be >= 1, got {cores}")
        self.few = max(1, cores - 1)
        self.many = cores
        self.current = self.few
        self._set_threads = set_threads
        self._others = others_busy_cores
        self._peers = peers
        self._applied: int | None = None
        self._last_others = math.inf
        self._large_step_ms_per_token: float | None = None  # work per token of the last large step

    def before_step(self, tokens: int = 0) -> None:
        """Apply the choice for a step of ``tokens`` tokens (a no-op when it has not changed); call
        from the engine thread. A large step whose predicted work is heavy gets a heavy step's threads."""
        threads = self.current
        per_token = self._large_step_ms_per_token
        if tokens >= LARGE_STEP_TOKENS and per_token is not None and tokens * per_token >= HEAVY_STEP_CPU_MS:
            threads = max(threads, self._heavy_threads(self._last_others))
        if self._applied != threads:
            self._set_threads(threads)
            self._applied = threads

    def after_step(self, forward_seconds: float, tokens: int = 0) -> None:
        work_ms = forward_seconds * 1000.0 * (self._applied or self.current)
        others = self._others(forward_seconds)
        self._last_others = others
        if tokens >= LARGE_STEP_TOKENS:
            self._large_step_ms_per_token = work_ms / tokens
        if work_ms >= HEAVY_STEP_CPU_MS:
            self.current = self._heavy_threads(others)
        elif work_ms < LIGHT_STEP_CPU_MS:
            self.current = self.few if others >= OTHERS_BUSY_CORES else self.many

    def _heavy_threads(self, others: float) -> int:
        """Every core but those other processes keep busy; while that is unknown, every core but one
        for each other executor on these cores, which a burst keeps stepping as it does this one."""
        held = self._peers() if math.isinf(others) else math.floor(others + 1.0 - OTHERS_HOLD_A_CORE)
        return max(1, self.many - held)
