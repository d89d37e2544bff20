"""The one module that talks to NVML (nvidia-ml-py, imported as `pynvml`).

Every read returns a plain value or None: "not supported" / "no permission" become None (and the field
is not asked again for that GPU); a GPU that falls off the bus raises `GpuLost`; a missing library or
driver raises `NvmlUnavailable` from `NvmlBackend()` so the caller can run in CPU-only mode.
Costs measured on an H200 (see docs/BENCHMARKS.md): most reads take 2-8 us; PCIe throughput blocks
~21 ms and total energy ~3 ms, so those two are `read_slow` fields, read off the 100 ms path.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import pynvml

from gpuwatch.errors import UsageError
from gpuwatch.telemetry.nvml_direct import MEM_V2, NOT_AVAILABLE_CODES, DirectGpu, Lost, Unbatched, field_value

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
def read_memory_v1(h):
    """v1: `used` counts driver-reserved memory (615 MiB on an idle H200 where nvidia-smi says 0)."""
    m = pynvml.nvmlDeviceGetMemoryInfo(h)
    return m.used, m.total, None


def read_memory_v2(h):
    """v2 (driver >= 510): used / total / reserved as nvidia-smi's memory.used / .total / .reserved."""
    m = pynvml.nvmlDeviceGetMemoryInfo(h, version=MEM_V2)
    return m.used, m.total, m.reserved


def _util(h):
    u = pynvml.nvmlDeviceGetUtilizationRates(h)
    return u.gpu, u.memory


def _reasons(h):
    fn = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
    return (fn or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons)(h)


def read_compute_procs(h):
    """The compute processes on the GPU: [{"pid", "used_bytes" (None where NVML does not say)}]."""
    out = []
    for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
        used = p.usedGpuMemory
        out.append({"pid": p.pid, "used_bytes": used if isinstance(used, int) and used >= 0 else None})
    return out


FAST: dict[str, Callable[[Any], Any]] = {
    "util": _util,  # nvidia-smi utilization.gpu / utilization.memory (%, averaged over 1/6-1 s)
    "mem": read_memory_v1,  # nvidia-smi memory.used / memory.total (bytes); read_memory_v2 where the driver has it
    "gpu_temp_c": lambda h: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
    "gpu_power_w": lambda h: pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0,  # power.draw (mW -> W)
    "gpu_sm_clock_mhz": lambda h: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
    "gpu_mem_clock_mhz": lambda h: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM),
    "gpu_clocks_event_reasons": _reasons,  # clocks_event_reasons.active (bitmask)
    "gpu_ecc_corrected": lambda h: pynvml.nvmlDeviceGetTotalEccErrors(
        h, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC),
    "gpu_ecc_uncorrected": lambda h: pynvml.nvmlDeviceGetTotalEccErrors(
        h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC),
    "gpu_procs": read_compute_procs,  # compute-apps (pid, used memory)
}

# Slow fields, measured on an H200 (benchmarks/bench_nvml.py): nvmlDeviceGetPcieThroughput blocks
# ~21 ms (~0.9 ms of CPU) per direction; the total-energy counter costs ~4 ms of CPU per read, by the
# legacy call or as a field value. So PCIe is read from the cumulative byte counters where the driver
# has them (Hopper and newer: one nvmlDeviceGetFieldValues call, rate = difference over time), else by
# the legacy calls; and energy only every `ENERGY_EVERY` slow ticks (30 s).
LEGACY_PCIE: dict[str, Callable[[Any], Any]] = {
    "gpu_pcie_tx_bytes_per_s": lambda h: pynvml.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_TX_BYTES) * 1024,
    "gpu_pcie_rx_bytes_per_s": lambda h: pynvml.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_RX_BYTES) * 1024,
}
ENERGY: dict[str, Callable[[Any], Any]] = {
    "gpu_energy_mj": lambda h: pynvml.nvmlDeviceGetTotalEnergyConsumption(h),  # mJ since driver load
}
LEGACY_SLOW = {**LEGACY_PCIE, **ENERGY}
ENERGY_EVERY = 30  # slow ticks: ~4 ms of CPU per read, so every 30 s
# The PCIe byte counters are read every PCIE_EVERY slow ticks (GPUWATCH_PCIE_EVERY=N overrides). On an H200
# that one field-values read costs ~0.8-1 ms of CPU in the driver (every other field of a tick costs 2-60
# us): at 1 Hz it alone was ~0.08 % of a core, the largest single item of the sampler's cost (profile,
# docs/BENCHMARKS.md "Issue 10"). The counters are cumulative, so no byte is missed: the rate is the exact
# average over the last 2 s, carried on the 20 rows until the next read (N = 1: 1 s, 10 rows). The legacy
# (blocking, pre-Hopper) PCIe calls are not affected.
PCIE_EVERY = 2
PCIE_EVERY_ENV = "GPUWATCH_PCIE_EVERY"


