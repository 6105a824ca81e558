from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Any

import pytest

from executor_service.load_metrics import DeviceLoad, LoadSampler


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_cpu_device_reports_process_metrics() -> None:
    with LoadSampler("cpu") as sampler:
        load = sampler.sample()
    assert isinstance(load, DeviceLoad)
    assert load.source == "process"
    assert 0 < load.memory_used_bytes <= load.memory_total_bytes
    assert 0.0 <= load.utilization_pct <= 100.0
    assert load.power_watts == 0.0


def test_sample_is_cached_within_the_refresh_interval() -> None:
    clock = FakeClock()
    sampler = LoadSampler("cpu", clock=clock)
    first = sampler.sample()
    clock.now += 0.49
    assert sampler.sample() is first
    clock.now += 0.02
    assert sampler.sample() is not first
    sampler.close()


def _nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


@pytest.mark.parametrize("how", ["this machine", "import fails", "init fails"])
def test_missing_nvml_falls_back_to_process(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if how == "this machine" and _nvml_works():
        pytest.skip("NVML works here; the simulated failures below still run")
    if how == "import fails":
        monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    elif how == "init fails":
        broken = _fake_pynvml()
        broken.nvmlInit = lambda: (_ for _ in ()).throw(_NVMLError("driver not loaded"))
        monkeypatch.setitem(sys.modules, "pynvml", broken)
    sampler = LoadSampler("cuda:0")
    load = sampler.sample()
    assert load.source == "process"
    assert load.memory_used_bytes > 0 and load.memory_total_bytes > 0
    sampler.close()
    sampler.close()  # idempotent


def test_invalid_device_raises_value_error() -> None:
    with pytest.raises(ValueError):
        LoadSampler("not-a-device")


class _NVMLError(Exception):
    pass


@dataclass
class _Memory:
    used: int
    total: int


@dataclass
class _Util:
    gpu: int


def _fake_pynvml(fail_power: bool = False) -> Any:
    state: dict[str, Any] = {"init": 0, "shutdown": 0, "index": None, "broken": False}
    mod = types.ModuleType("pynvml")
    mod.NVMLError = _NVMLError  # type: ignore[attr-defined]

    def check() -> None:
        if state["broken"]:
            raise _NVMLError("GPU is lost")

    def power(handle: object) -> int:
        if fail_power:
            raise _NVMLError("not supported")
        return 123_456

    def memory(handle: object) -> _Memory:
        check()
        return _Memory(used=3 << 30, total=80 << 30)

    def by_index(i: int) -> str:
        state["index"] = i
        return f"handle{i}"

    mod.nvmlInit = lambda: state.__setitem__("init", state["init"] + 1)  # type: ignore[attr-defined]
    mod.nvmlShutdown = lambda: state.__setitem__("shutdown", state["shutdown"] + 1)  # type: ignore[attr-defined]
    mod.nvmlDeviceGetHandleByIndex = by_index  # type: ignore[attr-defined]
    mod.nvmlDeviceGetHandleByUUID = lambda uuid: f"handle-{uuid}"  # type: ignore[attr-defined]
    mod.nvmlDeviceGetUtilizationRates = lambda h: _Util(gpu=42)  # type: ignore[attr-defined]
    mod.nvmlDeviceGetMemoryInfo = memory  # type: ignore[attr-defined]
    mod.nvmlDeviceGetPowerUsage = power  # type: ignore[attr-defined]
    mod.state = state  # type: ignore[attr-defined]
    return mod


def test_nvml_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    sampler = LoadSampler("cuda:1")
    load = sampler.sample()
    assert load == DeviceLoad(
        source="nvml", utilization_pct=42.0, memory_used_bytes=3 << 30, memory_total_bytes=80 << 30, power_watts=123.456
    )
    assert fake.state["index"] == 1
    sampler.close()
    assert fake.state["shutdown"] == 1


def test_nvml_index_follows_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    LoadSampler("cuda:1").close()
    assert fake.state["index"] == 5


def test_unsupported_power_reads_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(fail_power=True))
    load = LoadSampler("cuda").sample()
    assert load.source == "nvml" and load.power_watts == 0.0


def test_nvml_failure_at_runtime_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    clock = FakeClock()
    sampler = LoadSampler("cuda:0", clock=clock)
    assert sampler.sample().source == "nvml"
    fake.state["broken"] = True
    clock.now += 1.0
    assert sampler.sample().source == "process"
    assert fake.state["shutdown"] == 1
