"""Samples device load (NVML on a GPU, else the process) in a background thread during a timed window.

Phase (a) reads the executor's own figures from its Prometheus ``/metrics`` (what it reports to
the scheduler); phase (b) samples in process with the executor's ``LoadSampler``.
"""

from __future__ import annotations

import contextlib
import threading
import urllib.request
from collections.abc import Callable

from executor_service.load_metrics import LoadSampler

Reading = dict[str, float]
_METRICS = {
    "baton:gpu_utilization_perc": "util_pct",
    "baton:gpu_memory_used_bytes": "memory_bytes",
    "baton:gpu_power_watts": "power_w",
}


def metrics_reader(port: int) -> Callable[[], Reading]:
    """Reads the executor's device gauges from its /metrics endpoint."""

    def read() -> Reading:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as reply:
            text = reply.read().decode()
        out: Reading = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name in _METRICS:
                out[_METRICS[name]] = float(value)
        return out

    return read


def sampler_reader(device: str) -> Callable[[], Reading]:
    sampler = LoadSampler(device, refresh_interval_s=0)

    def read() -> Reading:
        load = sampler.sample()
        return {"util_pct": load.utilization_pct, "memory_bytes": load.memory_used_bytes, "power_w": load.power_watts}

    return read


class DeviceWatch:
    """``with DeviceWatch(read) as watch: ...`` then ``watch.summary()``; ``read=None`` watches nothing."""

    def __init__(self, read: Callable[[], Reading] | None, interval_s: float = 0.5) -> None:
        self._read, self._interval = read, interval_s
        self._samples: list[Reading] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="device-watch", daemon=True)

    def __enter__(self) -> DeviceWatch:
        if self._read is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def _loop(self) -> None:
        assert self._read is not None
        while not self._stop.wait(self._interval):
            with contextlib.suppress(OSError):  # a missed sample is no reason to fail the benchmark
                self._samples.append(self._read())

    def summary(self) -> dict[str, float] | None:
        rows = [s for s in self._samples if s]
        if not rows:
            return None
        util = [s.get("util_pct", 0.0) for s in rows]
        power = [s.get("power_w", 0.0) for s in rows]
        return {
            "samples": len(rows),
            "util_pct_mean": sum(util) / len(util),
            "util_pct_max": max(util),
            "memory_gib_max": max(s.get("memory_bytes", 0.0) for s in rows) / 2**30,
            "power_w_mean": sum(power) / len(power),
            "power_w_max": max(power),
        }
