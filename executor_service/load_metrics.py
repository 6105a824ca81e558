"""How busy the executor's device is, for load reports to the scheduler.

On a CUDA device the figures come from NVML (the GPU as a whole, whoever else uses it). Where NVML is missing
(CPU runs, containers without the driver library) the executor process itself is measured with psutil instead,
so callers always get a figure and never an exception. Sampling is cached: the engine asks every iteration.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil
import torch

logger = logging.getLogger(__name__)

REFRESH_INTERVAL_S = 0.5


@dataclass(frozen=True)
class DeviceLoad:
    source: str  # "nvml" or "process"
    utilization_pct: float  # 0..100
    memory_used_bytes: int
    memory_total_bytes: int
    power_watts: float  # 0 where unknown


class LoadSampler:
    """Reads device load at most every ``refresh_interval_s``; between refreshes ``sample`` returns the cache."""

    def __init__(
        self,
        device: str,
        *,
        refresh_interval_s: float = REFRESH_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if refresh_interval_s < 0:
            raise ValueError(f"refresh_interval_s must be >= 0, got {refresh_interval_s}")
        self._interval = refresh_interval_s
        self._clock = clock
        self._lock = threading.Lock()  # gRPC handler threads may sample alongside the engine thread
        self._cached: DeviceLoad | None = None
        self._cached_at = 0.0
        self._nvml: Any = None  # the pynvml module while NVML is initialised
        self._handle: Any = None

        try:
            parsed = torch.device(device)
        except RuntimeError as exc:
            raise ValueError(f"invalid device {device!r}: {exc}") from exc
        if parsed.type == "cuda":
            self._init_nvml(parsed.index or 0)
        self._process = psutil.Process()
        self._memory_total = psutil.virtual_memory().total
        self._cpu_count = psutil.cpu_count() or 1
        # The first cpu_percent call only starts the measurement window (it returns 0.0).
        self._process.cpu_percent(None)

    @property
    def source(self) -> str:
        return "nvml" if self._handle is not None else "process"

    def sample(self) -> DeviceLoad:
        with self._lock:
            now = self._clock()
            if self._cached is not None and now - self._cached_at < self._interval:
                return self._cached
            self._cached = self._read()
            self._cached_at = now
            return self._cached

    def close(self) -> None:
        """Release NVML; idempotent. Later samples measure the process instead."""
        with self._lock:
            self._shutdown_nvml()

    def __enter__(self) -> LoadSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read(self) -> DeviceLoad:
        if self._handle is not None:
            try:
                return self._read_nvml()
            except Exception as exc:  # any NVML error (GPU lost, driver reloaded): degrade, never fail the engine
                logger.warning("NVML read failed, falling back to process metrics: %s", exc)
                self._shutdown_nvml()
        return self._read_process()

    def _read_nvml(self) -> DeviceLoad:
        nvml, handle = self._nvml, self._handle
        # Memory is the one figure every GPU reports, so its failure is the one that means NVML is broken.
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        try:
            util = nvml.nvmlDeviceGetUtilizationRates(handle).gpu
        except nvml.NVMLError:  # not reported for MIG slices
            util = 0
        try:
            power_mw = nvml.nvmlDeviceGetPowerUsage(handle)
        except nvml.NVMLError:  # not every board reports power (MIG slices, some older parts)
            power_mw = 0
        return DeviceLoad(
            source="nvml",
            utilization_pct=float(util),
            memory_used_bytes=int(memory.used),
            memory_total_bytes=int(memory.total),
            power_watts=power_mw / 1000.0,
        )

    def _read_process(self) -> DeviceLoad:
        # psutil reports per-core percent (up to 100 * cores); scale to the machine so it reads like GPU util.
        cpu = self._process.cpu_percent(None) / self._cpu_count
        return DeviceLoad(
            source="process",
            utilization_pct=min(cpu, 100.0),
            memory_used_bytes=int(self._process.memory_info().rss),
            memory_total_bytes=int(self._memory_total),
            power_watts=0.0,
        )

    def _init_nvml(self, cuda_index: int) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as exc:  # no driver library, no GPU, no package: measure the process instead
            logger.warning("NVML unavailable for cuda:%d, reporting process metrics: %s", cuda_index, exc)
            return
        self._nvml = pynvml
        try:
            self._handle = self._find_handle(pynvml, cuda_index)
        except Exception as exc:
            logger.warning("no NVML handle for cuda:%d, reporting process metrics: %s", cuda_index, exc)
            self._shutdown_nvml()

    @staticmethod
    def _find_handle(nvml: Any, cuda_index: int) -> Any:
        """The NVML handle of the GPU torch calls ``cuda:<index>``.

        NVML numbers GPUs by PCI bus and ignores CUDA_VISIBLE_DEVICES, while CUDA renumbers the visible ones,
        so the plain index is only right on an unrestricted machine. The UUID is unambiguous: use it when torch
        can tell it, else map the index through CUDA_VISIBLE_DEVICES.
        """
        uuid = _torch_device_uuid(cuda_index)
        if uuid is not None:
            return nvml.nvmlDeviceGetHandleByUUID(uuid)
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        if cuda_index < len(visible):
            entry = visible[cuda_index]
            if entry.isdigit():
                return nvml.nvmlDeviceGetHandleByIndex(int(entry))
            return nvml.nvmlDeviceGetHandleByUUID(entry)
        return nvml.nvmlDeviceGetHandleByIndex(cuda_index)

    def _shutdown_nvml(self) -> None:
        if self._nvml is None:
            return
        nvml, self._nvml, self._handle = self._nvml, None, None
        try:
            nvml.nvmlShutdown()
        except Exception as exc:  # shutting down must never raise; the library may already be gone
            logger.debug("nvmlShutdown failed: %s", exc)


def _torch_device_uuid(cuda_index: int) -> str | None:
    """``GPU-…`` UUID of a CUDA device as NVML spells it, or None when torch cannot tell."""
    try:
        if not torch.cuda.is_available():
            return None
        uuid = getattr(torch.cuda.get_device_properties(cuda_index), "uuid", None)
    except Exception:  # a broken CUDA setup must not stop load reporting
        return None
    if uuid is None:
        return None
    text = str(uuid)
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"
