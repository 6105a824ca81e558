"""The other executors on this host that may run on this process's cores.

Why the thread governor needs them: it gives a heavy step every core that other processes leave
free, judged by what they used while this executor stepped. After a pause nothing is known, and a
heavy step then took every core. Two executors on two cores that a burst of prompts reached at
once both did: four OpenMP threads on two cores wait on each other at every parallel region, and
the burst's first step of about 1,100 tokens (tiny model) took 236-275 ms on each executor, where
one thread each took about 120 ms. Another executor is the one neighbour whose load is known
before it shows: it steps whenever the scheduler gives it work, which a burst does to every
executor at once.

Each executor writes a file named by its pid into a directory on this host (``/dev/shm`` where it
exists: memory, cleared at boot), holding its start time and the cores it may run on, and removes
it when it stops (a killed one's file is dropped by the next peer that reads it). Its peers
are the files of live processes (the same pid and start time, so a reused pid is not counted)
whose cores overlap its own. Executors in separate containers see separate directories, as they
see separate process tables; there the governor behaves as before.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil

# Listing the directory costs about 50 us for a few executors; the set changes only when one starts
# or stops, so once every few seconds is enough.
REFRESH_S = 2.0


def default_directory() -> Path:
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / "baton-executors"


def _cores() -> frozenset[int]:
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def _started(pid: int) -> float | None:
    """The process's start time, or None when there is no such process."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


class HostPeers:
    """Registers this process as an executor of the host; calling it counts the live others that
    share a core with it."""

    def __init__(
        self,
        directory: Path | None = None,
        cores: frozenset[int] | None = None,
        refresh_s: float = REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = directory or default_directory()
        self.cores = cores if cores is not None else _cores()
        self._refresh_s = refresh_s
        self._clock = clock
        self._pid = os.getpid()
        self._own = self.directory / str(self._pid)
        self._count = 0
        self._counted_at: float | None = None
        self._register()

    def _register(self) -> None:
        started = _started(self._pid)
        try:
            self.directory.mkdir(mode=0o1777, parents=True, exist_ok=True)
            with contextlib.suppress(OSError):
                self.directory.chmod(0o1777)  # other users' executors register here too (sticky, like /tmp)
            self._own.write_text(f"{started}\n{','.join(map(str, sorted(self.cores)))}\n")
        except OSError:
            return  # no shared directory: no peers known, as before this existed
        atexit.register(self.close)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._own.unlink()

    def __call__(self) -> int:
        now = self._clock()
        if self._counted_at is None or now - self._counted_at >= self._refresh_s:
            self._count = self._scan()
            self._counted_at = now
        return self._count

    def _scan(self) -> int:
        try:
            entries = list(self.directory.iterdir())
        except OSError:
            return 0
        return sum(1 for entry in entries if self._is_peer(entry))

    def _is_peer(self, entry: Path) -> bool:
        if not entry.name.isdigit() or int(entry.name) == self._pid:
            return False
        try:
            started_text, cores_text = entry.read_text().split("\n")[:2]
            started = float(started_text)
            cores = {int(core) for core in cores_text.split(",") if core}
        except (OSError, ValueError):
            return False  # being written, or not ours: no peer
        if _started(int(entry.name)) != started:
            with contextlib.suppress(OSError):
                entry.unlink()  # an executor that died without removing its file
            return False
        return not self.cores.isdisjoint(cores)
