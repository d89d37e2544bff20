"""The pynvml boundary, driven by raising the real pynvml.NVMLError_* classes."""

from __future__ import annotations

import types

import pynvml
import pytest

from gpuwatch.telemetry import nvml
from gpuwatch.telemetry.bus import Bus
from gpuwatch.telemetry.sampler import Sampler


class FakeDriver:
    """Stands in for libnvml behind pynvml's functions: two GPUs; errors are the real classes."""

    def __init__(self, monkeypatch):
        self.calls = {"power": 0}
        self.lost = set()
        self.power_error = None
        mp = monkeypatch.setattr
        mp(pynvml, "nvmlInit", lambda: None)
        mp(pynvml, "nvmlShutdown", lambda: None)
        mp(pynvml, "nvmlSystemGetDriverVersion", lambda: "580.1")
        mp(pynvml, "nvmlSystemGetNVMLVersion", lambda: "13.580")
        mp(pynvml, "nvmlDeviceGetCount", lambda: 2)
        mp(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: i)
        mp(pynvml, "nvmlDeviceGetName", lambda h: b"NVIDIA H200")
        mp(pynvml, "nvmlDeviceGetUUID", lambda h: f"GPU-{h}")
        mp(pynvml, "nvmlDeviceGetPciInfo", lambda h: types.SimpleNamespace(busId=f"0000:0{h}:00.0"))
        mp(pynvml, "nvmlDeviceGetEnforcedPowerLimit", lambda h: 700_000)
        mp(pynvml, "nvmlDeviceGetTemperatureThreshold", lambda h, t: 89)
        mp(pynvml, "nvmlDeviceGetMemoryInfo", self._guard(lambda h: types.SimpleNamespace(used=10 * 2**30, total=141 * 2**30)))
        mp(pynvml, "nvmlDeviceGetUtilizationRates", self._guard(lambda h: types.SimpleNamespace(gpu=97, memory=40)))
        mp(pynvml, "nvmlDeviceGetTemperature", self._guard(lambda h, s: 60))
        mp(pynvml, "nvmlDeviceGetPowerUsage", self._power)
        mp(pynvml, "nvmlDeviceGetClockInfo", self._guard(lambda h, c: 1980))
        mp(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", self._guard(lambda h: 4))
        mp(pynvml, "nvmlDeviceGetTotalEccErrors", self._raise(pynvml.NVMLError_NotSupported))
        mp(pynvml, "nvmlDeviceGetComputeRunningProcesses",
           self._guard(lambda h: [types.SimpleNamespace(pid=42, usedGpuMemory=2**30)]))
        mp(pynvml, "nvmlDeviceGetPcieThroughput", self._guard(lambda h, c: 100))
        mp(pynvml, "nvmlDeviceGetTotalEnergyConsumption", self._guard(lambda h: 5000))
        mp(pynvml, "nvmlDeviceGetFieldValues", self._raise(pynvml.NVMLError_NotSupported))
        mp(pynvml, "nvmlEventSetCreate", self._raise(pynvml.NVMLError_NotSupported))

    def _guard(self, fn):
        def call(h, *a):
            if h in self.lost:
                raise pynvml.NVMLError_GpuIsLost()
            return fn(h, *a)
        return call

    def _power(self, h):
        self.calls["power"] += 1
        if self.power_error:
            raise self.power_error()
        return self._guard(lambda h: 350_000)(h)

    @staticmethod
    def _raise(cls):
        def call(*a):
            raise cls()
        return call


@pytest.fixture
def driver(monkeypatch):
    return FakeDriver(monkeypatch)


def test_reads_every_field_in_schema_units(driver):
    b = nvml.NvmlBackend()
    row = b.read_fast(0)
    assert row["gpu_util_pct"] == 97 and row["gpu_mem_util_pct"] == 40
    assert row["gpu_mem_used_bytes"] == 10 * 2**30 and row["gpu_mem_total_bytes"] == 141 * 2**30
    assert row["gpu_power_w"] == 350.0 and row["gpu_power_limit_w"] == 700.0
    assert row["gpu_temp_slowdown_c"] == 89 and row["gpu_clocks_event_reasons"] == 4
    assert row["gpu_procs"] == [{"pid": 42, "used_bytes": 2**30}]
    slow = b.read_slow(0)  # field values unsupported -> the legacy calls
    assert slow == {"gpu_pcie_tx_bytes_per_s": 100 * 1024, "gpu_pcie_rx_bytes_per_s": 100 * 1024, "gpu_energy_mj": 5000}


def test_not_supported_is_null_and_not_asked_again(driver):
    b = nvml.NvmlBackend()
    driver.power_error = pynvml.NVMLError_NotSupported
    assert "gpu_power_w" not in b.read_fast(0)
    assert "gpu_ecc_corrected" not in b.read_fast(0)  # ECC unsupported from the start
    assert driver.calls["power"] == 1  # skipped on the second read


def test_transient_error_is_null_for_one_tick(driver):
    b = nvml.NvmlBackend()
    driver.power_error = pynvml.NVMLError_Timeout
    assert "gpu_power_w" not in b.read_fast(0)
    driver.power_error = None
    assert b.read_fast(0)["gpu_power_w"] == 350.0


def test_gpu_lost_becomes_event_and_other_gpus_keep_sampling(driver):
    bus = Bus()
    b = nvml.NvmlBackend()
    s = Sampler(bus, b, None)
    assert [r["gpu"] for r in s.tick().rows] == [0, 1]
    driver.lost.add(1)
    rows = s.tick().rows
    assert [r["gpu"] for r in rows] == [0]
    lost = [e for e in bus.events.latest(10) if e.kind == "gpu_lost"]
    assert len(lost) == 1 and lost[0].gpu == 1 and lost[0].severity == "error"
    assert [r["gpu"] for r in s.tick().rows] == [0]  # and it is not reported again
    assert len([e for e in bus.events.latest(10) if e.kind == "gpu_lost"]) == 1


@pytest.mark.parametrize("err", ["NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded"])
def test_no_driver_means_cpu_only(monkeypatch, err):
    def boom():
        raise getattr(pynvml, err)()
    monkeypatch.setattr(pynvml, "nvmlInit", boom)
    with pytest.raises(nvml.NvmlUnavailable):
        nvml.NvmlBackend()
    from gpuwatch.runtime import Session

    s = Session(sampler="thread")
    assert s.gpu is None and "CPU-only" in s.gpu_note
    assert [e.kind for e in s.bus.events.latest(5)] == ["no_gpu"]
    assert s.sampler.tick().rows[0]["gpu"] is None


def test_xid_watch_not_supported_is_said_once(driver):
    b = nvml.NvmlBackend()
    import threading

    why = b.watch_xid(threading.Event(), lambda g, x: None)
    assert why and "not available" in why
    assert nvml.NvmlBackend().probe(0)["xid_events"].startswith("null")
