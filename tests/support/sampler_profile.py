"""Where a sampler tick's CPU goes, for `benchmarks/bench_sampler.py profile` only (not shipped: the
sampler child imports it, through `GPUWATCH_SAMPLER_PROFILER`, only when the benchmark asks).

Off unless the environment variable GPUWATCH_SAMPLER_PROFILE names a file: the sampler child looks at it
once, at start-up, and only then wraps the pieces of the running sampler (host read, each GPU's read and
each NVML read group inside it, the channel's append, pickle and send, the sleep and wake-up, the slow
read and in it the PCIe counter and energy reads) in timers; a normal run runs the unwrapped objects and
pays nothing. At stop the child writes one JSON file: per loop iteration (one tick + its sleep) the CPU
(thread_time) and wall nanoseconds of every section, nested by path ("tick/gpu0.read_fast/util"), plus
the slow ticks and a calibration of the timers' own cost.

GPUWATCH_SAMPLER_PROFILE_FAKE_NVML=N (no GPU here, and no C compiler for the stand-in libnvidia-ml):
pynvml's functions are replaced by support.fake_nvml's driver for N GPUs (real ctypes field-value
structures), so the sampler's own Python can be profiled on a machine without a GPU.
"""

from __future__ import annotations

import json
import os
import pickle
import threading
import time
from typing import Any, Callable

from gpuwatch.atomic import write_file
from gpuwatch.telemetry.ticker import PROFILE_ENV as ENV

_tt = time.thread_time_ns
_pc = time.perf_counter_ns
_mono = time.monotonic_ns


