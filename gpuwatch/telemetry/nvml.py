"""The one module that talks to NVML (nvidia-ml-py, imported as `pynvml`).

Every read returns a plain value or None: "not supported" / "no permission" become None (and the field
is not asked again for that GPU); a GPU that falls off the bus raises `GpuLost`; a missing library or
driver raises `NvmlUnavailable` from `NvmlBackend()` so the caller can run in CPU-only mode.
Costs measured on an H200 (see docs/BENCHMARKS.md): most reads take 2-8 us; PCIe throughput blocks
~21 ms and total energy ~3 ms, so those two are `read_slow` fields, read off the 100 ms path.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import pynvml

_NOT_AVAILABLE = tuple(
    getattr(pynvml, n) for n in (
        "NVMLError_NotSupported", "NVMLError_NoPermission", "NVMLError_FunctionNotFound",
        "NVMLError_NotFound", "NVMLError_NoData", "NVMLError_InvalidArgument",
        "NVMLError_ArgumentVersionMismatch", "NVMLError_Deprecated", "NVMLError_NotReady",
    ) if hasattr(pynvml, n)
)
_LOST = (pynvml.NVMLError_GpuIsLost,)


class NvmlUnavailable(Exception):
    """No NVML library or no NVIDIA driver: gpuwatch runs CPU-only."""


class GpuLost(Exception):
    """The GPU fell off the bus (NVML_ERROR_GPU_IS_LOST)."""


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    uuid: str | None
    pci_bus_id: str | None
    mem_total_bytes: int | None
    power_limit_w: float | None
    temp_slowdown_c: int | None


def _s(v: Any) -> Any:
    return v.decode() if isinstance(v, bytes) else v


# Fast fields: (column, reader(handle) -> value). Each is one NVML call of a few microseconds.
def _mem(h):
    m = pynvml.nvmlDeviceGetMemoryInfo(h)
    return m.used, m.total


def _util(h):
    u = pynvml.nvmlDeviceGetUtilizationRates(h)
    return u.gpu, u.memory


def _reasons(h):
    fn = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
    return (fn or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons)(h)


def _procs(h):
    out = []
    for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
        used = p.usedGpuMemory
        out.append({"pid": p.pid, "used_bytes": used if isinstance(used, int) and used >= 0 else None})
    return out


FAST: dict[str, Callable[[Any], Any]] = {
    "util": _util,  # nvidia-smi utilization.gpu / utilization.memory (%, averaged over 1/6-1 s)
    "mem": _mem,  # nvidia-smi memory.used / memory.total (bytes)
    "gpu_temp_c": lambda h: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
    "gpu_power_w": lambda h: pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0,  # power.draw (mW -> W)
    "gpu_sm_clock_mhz": lambda h: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
    "gpu_mem_clock_mhz": lambda h: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM),
    "gpu_clocks_event_reasons": _reasons,  # clocks_event_reasons.active (bitmask)
    "gpu_ecc_corrected": lambda h: pynvml.nvmlDeviceGetTotalEccErrors(
        h, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC),
    "gpu_ecc_uncorrected": lambda h: pynvml.nvmlDeviceGetTotalEccErrors(
        h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC),
    "gpu_procs": _procs,  # compute-apps (pid, used memory)
}

# Slow fields, measured on an H200 (benchmarks/bench_nvml.py): nvmlDeviceGetPcieThroughput blocks
# ~21 ms (~0.9 ms of CPU) per direction; the total-energy counter costs ~4 ms of CPU per read, by the
# legacy call or as a field value. So PCIe is read from the cumulative byte counters where the driver
# has them (Hopper and newer: one nvmlDeviceGetFieldValues call, rate = difference over time), else by
# the legacy calls; and energy only every `ENERGY_EVERY` slow ticks (10 s).
LEGACY_PCIE: dict[str, Callable[[Any], Any]] = {
    "gpu_pcie_tx_bytes_per_s": lambda h: pynvml.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_TX_BYTES) * 1024,
    "gpu_pcie_rx_bytes_per_s": lambda h: pynvml.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_RX_BYTES) * 1024,
}
ENERGY: dict[str, Callable[[Any], Any]] = {
    "gpu_energy_mj": lambda h: pynvml.nvmlDeviceGetTotalEnergyConsumption(h),  # mJ since driver load
}
LEGACY_SLOW = {**LEGACY_PCIE, **ENERGY}
ENERGY_EVERY = 10
PCIE_COUNTERS = (getattr(pynvml, "NVML_FI_DEV_PCIE_COUNT_TX_BYTES", None),
                 getattr(pynvml, "NVML_FI_DEV_PCIE_COUNT_RX_BYTES", None))


def read_pcie_counters(h) -> tuple[int, int] | None:
    """The cumulative PCIe TX and RX byte counters in one call, or None if unsupported."""
    if None in PCIE_COUNTERS:
        return None
    vals = pynvml.nvmlDeviceGetFieldValues(h, list(PCIE_COUNTERS))
    if any(v.nvmlReturn != pynvml.NVML_SUCCESS for v in vals):
        return None
    return int(vals[0].value.ullVal), int(vals[1].value.ullVal)


class NvmlBackend:
    """All GPUs NVML sees. Thread-safe for reads (NVML is); one instance per process."""

    kind = "nvml"
    label = "live (NVML)"

    def __init__(self) -> None:
        try:
            pynvml.nvmlInit()
        except (pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError_DriverNotLoaded,
                pynvml.NVMLError_LibRmVersionMismatch, pynvml.NVMLError_NoPermission) as e:
            raise NvmlUnavailable(f"NVML unavailable ({e}); running CPU-only") from None
        except pynvml.NVMLError as e:
            raise NvmlUnavailable(f"NVML failed to initialise ({e}); running CPU-only") from None
        self.driver_version = self._try(lambda: _s(pynvml.nvmlSystemGetDriverVersion()))
        self.nvml_version = self._try(lambda: _s(pynvml.nvmlSystemGetNVMLVersion()))
        count = pynvml.nvmlDeviceGetCount()
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        self._unsupported: list[set[str]] = [set() for _ in self._handles]
        self.lost: set[int] = set()
        self.gpus = [self._info(i) for i in range(count)]
        self._last_counters: list[tuple[float, tuple[int, int]] | None] = [None] * count
        self.counters = [self._try(lambda h=h: read_pcie_counters(h)) is not None for h in self._handles]
        self._slow_n = [0] * count

    @staticmethod
    def _try(fn):
        try:
            return fn()
        except pynvml.NVMLError:
            return None

    def _info(self, i: int) -> GpuInfo:
        h = self._handles[i]
        t = self._try
        lim = t(lambda: pynvml.nvmlDeviceGetEnforcedPowerLimit(h))
        return GpuInfo(
            index=i, name=t(lambda: _s(pynvml.nvmlDeviceGetName(h))) or f"GPU {i}",
            uuid=t(lambda: _s(pynvml.nvmlDeviceGetUUID(h))),
            pci_bus_id=t(lambda: _s(pynvml.nvmlDeviceGetPciInfo(h).busId)),
            mem_total_bytes=t(lambda: pynvml.nvmlDeviceGetMemoryInfo(h).total),
            power_limit_w=lim / 1000.0 if lim is not None else None,
            temp_slowdown_c=t(lambda: pynvml.nvmlDeviceGetTemperatureThreshold(
                h, pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)),
        )

    def _read(self, i: int, fields: dict[str, Callable]) -> dict[str, Any]:
        if i in self.lost:
            raise GpuLost(f"GPU {i} was lost")
        h, skip, out = self._handles[i], self._unsupported[i], {}
        for name, fn in fields.items():
            if name in skip:
                continue
            try:
                out[name] = fn(h)
            except _NOT_AVAILABLE:
                skip.add(name)
            except _LOST:
                self.lost.add(i)
                raise GpuLost(f"GPU {i} fell off the bus (NVML: GPU is lost)") from None
            except pynvml.NVMLError:
                pass  # transient (e.g. timeout, unknown): null this tick, ask again next tick
        return out

    def read_fast(self, i: int) -> dict[str, Any]:
        """The 100 ms fields for GPU i, as samples-schema columns; absent keys are null."""
        raw = self._read(i, FAST)
        util = raw.pop("util", None)
        if util is not None:
            raw["gpu_util_pct"], raw["gpu_mem_util_pct"] = util
        mem = raw.pop("mem", None)
        if mem is not None:
            raw["gpu_mem_used_bytes"], raw["gpu_mem_total_bytes"] = mem
        info = self.gpus[i]
        raw["gpu_power_limit_w"] = info.power_limit_w
        raw["gpu_temp_slowdown_c"] = info.temp_slowdown_c
        return raw

    def read_slow(self, i: int) -> dict[str, Any]:
        """PCIe TX/RX rates (counters where supported, else the blocking legacy calls) and, every
        ENERGY_EVERY calls, the energy counter. Absent keys keep their last value in the sampler."""
        n, self._slow_n[i] = self._slow_n[i], self._slow_n[i] + 1
        out = self._read(i, ENERGY) if n % ENERGY_EVERY == 0 else {}
        if not self.counters[i]:
            return {**out, **self._read(i, LEGACY_PCIE)}
        c, now = self._read(i, {"c": read_pcie_counters}).get("c"), time.monotonic()
        last, self._last_counters[i] = self._last_counters[i], (now, c) if c else None
        if c and last is not None and now > last[0]:
            dt = now - last[0]
            out["gpu_pcie_tx_bytes_per_s"] = max(0, c[0] - last[1][0]) / dt
            out["gpu_pcie_rx_bytes_per_s"] = max(0, c[1] - last[1][1]) / dt
        return out

    def probe(self, i: int) -> dict[str, str]:
        """For `gpuwatch info`: what each field reads on this GPU ('ok: value' / 'not supported')."""
        out = {}
        for name, fn in {**FAST, **LEGACY_SLOW, "pcie counters": read_pcie_counters}.items():
            try:
                out[name] = f"ok: {fn(self._handles[i])!r}"[:60]
            except _NOT_AVAILABLE as e:
                out[name] = f"null ({e})"
            except pynvml.NVMLError as e:
                out[name] = f"error ({e})"
        try:
            es = pynvml.nvmlEventSetCreate()
            try:
                pynvml.nvmlDeviceRegisterEvents(self._handles[i], pynvml.nvmlEventTypeXidCriticalError, es)
            finally:
                self._try(lambda: pynvml.nvmlEventSetFree(es))
            out["xid_events"] = "ok (NVML event set)"
        except pynvml.NVMLError as e:
            out["xid_events"] = f"null ({e})"
        return out

    def watch_xid(self, stop: threading.Event, on_xid: Callable[[int, int], None]) -> str | None:
        """Block until `stop`, calling on_xid(gpu, xid) for each XID error. Returns why it could not
        watch (None after a normal stop)."""
        try:
            es = pynvml.nvmlEventSetCreate()
            for h in self._handles:
                pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, es)
        except pynvml.NVMLError as e:
            return f"XID events not available: {e}"
        index = {self._try(lambda h=h: _s(pynvml.nvmlDeviceGetUUID(h))): i for i, h in enumerate(self._handles)}
        while not stop.is_set():
            try:
                data = pynvml.nvmlEventSetWait_v2(es, 500)
            except pynvml.NVMLError_Timeout:
                continue
            except pynvml.NVMLError as e:
                return f"XID watch stopped: {e}"
            uuid = self._try(lambda: _s(pynvml.nvmlDeviceGetUUID(data.device)))
            on_xid(index.get(uuid, -1), int(data.eventData))
        self._try(lambda: pynvml.nvmlEventSetFree(es))
        return None

    def close(self) -> None:
        self._try(pynvml.nvmlShutdown)