def _pcie_every() -> int:
    v = os.environ.get(PCIE_EVERY_ENV, "").strip()
    return int(v) if v.isdigit() and int(v) > 0 else PCIE_EVERY


PROC_UTIL = "proc_util"  # the per-process utilization read (read_proc_util), as a name in the unsupported set
_NOT_FOUND_CODE = getattr(pynvml, "NVML_ERROR_NOT_FOUND", 6)
XID_WAIT_MS = 1000  # the XID thread wakes this often to see a stop (a wake-up a second; an XID comes at once)
PCIE_COUNTERS = (getattr(pynvml, "NVML_FI_DEV_PCIE_COUNT_TX_BYTES", None),
                 getattr(pynvml, "NVML_FI_DEV_PCIE_COUNT_RX_BYTES", None))


# Fast fields read together in ONE nvmlDeviceGetFieldValues call (one driver round trip instead of
# three): (column, field id, scale). Power: NVML_FI_DEV_POWER_AVERAGE is the 1 s average that
# nvmlDeviceGetPowerUsage returns on Ampere-and-newer boards (nvidia-smi power.draw); ECC: the volatile
# totals nvmlDeviceGetTotalEccErrors(..., VOLATILE) returns. A field the driver answers "not supported"
# for is null and not asked again; if the call itself fails, the legacy calls in FAST are used instead.
def _fi(name: str) -> int | None:
    return getattr(pynvml, name, None)


FIELD_BATCH: tuple[tuple[str, int, float | None], ...] = tuple(
    (col, fid, scale) for col, fid, scale in (
        ("gpu_power_w", _fi("NVML_FI_DEV_POWER_AVERAGE"), 1e-3),  # mW -> W
        ("gpu_ecc_corrected", _fi("NVML_FI_DEV_ECC_SBE_VOL_TOTAL"), None),
        ("gpu_ecc_uncorrected", _fi("NVML_FI_DEV_ECC_DBE_VOL_TOTAL"), None),
    ) if fid is not None
)
_BATCHED = {col for col, _, _ in FIELD_BATCH}


def read_pcie_counters(h) -> tuple[int, int] | None:
    """The cumulative PCIe TX and RX byte counters in one call, or None if unsupported."""
    if None in PCIE_COUNTERS:
        return None
    vals = pynvml.nvmlDeviceGetFieldValues(h, list(PCIE_COUNTERS))
    if any(v.nvmlReturn != pynvml.NVML_SUCCESS for v in vals):
        return None
    return int(vals[0].value.ullVal), int(vals[1].value.ullVal)


_WRAPPERS = ("nvmlDeviceGetUtilizationRates", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetTemperature",
             "nvmlDeviceGetPowerUsage", "nvmlDeviceGetClockInfo", "nvmlDeviceGetTotalEccErrors",
             "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetFieldValues")


def _pynvml_is_itself() -> bool:
    """False where something (a test's fake driver) replaced pynvml's functions: then use them."""
    return all(getattr(getattr(pynvml, n, None), "__module__", None) == pynvml.__name__ for n in _WRAPPERS)


def chosen_gpus(present: Sequence[int], only: Sequence[int] | None) -> list[int]:
    """The GPUs a backend samples: `only` (GPU indices, in the order given, duplicates once) or, with None,
    every one `present`. An index not present is a UsageError naming what is (`--gpus` of watch/record)."""
    if only is None:
        return list(present)
    missing = [i for i in only if i not in present]
    if missing:
        have = ", ".join(map(str, present)) or "none"
        raise UsageError(f"no GPU {', '.join(map(str, missing))} here (GPU indices present: {have})")
    return list(dict.fromkeys(only))


