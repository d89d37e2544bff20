"""The fast NVML reads, direct: `DirectGpu` calls libnvidia-ml's functions (pynvml's own function
pointers) with output buffers, argument tuples and the field-values array built once per GPU, and
decodes return codes instead of catching exceptions; `field_value` decodes one field-values answer.
Split from `nvml.py` (which owns NVML: the backend, the wrapper path, the field tables) because it is
the one hot loop; nvml.py and this module are the only ones that import pynvml."""

from __future__ import annotations

import ctypes
from typing import Any

import pynvml

MEM_V2 = getattr(pynvml, "nvmlMemory_v2", None)  # the v2 memory call's version word; None: no v2 call

NOT_AVAILABLE_CODES = frozenset(
    getattr(pynvml, n) for n in (
        "NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_NO_PERMISSION", "NVML_ERROR_FUNCTION_NOT_FOUND",
        "NVML_ERROR_NOT_FOUND", "NVML_ERROR_NO_DATA", "NVML_ERROR_INVALID_ARGUMENT",
        "NVML_ERROR_ARGUMENT_VERSION_MISMATCH", "NVML_ERROR_DEPRECATED", "NVML_ERROR_NOT_READY",
    ) if hasattr(pynvml, n)
)


def field_value(v) -> int | float:
    t = v.valueType
    if t == pynvml.NVML_VALUE_TYPE_DOUBLE:
        return v.value.dVal
    if t == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT:
        return v.value.uiVal
    if t == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG:
        return v.value.ulVal
    if t == pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG:
        return v.value.sllVal
    if t == getattr(pynvml, "NVML_VALUE_TYPE_SIGNED_INT", -1):
        return v.value.siVal
    return v.value.ullVal