class TickProfile:
    def __init__(self, path: str) -> None:
        self.path = path
        self._local = threading.local()
        self._lock = threading.Lock()
        self.iterations: list[list] = []  # [end mono ns, iteration cpu ns, iteration wall ns, {path: [cpu, wall]}]
        self.slow: list[list] = []  # [end mono ns, {path: [cpu, wall]}]
        self.other: dict[str, list[int]] = {}  # sections outside the loops (events, the final flush): [n, cpu, wall]
        self.batch_bytes: list[int] = []
        self.last_batch: Any = None
        self.meta: dict[str, Any] = {"pid": os.getpid()}

    # -- the timers ------------------------------------------------------------------------------------
    def _state(self):
        st = getattr(self._local, "st", None)
        if st is None:
            st = self._local.st = {"stack": [], "cur": {}, "mark": None}
        return st

    def timed(self, name: str | Callable[..., str], fn: Callable) -> Callable:
        """fn wrapped: its CPU and wall go to the calling thread's current record under `name` (or
        name(*args) when a function), nested below the sections the thread is already in."""
        state = self._state  # bound once

        def wrapper(*a, **k):
            st = state()
            stack = st["stack"]
            stack.append(name(*a) if callable(name) else name)
            path = "/".join(stack)
            c0, w0 = _tt(), _pc()
            try:
                return fn(*a, **k)
            finally:
                c, w = _tt() - c0, _pc() - w0
                cur = st["cur"]
                acc = cur.get(path)
                if acc is None:
                    cur[path] = [c, w]
                else:
                    acc[0] += c
                    acc[1] += w
                stack.pop()
                if not stack:
                    self._top_done(st, path)
        return wrapper

    def _top_done(self, st, path: str) -> None:
        if path == "wake":  # one loop iteration (tick, channel, sleep) ends with the wake-up
            now_c, now_w = _tt(), _pc()
            mark = st["mark"]
            st["mark"] = (now_c, now_w)
            if mark is not None:
                with self._lock:
                    self.iterations.append([_mono(), now_c - mark[0], now_w - mark[1], st["cur"]])
            st["cur"] = {}
        elif path == "slow":  # on its own thread, or on the tick thread between a tick and its sleep
            cur = st["cur"]
            rec = {p: v for p, v in cur.items() if p == "slow" or p.startswith("slow/")}
            with self._lock:
                self.slow.append([_mono(), rec])
            st["cur"] = {p: v for p, v in cur.items() if not p.startswith("slow/")}  # "slow" stays: the
            # iteration it ran in shows it
        elif path != "tick":
            with self._lock:
                for p, (c, w) in st["cur"].items():
                    o = self.other.setdefault(p, [0, 0, 0])
                    o[0] += 1
                    o[1] += c
                    o[2] += w
            st["cur"] = {}

    # -- wiring ----------------------------------------------------------------------------------------
    def instrument(self, sampler, channel=None) -> None:
        """Wrap the pieces of `sampler` (a Sampler) and of `channel` (the child's _PipeChannel)."""
        t = self.timed
        s = sampler
        self.meta.update(interval_s=s.interval, slow_interval_s=s.slow_interval,
                         gpus=list(s.active_gpus), gpu_kind=getattr(s.gpu, "kind", None))
        s.tick = t("tick", s.tick)
        s._wait = t("wake", s._wait)
        s.slow_tick = t("slow", s.slow_tick)
        if s.host is not None:
            self.meta["host_cpu_source"] = getattr(s.host, "cpu_source", None)
            s.host.read_fast = t("host.read_fast", s.host.read_fast)
            s.host.read_slow = t("host.read_slow", s.host.read_slow)
        g = s.gpu
        if g is not None:
            g.read_fast = t(lambda i: f"gpu{i}.read_fast", g.read_fast)
            g.read_slow = t(lambda i: f"gpu{i}.read_slow", g.read_slow)
            self.meta["pcie_every"] = getattr(g, "pcie_every", None)
            fast = getattr(g, "_fast", None)  # NvmlBackend: one reader per NVML call (group), by GPU index
            if isinstance(fast, dict):
                for i, readers in fast.items():
                    if isinstance(readers, dict):
                        fast[i] = {k: t(k, fn) for k, fn in readers.items()}
            direct = getattr(g, "_direct", None)  # NvmlBackend's direct reader by GPU index (no pynvml wrappers)
            if isinstance(direct, dict):
                for d in direct.values():
                    if d is None:
                        continue
                    d.specs = [(col, t(col, fn), *rest) for col, fn, *rest in d.specs]
                    if d.procs_fn is not None:
                        d.procs_fn = t("gpu_procs", d.procs_fn)
                    if d.fields_fn is not None:
                        d.fields_fn = t("field_values", d.fields_fn)
                self.meta["nvml_direct"] = [d is not None for d in direct.values()]
            if hasattr(g, "_slow_n"):  # NvmlBackend's slow read: the PCIe counters and the energy read apart
                from gpuwatch.telemetry import nvml  # (module state: this child is profiling, nothing else)

                nvml.read_pcie_counters = t("pcie_counters", nvml.read_pcie_counters)
                for table in (nvml.ENERGY, nvml.LEGACY_PCIE):
                    for k, fn in list(table.items()):
                        table[k] = t(k, fn)
            if hasattr(g, "_read_batch"):
                g._read_batch = t("field_values", g._read_batch)
            if hasattr(g, "_read_fields"):
                g._read_fields = t("field_values", g._read_fields)
            self.meta["field_batch"] = [[c for c, *_ in b] if b else b for b in getattr(g, "_batch", {}).values()]
        if channel is not None:
            channel.append = t("channel.append", channel.append)
            if hasattr(channel, "_encode"):
                enc = channel._encode

                def encode(item):
                    b = enc(item)
                    if isinstance(item, list):
                        self.batch_bytes.append(len(b))
                        self.last_batch = item
                    return b
                channel._encode = t("pickle", encode)
            if hasattr(channel, "_send_bytes"):
                channel._send_bytes = t("send", channel._send_bytes)

    def calibrate(self, n: int = 2000) -> dict[str, float]:
        """The timers' own cost per section (ns of CPU and wall), and pickle/unpickle of the last batch."""
        scratch = TickProfile(self.path)
        f = scratch.timed("x", lambda: None)
        st = scratch._state()
        st["stack"].append("cal")  # nested: no record is filed per call
        c0, w0 = _tt(), _pc()
        for _ in range(n):
            f()
        c1, w1 = _tt(), _pc()
        out = {"timer_cpu_ns_per_section": (c1 - c0) / n, "timer_wall_ns_per_section": (w1 - w0) / n}
        cold = []  # the same, first thing after a 100 ms sleep (as in a tick): what a section's timers add there
        for _ in range(6):
            time.sleep(0.1)
            c0 = _tt()
            f()
            cold.append(_tt() - c0)
        out["timer_cpu_ns_per_section_cold"] = sorted(cold)[len(cold) // 2]
        if self.last_batch is not None:
            from multiprocessing.reduction import ForkingPickler

            b = bytes(ForkingPickler.dumps(self.last_batch))
            for label, fn in (("pickle_batch_cpu_us", lambda: ForkingPickler.dumps(self.last_batch)),
                              ("unpickle_batch_cpu_us", lambda: pickle.loads(b))):
                c0 = _tt()
                for _ in range(200):
                    fn()
                out[label] = (_tt() - c0) / 200 / 1000
            out["batch_ticks"] = len(self.last_batch)
        return out

    def dump(self) -> None:
        import gc
        import sys

        self.meta["gc"] = {"stats": gc.get_stats(), "frozen": gc.get_freeze_count(), "objects": len(gc.get_objects())}
        self.meta["modules"] = len(sys.modules)
        self.meta["heavy_modules"] = sorted(m for m in ("polars", "numpy", "pyarrow", "torch", "psutil", "pynvml")
                                            if m in sys.modules)
        out = {"meta": self.meta, "calibration": self.calibrate(), "iterations": self.iterations,
               "slow": self.slow, "other": self.other, "batch_bytes": self.batch_bytes}
        write_file(self.path, json.dumps(out))


def from_env() -> TickProfile | None:
    """The child's one look at the environment (at start-up): None in a normal run."""
    path = os.environ.get(ENV)
    if not path:
        return None
    from support.fake_nvml import PYTHON_FAKE_ENV, install_fake_nvml

    fake = os.environ.get(PYTHON_FAKE_ENV)
    if fake:
        install_fake_nvml(int(fake))
    return TickProfile(path)