class NvmlBackend:
    """The GPUs NVML sees (all, or `only` those NVML indices: `chosen_gpus`). Each GPU keeps its NVML index
    as its `GpuInfo.index` and as the `i` of every read. Thread-safe for reads (NVML is); one instance per
    process."""

    kind = "nvml"
    label = "live (NVML)"

    def __init__(self, only: Sequence[int] | None = None) -> None:
        try:
            pynvml.nvmlInit()
        except (pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError_DriverNotLoaded,
                pynvml.NVMLError_LibRmVersionMismatch, pynvml.NVMLError_NoPermission) as e:
            raise NvmlUnavailable(f"NVML unavailable ({e}); running CPU-only") from None
        except pynvml.NVMLError as e:
            raise NvmlUnavailable(f"NVML failed to initialise ({e}); running CPU-only") from None
        self.driver_version = self.or_none(lambda: _s(pynvml.nvmlSystemGetDriverVersion()))
        self.nvml_version = self.or_none(lambda: _s(pynvml.nvmlSystemGetNVMLVersion()))
        try:
            sampled = chosen_gpus(range(pynvml.nvmlDeviceGetCount()), only)
        except UsageError:
            self.or_none(pynvml.nvmlShutdown)
            raise
        # per GPU, keyed by its NVML index
        self._handles = {i: pynvml.nvmlDeviceGetHandleByIndex(i) for i in sampled}
        self._unsupported: dict[int, set[str]] = {i: set() for i in sampled}
        self.lost: set[int] = set()
        self._infos = {i: self._info(i) for i in sampled}
        self.gpus = list(self._infos.values())
        self._last_counters: dict[int, tuple[float, tuple[int, int]] | None] = dict.fromkeys(sampled)
        self.counters = {i: self.or_none(lambda h=h: read_pcie_counters(h)) is not None for i, h in self._handles.items()}
        # the slow read blocks (~21 ms a GPU) only where PCIe must be read by the legacy calls
        self.slow_blocks = not all(self.counters.values())
        self._slow_n = dict.fromkeys(sampled, 0)
        self.pcie_every = _pcie_every()
        self._util_seen = dict.fromkeys(sampled, 0)  # the newest per-process utilization sample read (NVML's us)
        # v2 memory where the driver has it (used without driver-reserved memory, like nvidia-smi)
        self._mem_fn = {i: read_memory_v2 if MEM_V2 is not None and self._works(lambda h=h: read_memory_v2(h))
                        else read_memory_v1
                        for i, h in self._handles.items()}
        apis = {"v2" if f is read_memory_v2 else "v1" for f in self._mem_fn.values()}
        self.memory_api = apis.pop() if len(apis) == 1 else "mixed"
        # the batched field values: per GPU, the (column, id, scale) still asked (None: call failed -> legacy)
        self._batch: dict[int, list[tuple[str, int, float | None]] | None] = {
            i: self._probe_batch(h) for i, h in self._handles.items()}
        self._fast = {i: self._fast_readers(i) for i in sampled}
        self._direct: dict[int, DirectGpu | None] = {i: self._make_direct(i) for i in sampled}

    def handle(self, i: int) -> Any:
        """GPU i's NVML device handle, for NVML calls of the caller's own."""
        return self._handles[i]

    def batched_fields(self, i: int) -> list[str] | None:
        """The columns GPU i reads in its one batched field-values call (None: that call failed, legacy calls)."""
        batch = self._batch[i]
        return None if batch is None else [c for c, _, _ in batch]

    def direct(self, i: int) -> "DirectGpu | None":
        """GPU i's direct reader (libnvidia-ml called without pynvml's wrappers), or None where it runs
        on the wrappers: the C ticker builds its call list from it."""
        return self._direct[i]

    def _make_direct(self, i: int) -> "DirectGpu | None":
        """The direct reader of GPU i, or None (library not loaded, pynvml's functions replaced)."""
        if not _pynvml_is_itself() or os.environ.get("GPUWATCH_NVML_WRAPPERS"):
            return None
        try:
            return DirectGpu(self._handles[i], self._mem_fn[i] is read_memory_v2, self._batch[i], self._unsupported[i])
        except (pynvml.NVMLError, AttributeError, TypeError):
            return None

    @staticmethod
    def _works(fn) -> bool:
        try:
            fn()
            return True
        except (pynvml.NVMLError, TypeError):  # TypeError: a pynvml without the `version` argument
            return False

    def _probe_batch(self, h) -> list[tuple[str, int, float | None]] | None:
        """Which FIELD_BATCH fields this GPU answers; None when the call itself fails (then: legacy calls)."""
        if not FIELD_BATCH:
            return None
        try:
            vals = pynvml.nvmlDeviceGetFieldValues(h, [fid for _, fid, _ in FIELD_BATCH])
        except pynvml.NVMLError:
            return None
        return [f for f, v in zip(FIELD_BATCH, vals) if v.nvmlReturn == pynvml.NVML_SUCCESS]

    def _fast_readers(self, i: int) -> dict[str, Callable[[Any], Any]]:
        """FAST for GPU i: its memory call, and without the fields the batched call reads."""
        fields = dict(FAST)
        fields["mem"] = self._mem_fn[i]
        if self._batch[i] is not None:
            for col in _BATCHED:
                fields.pop(col, None)
        return fields

    @staticmethod
    def or_none(fn):
        """fn(), or None where NVML raises (a read this GPU or driver does not answer)."""
        try:
            return fn()
        except pynvml.NVMLError:
            return None

    def _info(self, i: int) -> GpuInfo:
        h = self._handles[i]
        t = self.or_none
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
        d = self._direct[i]
        if d is not None:
            return self.direct_row(i, d.read)
        return self._wrapper_row(i)

    def direct_row(self, i: int, read: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """GPU i's row from `read` (its direct reader's read, or a decode of a C ticker record)."""
        d = self._direct[i]
        if i in self.lost:
            raise GpuLost(f"GPU {i} was lost")
        try:
            raw = read()
        except Lost:
            self.lost.add(i)
            raise GpuLost(f"GPU {i} fell off the bus (NVML: GPU is lost)") from None
        except Unbatched:  # the field-values call went away: the single calls from now on
            self._batch[i] = None
            self._fast[i] = dict(FAST, mem=self._mem_fn[i])
            self._direct[i] = self._make_direct(i)
            return self.read_fast(i)
        if d.batch is not self._batch[i]:  # a batched field dropped out: `probe` reads the backend's list
            self._batch[i] = d.batch
        info = self._infos[i]
        raw["gpu_power_limit_w"] = info.power_limit_w
        raw["gpu_temp_slowdown_c"] = info.temp_slowdown_c
        return raw

    def _wrapper_row(self, i: int) -> dict[str, Any]:
        raw = self._read(i, self._fast[i])
        util = raw.pop("util", None)
        if util is not None:
            raw["gpu_util_pct"], raw["gpu_mem_util_pct"] = util
        mem = raw.pop("mem", None)
        if mem is not None:
            raw["gpu_mem_used_bytes"], raw["gpu_mem_total_bytes"], reserved = mem
            if reserved is not None:
                raw["gpu_mem_reserved_bytes"] = reserved
        batch = self._batch[i]
        if batch:
            self._read_batch(i, batch, raw)
        info = self._infos[i]
        raw["gpu_power_limit_w"] = info.power_limit_w
        raw["gpu_temp_slowdown_c"] = info.temp_slowdown_c
        return raw

    def _read_batch(self, i: int, batch: list, out: dict[str, Any]) -> None:
        """The batched fields in one nvmlDeviceGetFieldValues call. A field answering "not supported" (or
        no permission...) is dropped for good; any other per-field error is null for this tick."""
        try:
            vals = pynvml.nvmlDeviceGetFieldValues(self._handles[i], [fid for _, fid, _ in batch])
        except _NOT_AVAILABLE:
            self._batch[i] = None  # the call itself went away: back to the legacy calls
            self._fast[i] = dict(FAST, mem=self._mem_fn[i])
            return
        except _LOST:
            self.lost.add(i)
            raise GpuLost(f"GPU {i} fell off the bus (NVML: GPU is lost)") from None
        except pynvml.NVMLError:
            return
        drop = None
        for (col, _, scale), v in zip(batch, vals):
            ret = v.nvmlReturn
            if ret == 0:  # NVML_SUCCESS
                x = field_value(v)
                out[col] = x * scale if scale else x
            elif ret == pynvml.NVML_ERROR_GPU_IS_LOST:
                self.lost.add(i)
                raise GpuLost(f"GPU {i} fell off the bus (NVML: GPU is lost)")
            elif ret in NOT_AVAILABLE_CODES:
                drop = (drop or set()) | {col}
        if drop:
            self._batch[i] = [f for f in batch if f[0] not in drop]

    def read_slow(self, i: int) -> dict[str, Any]:
        """PCIe TX/RX rates (counters where supported, else the blocking legacy calls) and, every
        ENERGY_EVERY calls, the energy counter. Absent keys keep their last value in the sampler."""
        n, self._slow_n[i] = self._slow_n[i], self._slow_n[i] + 1
        out = self._read(i, ENERGY) if n % ENERGY_EVERY == 0 else {}
        if not self.counters[i]:
            return {**out, **self._read(i, LEGACY_PCIE)}
        if n % self.pcie_every:  # not this slow tick: rows keep the last rate (over pcie_every seconds)
            return out
        c, now = self._read(i, {"c": read_pcie_counters}).get("c"), time.monotonic()
        last, self._last_counters[i] = self._last_counters[i], (now, c) if c else None
        if c and last is not None and now > last[0]:
            dt = now - last[0]
            out["gpu_pcie_tx_bytes_per_s"] = max(0, c[0] - last[1][0]) / dt
            out["gpu_pcie_rx_bytes_per_s"] = max(0, c[1] - last[1][1]) / dt
        return out

    def read_proc_util(self, i: int) -> dict[int, tuple[int, int]] | None:
        """Per-process SM and memory utilization (%) on GPU i since the previous call: {pid: (sm, mem)}, the
        mean of NVML's samples of each PID (nvmlDeviceGetProcessUtilization). Read once a second (the slow
        tick), never per 100 ms tick. {} where NVML has no sample (NVML_ERROR_NOT_FOUND: no process ran a
        kernel since then); None where the call is not supported (remembered: not asked again), for a
        transient error, and for the first call of an unsupported GPU. GpuLost as the other reads."""
        if i in self.lost:
            raise GpuLost(f"GPU {i} was lost")
        skip = self._unsupported[i]
        if PROC_UTIL in skip:
            return None
        seen = self._util_seen
        try:
            samples = pynvml.nvmlDeviceGetProcessUtilization(self._handles[i], seen[i])
        except _LOST:
            self.lost.add(i)
            raise GpuLost(f"GPU {i} fell off the bus (NVML: GPU is lost)") from None
        except pynvml.NVMLError as e:
            code = getattr(e, "value", None)
            # NOT_FOUND: no sample since `seen`; 0 (success with no sample: pynvml raises NVMLError(0))
            if code in (_NOT_FOUND_CODE, getattr(pynvml, "NVML_SUCCESS", 0)):
                return {}
            if code in NOT_AVAILABLE_CODES:
                skip.add(PROC_UTIL)
            return None
        except (AttributeError, TypeError):  # a pynvml without the call
            skip.add(PROC_UTIL)
            return None
        newest = max((s.timeStamp for s in samples), default=0)
        # the first call (seen 0) answers NVML's whole buffer: only its last second counts
        since = max(seen[i], newest - 1_000_000)
        seen[i] = max(seen[i], newest)
        acc: dict[int, list[int]] = {}
        for s in samples:
            if s.timeStamp > since:
                a = acc.setdefault(s.pid, [0, 0, 0])
                a[0] += s.smUtil
                a[1] += s.memUtil
                a[2] += 1
        return {pid: (min(100, round(a[0] / a[2])), min(100, round(a[1] / a[2]))) for pid, a in acc.items()}

    def probe(self, i: int) -> dict[str, str]:
        """For `gpuwatch info`: what each field reads on this GPU ('ok: value' / 'not supported')."""
        out = {"memory api": f"{'v2' if self._mem_fn[i] is read_memory_v2 else 'v1'} (v2: used excludes driver-reserved "
                             "memory, like nvidia-smi; v1: reserved counted as used)"}
        batch = self._batch[i]
        out["field values (one call)"] = ("not available: legacy calls" if batch is None
                                          else "ok: " + ", ".join(c for c, _, _ in batch) if batch else "none supported")
        for name, fn in {**FAST, "mem": self._mem_fn[i], **LEGACY_SLOW, "pcie counters": read_pcie_counters}.items():
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
                self.or_none(lambda: pynvml.nvmlEventSetFree(es))
            out["xid_events"] = "ok (NVML event set)"
        except pynvml.NVMLError as e:
            out["xid_events"] = f"null ({e})"
        return out

    def watch_xid(self, stop: threading.Event, on_xid: Callable[[int, int], None]) -> str | None:
        """Block until `stop`, calling on_xid(gpu, xid) for each XID error. Returns why it could not
        watch (None after a normal stop)."""
        try:
            es = pynvml.nvmlEventSetCreate()
            for h in self._handles.values():
                pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, es)
        except pynvml.NVMLError as e:
            return f"XID events not available: {e}"
        index = {self.or_none(lambda h=h: _s(pynvml.nvmlDeviceGetUUID(h))): i for i, h in self._handles.items()}
        while not stop.is_set():
            try:
                data = pynvml.nvmlEventSetWait_v2(es, XID_WAIT_MS)
            except pynvml.NVMLError_Timeout:
                continue
            except pynvml.NVMLError as e:
                return f"XID watch stopped: {e}"
            uuid = self.or_none(lambda: _s(pynvml.nvmlDeviceGetUUID(data.device)))
            on_xid(index.get(uuid, -1), int(data.eventData))
        self.or_none(lambda: pynvml.nvmlEventSetFree(es))
        return None

    def close(self) -> None:
        self.or_none(pynvml.nvmlShutdown)
