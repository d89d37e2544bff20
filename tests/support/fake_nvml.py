"""The one fake NVML of the tests and the benchmarks (no GPU needed), at the two levels gpuwatch talks to
the driver:

- `FakeDriver` replaces pynvml's Python functions (values, and errors as the real `NVMLError_*`
  classes); `FakeLib` serves the same answers through libnvidia-ml's C function pointers, which
  gpuwatch's direct reader calls. The NVML boundary tests run both paths; `install_fake_nvml` is the
  same driver for a profiled sampler child on a machine without a C compiler.
- `FAKE_NVML_C` / `build_fake_nvml` compile a stand-in libnvidia-ml.so.1 whose functions answer at once:
  a `gpuwatch record` subprocess (and its C loop) loads it through LD_LIBRARY_PATH, so pynvml and
  gpuwatch's own NVML code run unchanged, and what a profile shows is their own cost.

Tests import it as `support.fake_nvml` (tests/ is on their path); benchmarks put tests/ on sys.path.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import types
from pathlib import Path

import pynvml

from gpuwatch.telemetry import nvml

# GPUWATCH_SAMPLER_PROFILE_FAKE_NVML=N: a profiled sampler child with no C compiler around installs
# FakeDriver for N GPUs (support/sampler_profile.py reads it)
PYTHON_FAKE_ENV = "GPUWATCH_SAMPLER_PROFILE_FAKE_NVML"


class FakeDriver:
    """Stands in for libnvml behind pynvml's functions: `gpus` GPUs (two for the boundary tests); errors
    are the real classes. `monkeypatch`: anything with monkeypatch's `setattr(obj, name, value)` (pytest's
    undoes it after the test; `install_fake_nvml` keeps it for the life of a profiled process)."""

    def __init__(self, monkeypatch, gpus: int = 2, name: bytes = b"NVIDIA H200"):
        self.calls = {"power": 0, "fields": 0, "mem_v1": 0, "mem_v2": 0, "proc_util": 0}
        self.lost = set()
        self.power_error = None
        self.mem_v2 = True  # the driver has nvmlDeviceGetMemoryInfo_v2
        # nvmlDeviceGetFieldValues: None = the call is not supported at all; else per field id, the value
        # or an NVML return code (int) for that field
        self.fields = None
        self.every_field = False  # True: a field not in `fields` answers 1000 + its id (a profile's driver)
        # nvmlDeviceGetProcessUtilization: per GPU handle, the (pid, smUtil, memUtil) samples each call makes
        # (two per PID, 0.5 s apart; none: NVML_ERROR_NOT_FOUND, as the driver answers), or an
        # NVMLError_* class that every call raises
        self.proc_util: dict[int, list[tuple[int, int, int]]] | type = {0: [(42, 55, 20)], 1: [(42, 35, 10)]}
        self.util_us = 1_764_600_000_000_000  # NVML's sample clock (us), one second further at each call
        mp = monkeypatch.setattr
        mp(pynvml, "nvmlInit", lambda: None)
        mp(pynvml, "nvmlShutdown", lambda: None)
        mp(pynvml, "nvmlSystemGetDriverVersion", lambda: "580.1")
        mp(pynvml, "nvmlSystemGetNVMLVersion", lambda: "13.580")
        mp(pynvml, "nvmlDeviceGetCount", lambda: gpus)
        mp(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: i)
        mp(pynvml, "nvmlDeviceGetName", lambda h: name)
        mp(pynvml, "nvmlDeviceGetUUID", lambda h: f"GPU-{h}")
        mp(pynvml, "nvmlDeviceGetPciInfo", lambda h: types.SimpleNamespace(busId=f"0000:0{h}:00.0"))
        mp(pynvml, "nvmlDeviceGetEnforcedPowerLimit", lambda h: 700_000)
        mp(pynvml, "nvmlDeviceGetTemperatureThreshold", lambda h, t: 89)
        mp(pynvml, "nvmlDeviceGetMemoryInfo", self._memory)
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
        mp(pynvml, "nvmlDeviceGetFieldValues", self._field_values)
        mp(pynvml, "nvmlDeviceGetProcessUtilization", self._process_utilization)
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

    def _memory(self, h, version=None):
        if h in self.lost:
            raise pynvml.NVMLError_GpuIsLost()
        if version is None:  # v1: driver-reserved memory counted as used
            self.calls["mem_v1"] += 1
            return types.SimpleNamespace(used=10 * 2**30 + 615 * 2**20, total=141 * 2**30)
        self.calls["mem_v2"] += 1
        if not self.mem_v2:  # what pynvml raises when libnvidia-ml lacks the _v2 symbol
            raise pynvml.NVMLError_FunctionNotFound()
        assert version == pynvml.nvmlMemory_v2
        return types.SimpleNamespace(used=10 * 2**30, total=141 * 2**30, reserved=615 * 2**20)

    def _field_values(self, h, ids):
        """Real pynvml c_nvmlFieldValue_t structures, filled the way libnvidia-ml fills them."""
        self.calls["fields"] += 1
        if h in self.lost:
            raise pynvml.NVMLError_GpuIsLost()
        if self.fields is None:
            raise pynvml.NVMLError_NotSupported()
        out = (pynvml.c_nvmlFieldValue_t * len(ids))()
        for v, fid in zip(out, ids):
            v.fieldId = fid
            x = self.fields.get(fid, 1000 + fid if self.every_field else pynvml.NVML_ERROR_NOT_SUPPORTED)
            if isinstance(x, tuple):  # ("ret", code)
                v.nvmlReturn = x[1]
                continue
            v.nvmlReturn = pynvml.NVML_SUCCESS
            if isinstance(x, float):
                v.valueType, v.value.dVal = pynvml.NVML_VALUE_TYPE_DOUBLE, x
            else:
                v.valueType, v.value.ullVal = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, x
        return out

    def _process_utilization(self, h, since):
        """Real c_nvmlProcessUtilizationSample_t structures newer than `since`, as pynvml returns them."""
        self.calls["proc_util"] += 1
        if h in self.lost:
            raise pynvml.NVMLError_GpuIsLost()
        if isinstance(self.proc_util, type):
            raise self.proc_util()
        self.util_us += 1_000_000
        out = []
        for pid, sm, mem in self.proc_util.get(h, []):
            for dt, k in ((500_000, sm - 5), (0, sm + 5)):  # two samples whose mean is (sm, mem)
                x = pynvml.c_nvmlProcessUtilizationSample_t()
                x.pid, x.timeStamp, x.smUtil, x.memUtil = pid, self.util_us - dt, max(0, k), mem
                if x.timeStamp > since:
                    out.append(x)
        if not out:
            raise pynvml.NVMLError_NotFound()
        return out

    @staticmethod
    def _raise(cls):
        def call(*a):
            raise cls()
        return call


class FakeLib:
    """libnvidia-ml's C functions as gpuwatch's direct reader calls them (pynvml's function pointers):
    each answers from the FakeDriver above (its values, its errors as return codes) and writes into the
    caller's ctypes buffers, so every test below runs through both paths."""

    def __init__(self, monkeypatch):
        monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer", self.fp)
        monkeypatch.setattr(nvml, "_pynvml_is_itself", lambda: True)

    def fp(self, name):
        impl = getattr(self, name, None)
        if impl is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

        def call(*args):
            try:
                return impl(*args) or 0
            except pynvml.NVMLError as e:
                return e.value
        return call

    @staticmethod
    def _scalar(wrapper):
        def c(h, *args):
            *inputs, out = args
            out._obj.value = getattr(pynvml, wrapper)(h, *inputs)
        return c

    nvmlDeviceGetTemperature = staticmethod(_scalar("nvmlDeviceGetTemperature"))
    nvmlDeviceGetPowerUsage = staticmethod(_scalar("nvmlDeviceGetPowerUsage"))
    nvmlDeviceGetClockInfo = staticmethod(_scalar("nvmlDeviceGetClockInfo"))
    nvmlDeviceGetCurrentClocksEventReasons = staticmethod(_scalar("nvmlDeviceGetCurrentClocksEventReasons"))
    nvmlDeviceGetTotalEccErrors = staticmethod(_scalar("nvmlDeviceGetTotalEccErrors"))

    def nvmlDeviceGetUtilizationRates(self, h, out):
        u = pynvml.nvmlDeviceGetUtilizationRates(h)
        out._obj.gpu, out._obj.memory = u.gpu, u.memory

    def nvmlDeviceGetMemoryInfo(self, h, out):
        m = pynvml.nvmlDeviceGetMemoryInfo(h)
        out._obj.used, out._obj.total = m.used, m.total

    def nvmlDeviceGetMemoryInfo_v2(self, h, out):
        assert out._obj.version == pynvml.nvmlMemory_v2
        m = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
        out._obj.used, out._obj.total, out._obj.reserved = m.used, m.total, m.reserved

    def nvmlDeviceGetComputeRunningProcesses_v3(self, h, count, arr):
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
        if count._obj.value < len(procs):
            count._obj.value = len(procs)
            return pynvml.NVML_ERROR_INSUFFICIENT_SIZE
        for slot, p in zip(arr, procs):
            slot.pid = p.pid
            slot.usedGpuMemory = p.usedGpuMemory if p.usedGpuMemory is not None else 2**64 - 1
        count._obj.value = len(procs)

    def nvmlDeviceGetFieldValues(self, h, n, arr):
        arr = arr._obj
        got = pynvml.nvmlDeviceGetFieldValues(h, [v.fieldId for v in arr][:n.value])
        for i, v in enumerate(got):
            arr[i] = v


def install_fake_nvml(n: int) -> FakeDriver:
    """FakeDriver for `n` GPUs, for good (a profiled child process, not a test): every batched field
    answers, so the sampler's own Python is what a profile measures."""
    d = FakeDriver(types.SimpleNamespace(setattr=setattr), gpus=n, name=b"fake H200")
    d.fields = {}
    d.every_field = True
    return d


# A stand-in libnvidia-ml.so.1 whose functions answer at once (no GPU here): pynvml and gpuwatch's own
# NVML code run unchanged against it (dlopen through LD_LIBRARY_PATH), so their Python + ctypes cost is
# what a profile shows. FAKE_NVML_GPUS GPUs; FAKE_NVML_PROCS running processes (default none); XID events
# not supported. FAKE_NVML_LOST_FILE=PATH (tests): while PATH exists, every fast read answers "GPU is lost";
# FAKE_NVML_NOTSUP_FILE=PATH: while PATH exists, the temperature answers "not supported".
FAKE_NVML_C = r"""
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
typedef void *H;
static int ngpu(void) { const char *e = getenv("FAKE_NVML_GPUS"); return e ? atoi(e) : 1; }
static int lost(void) { const char *e = getenv("FAKE_NVML_LOST_FILE"); return e && access(e, F_OK) == 0; }
#define L if (lost()) return 15;
static int notsup(void) { const char *e = getenv("FAKE_NVML_NOTSUP_FILE"); return e && access(e, F_OK) == 0; }
int nvmlInitWithFlags(unsigned f) { return 0; }
int nvmlInit_v2(void) { return 0; }
int nvmlShutdown(void) { return 0; }
const char *nvmlErrorString(int r) { return "fake NVML error"; }
int nvmlSystemGetDriverVersion(char *b, unsigned n) { strncpy(b, "999.fake", n); return 0; }
int nvmlSystemGetNVMLVersion(char *b, unsigned n) { strncpy(b, "99.999.fake", n); return 0; }
int nvmlDeviceGetCount_v2(unsigned *c) { *c = ngpu(); return 0; }
int nvmlDeviceGetHandleByIndex_v2(unsigned i, H *h) { *h = (H)(size_t)(i + 1); return 0; }
int nvmlDeviceGetName(H h, char *b, unsigned n) { strncpy(b, "Fake H200", n); return 0; }
int nvmlDeviceGetUUID(H h, char *b, unsigned n) { snprintf(b, n, "GPU-fake-%d", (int)(size_t)h); return 0; }
int nvmlDeviceGetEnforcedPowerLimit(H h, unsigned *v) { *v = 700000; return 0; }
int nvmlDeviceGetTemperatureThreshold(H h, int t, unsigned *v) { *v = 89; return 0; }
struct mem1 { unsigned long long total, free, used; };
struct mem2 { unsigned version; unsigned long long total, reserved, free, used; };
int nvmlDeviceGetMemoryInfo(H h, struct mem1 *m) { L m->total = 151ULL << 30; m->used = 11ULL << 30; m->free = m->total - m->used; return 0; }
int nvmlDeviceGetMemoryInfo_v2(H h, struct mem2 *m) { L m->total = 151ULL << 30; m->reserved = 615ULL << 20; m->used = 10ULL << 30; m->free = m->total - m->used; return 0; }
struct util { unsigned gpu, memory; };
int nvmlDeviceGetUtilizationRates(H h, struct util *u) { L u->gpu = 97; u->memory = 40; return 0; }
int nvmlDeviceGetTemperature(H h, int s, unsigned *v) { L if (notsup()) return 3; *v = 60; return 0; }
int nvmlDeviceGetPowerUsage(H h, unsigned *v) { L *v = 350000; return 0; }
int nvmlDeviceGetClockInfo(H h, int t, unsigned *v) { L *v = t == 2 ? 2619 : 1980; return 0; }
int nvmlDeviceGetCurrentClocksEventReasons(H h, unsigned long long *v) { L *v = 4; return 0; }
int nvmlDeviceGetCurrentClocksThrottleReasons(H h, unsigned long long *v) { *v = 4; return 0; }
int nvmlDeviceGetTotalEccErrors(H h, int a, int b, unsigned long long *v) { L *v = 0; return 0; }
struct proc { unsigned pid; unsigned long long used; unsigned gi, ci; };
int nvmlDeviceGetComputeRunningProcesses_v3(H h, unsigned *c, struct proc *p) { L
  const char *e = getenv("FAKE_NVML_PROCS"); unsigned n = e ? atoi(e) : 0, cap = *c; *c = n;
  if (n > cap) return 7;  /* NVML_ERROR_INSUFFICIENT_SIZE */
  for (unsigned i = 0; i < n; i++) { p[i].pid = 1000 + i; p[i].used = i % 3 ? (i + 1ULL) << 20 : ~0ULL; p[i].gi = p[i].ci = 0; }
  return 0; }
int nvmlDeviceGetPcieThroughput(H h, int c, unsigned *v) { *v = 100; return 0; }
int nvmlDeviceGetTotalEnergyConsumption(H h, unsigned long long *v) { *v = 5000; return 0; }
struct fv { unsigned fieldId, scopeId; long long ts, lat; unsigned type, ret; unsigned long long value; };
int nvmlDeviceGetFieldValues(H h, int n, struct fv *v) { L
  for (int i = 0; i < n; i++) { v[i].type = 3; v[i].ret = 0; v[i].value = 1000 + v[i].fieldId; v[i].ts = 1; }
  return 0; }
int nvmlEventSetCreate(void *es) { return 3; }
"""


def build_fake_nvml(work: Path) -> Path | None:
    """Compile FAKE_NVML_C into work/libnvidia-ml.so.1; None without a C compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    src = work / "fake_nvml.c"
    src.write_text("#include <stdio.h>\n" + FAKE_NVML_C)
    lib = work / "libnvidia-ml.so.1"
    r = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)], capture_output=True, text=True)
    return lib if r.returncode == 0 else None


def fake_nvml_env(env: dict, work: Path, n: int) -> str:
    """Point `env` at the stand-in NVML (n GPUs): the C library where a compiler exists, else FakeDriver
    installed in a profiled sampler child. Returns which."""
    lib = build_fake_nvml(work)
    if lib is not None:
        env["LD_LIBRARY_PATH"] = str(lib.parent) + os.pathsep + env.get("LD_LIBRARY_PATH", "")
        env["FAKE_NVML_GPUS"] = str(n)
        return "C stub libnvidia-ml.so.1"
    env[PYTHON_FAKE_ENV] = str(n)
    return "pynvml functions patched in Python"