# -- the fast reads, direct ----------------------------------------------------------------------------
# pynvml's wrappers build a ctypes output object, a converted argument and (on error) an exception per
# call, and its nvmlDeviceGetFieldValues raises and catches a TypeError per field; for a 10 Hz sampler
# that is most of a GPU read's Python. `DirectGpu` calls the same C functions (pynvml's own function
# pointers) with output buffers and argument tuples built once, and handles return codes instead of
# exceptions. The answers and their rules are those of the wrapper path (`NvmlBackend._read`): a field
# "not supported" (or no permission, ...) is null and not asked again, "GPU is lost" is `GpuLost`, any
# other error is null for this tick. Used only where pynvml's functions are pynvml's own (tests replace
# them; then the wrapper path runs).
_K_VALUE, _K_MILLI, _K_UTIL, _K_MEM1, _K_MEM2 = range(5)
_LOST_CODE = getattr(pynvml, "NVML_ERROR_GPU_IS_LOST", 15)
_INSUFFICIENT = getattr(pynvml, "NVML_ERROR_INSUFFICIENT_SIZE", 7)
_ULL_NA = 0xFFFFFFFFFFFFFFFF  # usedGpuMemory "not available"
class DirectGpu:
    """One GPU's fast fields through libnvidia-ml directly. Raises `pynvml.NVMLError` from __init__ when
    the library is not loaded (then the backend keeps the wrapper path)."""

    def __init__(self, h, mem_v2: bool, batch: list | None, skip: set[str]) -> None:
        fp = pynvml._nvmlGetFunctionPointer
        byref = ctypes.byref
        self.h = h
        specs: list[tuple[str, Any, tuple, Any, int]] = []

        def add(col: str, fname: str, buf, kind: int, *args) -> None:
            if col not in skip:
                specs.append((col, fp(fname), (h, *args, byref(buf)), buf, kind))

        add("util", "nvmlDeviceGetUtilizationRates", pynvml.c_nvmlUtilization_t(), _K_UTIL)
        if mem_v2:
            m = pynvml.c_nvmlMemory_v2_t()
            m.version = MEM_V2
            add("mem", "nvmlDeviceGetMemoryInfo_v2", m, _K_MEM2)
        else:
            add("mem", "nvmlDeviceGetMemoryInfo", pynvml.c_nvmlMemory_t(), _K_MEM1)
        add("gpu_temp_c", "nvmlDeviceGetTemperature", ctypes.c_uint(), _K_VALUE, pynvml.NVML_TEMPERATURE_GPU)
        if batch is None:  # else the field-values call reads them
            add("gpu_power_w", "nvmlDeviceGetPowerUsage", ctypes.c_uint(), _K_MILLI)
        add("gpu_sm_clock_mhz", "nvmlDeviceGetClockInfo", ctypes.c_uint(), _K_VALUE, pynvml.NVML_CLOCK_SM)
        add("gpu_mem_clock_mhz", "nvmlDeviceGetClockInfo", ctypes.c_uint(), _K_VALUE, pynvml.NVML_CLOCK_MEM)
        try:
            fp(rname := "nvmlDeviceGetCurrentClocksEventReasons")
        except pynvml.NVMLError:  # a driver older than the name: the same call under its old name
            rname = "nvmlDeviceGetCurrentClocksThrottleReasons"
        add("gpu_clocks_event_reasons", rname, ctypes.c_ulonglong(), _K_VALUE)
        if batch is None:
            for col, kind in (("gpu_ecc_corrected", pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                              ("gpu_ecc_uncorrected", pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)):
                add(col, "nvmlDeviceGetTotalEccErrors", ctypes.c_ulonglong(), _K_VALUE, kind, pynvml.NVML_VOLATILE_ECC)
        self.specs = specs
        self.skip = skip
        # compute processes: one call into an array kept between ticks (grown when NVML says it is short)
        self.procs_fn = fp("nvmlDeviceGetComputeRunningProcesses_v3") if "gpu_procs" not in skip else None
        self._pcount = ctypes.c_uint(0)
        self._pcap = 0
        self._grow_procs(16)
        # the batched field values: one array, ids set once (`batch`: the backend's list, replaced when a
        # field drops out; [] = none left to ask)
        self.batch = batch
        self.fields_fn = fp("nvmlDeviceGetFieldValues") if batch else None
        if batch:
            self._set_fields(batch)

    @property
    def procs_cap(self) -> int:
        """Entries the process array holds now (the C ticker passes it as the call's count)."""
        return self._pcap

    @property
    def procs_buf(self):
        """The process array the processes call writes into (replaced when it grows)."""
        return self._parr

    @property
    def fields_buf(self):
        """The field-values array (None where no batched field is asked)."""
        return getattr(self, "_farr", None)

    def _grow_procs(self, n: int) -> None:
        self._pcap = n
        self._parr = (pynvml.c_nvmlProcessInfo_v3_t * n)()
        self._pargs = (self.h, ctypes.byref(self._pcount), self._parr)

    def _set_fields(self, batch: list) -> None:
        self.batch = batch
        arr = (pynvml.c_nvmlFieldValue_t * len(batch))()
        for v, (_, fid, _) in zip(arr, batch):
            v.fieldId = fid
        self._farr = arr
        self._fargs = (self.h, ctypes.c_int32(len(batch)), ctypes.byref(arr))

    def call(self) -> tuple:
        """Every fast NVML call, in spec order: (return codes, procs return, fields return); the outputs
        stay in the buffers. `decode` turns them into columns (the C ticker makes the same calls)."""
        rets = [spec[1](*spec[2]) for spec in self.specs]
        pret = fret = None
        if self.procs_fn is not None:
            self._pcount.value = self._pcap
            pret = self.procs_fn(*self._pargs)
        if self.fields_fn is not None:
            fret = self.fields_fn(*self._fargs)
        return rets, pret, fret

    def read(self) -> dict[str, Any]:
        """The fast columns. Raises Lost (GPU is lost) and Unbatched (the field-values call went away)."""
        rets, pret, fret = self.call()
        return self.decode(self.specs, rets, pret, self._pcount.value, self._parr, fret,
                           self.batch, getattr(self, "_farr", None))

    def decode(self, specs: list, rets, pret: int | None, pcount: int, parr, fret: int | None,
               batch: list | None, farr) -> dict[str, Any]:
        """The columns from one tick's return codes and output buffers (`specs`, `parr`, `farr`: this
        reader's or views of a C ticker record taken with them). A field answering not-supported is dropped
        from this reader for good."""
        out: dict[str, Any] = {}
        drop = None
        skip = self.skip if specs is not self.specs else ()  # a record taken before a field dropped out
        for spec, ret in zip(specs, rets):
            if spec[0] in skip:
                continue
            if ret:
                if ret == _LOST_CODE:
                    raise Lost
                if ret in NOT_AVAILABLE_CODES:
                    drop = (drop or set()) | {spec[0]}
                continue  # transient: null this tick
            kind, buf = spec[4], spec[3]
            if kind == _K_VALUE:
                out[spec[0]] = buf.value
            elif kind == _K_UTIL:
                out["gpu_util_pct"] = buf.gpu
                out["gpu_mem_util_pct"] = buf.memory
            elif kind == _K_MEM2:
                out["gpu_mem_used_bytes"] = buf.used
                out["gpu_mem_total_bytes"] = buf.total
                out["gpu_mem_reserved_bytes"] = buf.reserved
            elif kind == _K_MILLI:
                out[spec[0]] = buf.value / 1000.0
            else:
                out["gpu_mem_used_bytes"] = buf.used
                out["gpu_mem_total_bytes"] = buf.total
        if drop:
            self.specs = [s for s in self.specs if s[0] not in drop]
            self.skip.update(drop)
        if pret is not None and self.procs_fn is not None:
            self._decode_procs(out, pret, pcount, parr)
        if fret is not None and self.fields_fn is not None:
            self._decode_fields(out, fret, batch, farr)
        return out

    def _decode_procs(self, out: dict[str, Any], ret: int, count: int, arr) -> None:
        if ret == _INSUFFICIENT:  # the array is short: grow it and ask again now
            if len(arr) >= self._pcap:
                self._grow_procs(count * 2 + 5)
            c = self._pcount
            c.value = self._pcap
            ret, arr = self.procs_fn(*self._pargs), self._parr
            count = c.value
        if ret:
            if ret == _LOST_CODE:
                raise Lost
            if ret in NOT_AVAILABLE_CODES:
                self.procs_fn = None
                self.skip.add("gpu_procs")
            return
        out["gpu_procs"] = [{"pid": p.pid, "used_bytes": None if p.usedGpuMemory == _ULL_NA else p.usedGpuMemory}
                            for p in arr[:count]]

    def _decode_fields(self, out: dict[str, Any], ret: int, batch: list, arr) -> None:
        if ret:
            if ret == _LOST_CODE:
                raise Lost
            if ret in NOT_AVAILABLE_CODES:
                raise Unbatched
            return
        drop = None
        asked = {f[0] for f in self.batch} if batch is not self.batch else None  # a record taken before a drop
        for (col, _, scale), v in zip(batch, arr):
            if asked is not None and col not in asked:
                continue
            r = v.nvmlReturn
            if r == 0:
                x = field_value(v)
                out[col] = x * scale if scale else x
            elif r == _LOST_CODE:
                raise Lost
            elif r in NOT_AVAILABLE_CODES:
                drop = (drop or set()) | {col}
        if drop:
            batch = [f for f in self.batch if f[0] not in drop]
            if batch:
                self._set_fields(batch)
            else:
                self.batch, self.fields_fn = batch, None


class Lost(Exception):
    pass


class Unbatched(Exception):
    pass
