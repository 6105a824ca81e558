"""The executor's CPU scheduling priority, for a host it shares with the serving path (``executor.nice``).

Why: every request's latency runs through the scheduler, Redis and the gateway, which need a few
milliseconds of CPU each step, while an executor on the CPU takes every cycle it is given. At equal
priority the kernel shares the cores fairly, so on a small host a new request waits behind the
executors' steps before the scheduler can place it. Measured on 2 cores (AMD EPYC), the tiny model:

- two executors beside the scheduler, Redis and the benchmark client, the shared-prefix workload with
  16 requests in flight, seeds alternated: at nice 10 a request's time from arrival to placement went
  from 15-24 ms to about 4 ms, the time to first token of requests that found their prefix cached
  from 52-69 ms to 33-38 ms, and output throughput was the same or up to 8 % higher;
- one executor serving 200 requests at 16 requests/s gained nothing (TTFT p50 39 against 37 ms);
- a saturated host loses throughput: one executor given 64 or 96 requests at once produced 13-17 %
  fewer tokens per second at nice 10 and 6-8 % fewer at nice 5 (with one torch thread as with two,
  so not OpenMP's barriers); two executors, 3-10 % fewer.

So the default is 0, an equal share; an operator running several executors beside the scheduler on
a small host, who wants latency first, raises it. A host with nothing else on it gives any priority
every core.

Linux gives each thread its own nice value and a new thread inherits its creator's, so this runs
before the executor starts its thread pools (torch's OpenMP workers, gRPC's, asyncio's), and it also
lowers any thread already running. A nice value can only be raised without privileges: a process
started nicer than asked keeps its own.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

MAX_NICE = 19


def lower_cpu_priority(nice: int) -> int:
    """Run every thread of this process at ``nice`` at least (1-19); 0 leaves the priority the process
    started with, a negative nice an operator gave it included. Return the process's nice value."""
    if not 0 <= nice <= MAX_NICE:
        raise ValueError(f"nice must be 0-{MAX_NICE}, got {nice}")
    if not hasattr(os, "getpriority"):
        return 0  # no per-process priorities on this platform
    if nice == 0:
        return os.getpriority(os.PRIO_PROCESS, 0)
    for tid in _thread_ids():
        with contextlib.suppress(ProcessLookupError, PermissionError):  # a thread that just ended
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
    return os.getpriority(os.PRIO_PROCESS, 0)


def _thread_ids() -> list[int]:
    """This process's threads (Linux names each under /proc/self/task); elsewhere 0, the caller: the
    whole process where ``setpriority`` covers every thread (BSD, macOS), the calling thread on a Linux
    without /proc (the threads it starts later inherit its value)."""
    tasks = Path("/proc/self/task")
    if tasks.is_dir():
        return [int(entry.name) for entry in tasks.iterdir()]
    return [0]
