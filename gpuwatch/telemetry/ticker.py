"""The sampler child's 10 Hz loop in C (`_ticker.c`, compiled on first use, loaded with ctypes).

After each 100 ms sleep a Python tick runs on cold caches (~210-250 us of CPU where the same tick costs
~25-60 us warm) and each wake-up costs ~80 us more (docs/BENCHMARKS.md, "Issue 10"). Here a C thread
does the 10 Hz part - the deadline sleep, the host CPU pread, the NVML calls - into a ring of raw
records, and Python wakes only when ticks are delivered (once a second for `gpuwatch record`) to decode
the records back to back with the code its own loop uses (`nvml_direct.DirectGpu.decode`, `HostSampler.decode_fast`),
so the rows are the ones `Sampler.tick()` builds. The slow reads (1 Hz) run after every tenth decoded
tick, the XID thread is unchanged. When a GPU is lost, a field drops out for good, the process array
grows or the host CPU source changes, the C thread is stopped and started again with the new call list.

Used by the sampler child (`Sampler(c_loop=True)`) unless: GPUWATCH_SAMPLER_LOOP=python, not Linux, no
C compiler (or the compile or load fails), NVML through pynvml's wrappers (tests' fake drivers, a
replay), the host CPU read through psutil, or the profile instrumentation (GPUWATCH_SAMPLER_PROFILE).
`Sampler.loop` ("c" / "python") and `Sampler.loop_note` say which runs and why; the child sends them in
its hello and they end in the recording's meta.json (`sampler_loop`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from gpuwatch.atomic import write_file
from gpuwatch.telemetry.bus import Tick

ENV = "GPUWATCH_SAMPLER_LOOP"  # "python": never the C loop
PROFILE_ENV = "GPUWATCH_SAMPLER_PROFILE"  # a tick profile instruments the Python loop: no C loop then
SRC = Path(__file__).with_name("_ticker.c")
K_OUT, K_INT_OUT, K_INT_INT_OUT, K_COUNT_OUT = range(4)
_HEAD = struct.Struct("=qqqqii")  # gw_head: ts_us, mono_ns, cost_ns, cpu_ns, host_len, n


class _Spec(ctypes.Structure):  # gw_spec
    _fields_ = [("fn", ctypes.c_void_p), ("handle", ctypes.c_void_p), ("kind", ctypes.c_int32),
                ("a", ctypes.c_int32), ("b", ctypes.c_int32), ("cap", ctypes.c_uint32),
                ("size", ctypes.c_int64), ("off", ctypes.c_int64), ("tmpl", ctypes.c_void_p)]


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    for d in (os.path.join(base, "gpuwatch"), os.path.join(tempfile.gettempdir(), f"gpuwatch-{os.getuid()}")):
        try:
            os.makedirs(d, mode=0o700, exist_ok=True)
            st = os.stat(d)
            if st.st_uid == os.getuid() and not st.st_mode & 0o022:  # ours alone: a library is loaded from it
                return Path(d)
        except OSError:
            continue
    raise OSError("no writable cache directory")


def so_path() -> Path:
    """Where the compiled library is cached: per source, architecture and libc (a shared home on mixed nodes)."""
    tag = hashlib.sha256(SRC.read_bytes() + platform.machine().encode() + platform.libc_ver()[1].encode())
    return _cache_dir() / f"ticker-{tag.hexdigest()[:16]}.so"


def load() -> ctypes.CDLL:
    """The compiled _ticker.c: from the per-user cache (keyed by the source's hash), else compiled now with
    $CC or cc/gcc. Raises OSError (no compiler, the compile or the load failed)."""
    so = so_path()
    if so.exists():
        try:
            return _bind(ctypes.CDLL(str(so)))
        except OSError:  # truncated, or built elsewhere: build it again, once
            so.unlink(missing_ok=True)
    _compile(so)
    return _bind(ctypes.CDLL(str(so)))


def _compile(so: Path) -> None:
    cc = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or ""]
    if not cc[0]:
        raise OSError("no C compiler")

    def build(tmp: Path) -> None:
        try:  # ~0.2 s normally; the parent waits 30 s for the child's hello, which comes after this
            r = subprocess.run([*cc, "-O2", "-shared", "-fPIC", "-pthread", "-o", str(tmp), str(SRC)],
                               capture_output=True, text=True, timeout=15)
        except (OSError, subprocess.SubprocessError) as e:
            raise OSError(f"compiler failed: {e}") from None
        if r.returncode != 0 or not tmp.exists():
            raise OSError(f"compile failed (exit {r.returncode}): {r.stderr.strip()[-200:]}")

    write_file(so, build)  # atomic: a concurrent start loads one or the other, never half a file


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.gw_start.restype = ctypes.c_void_p
    lib.gw_start.argtypes = [ctypes.POINTER(_Spec), ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                             ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.gw_drain.restype = ctypes.c_int
    lib.gw_drain.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.gw_stats.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64)]
    lib.gw_stop.argtypes = lib.gw_free.argtypes = [ctypes.c_void_p]
    return lib


def make(sampler) -> tuple["CLoop | None", str]:
    """The C loop for `sampler`, or None and why not (then its Python loop runs)."""
    if os.environ.get(ENV, "").strip().lower() == "python":
        return None, f"python loop ({ENV}=python)"
    if not sys.platform.startswith("linux"):
        return None, "python loop (C loop: Linux only)"
    if os.environ.get(PROFILE_ENV):
        return None, "python loop (profile instrumentation on)"
    gpu = sampler.gpu
    direct = getattr(gpu, "direct", None)  # NvmlBackend's; the fakes and a replay have none
    if gpu is not None and (direct is None or any(direct(i) is None for i in sampler.active_gpus)):
        return None, "python loop (NVML through pynvml's wrappers)"
    if sampler.host is None or not hasattr(sampler.host, "raw_source") or sampler.host.raw_source() is None:
        return None, "python loop (host CPU read through psutil)"
    try:
        lib = load()
    except OSError as e:
        return None, f"python loop (C loop unavailable: {e})"
    return CLoop(sampler, lib), "C loop (_ticker.c)"


class _Layout:
    """One run of the C thread: the call list it was given and views of a record to decode its records."""

    def __init__(self, sampler) -> None:
        gpu, host = sampler.gpu, sampler.host
        self.host_fd, self.host_size = host.raw_source()
        calls: list[tuple] = []  # (fn, handle, kind, a, b, cap, buf)
        per_gpu: list[tuple] = []
        self.objs: list[Any] = []  # what the key's ids refer to, alive while this layout is
        for i in sampler.active_gpus:
            d = gpu.direct(i)
            first = len(calls)
            for spec in d.specs:
                ints = spec[2][1:-1]
                calls.append((spec[1], d.h, (K_OUT, K_INT_OUT, K_INT_INT_OUT)[len(ints)], *ints, *(0,) * (2 - len(ints)),
                              0, spec[3]))
            p = f = None
            if d.procs_fn is not None:
                p = len(calls)
                calls.append((d.procs_fn, d.h, K_COUNT_OUT, 0, 0, d.procs_cap, d.procs_buf))
            if d.fields_fn is not None:
                f = len(calls)
                calls.append((d.fields_fn, d.h, K_INT_OUT, len(d.batch), 0, 0, d.fields_buf))
            per_gpu.append((i, d, first, len(d.specs), p, f))
            self.objs += [d, d.specs, d.batch, d.procs_buf]
        n = len(calls)
        self.n, self.host_off = n, _HEAD.size + 8 * n
        off = (self.host_off + self.host_size + 7) & ~7
        self.specs = (_Spec * max(1, n))()
        offs = []
        for s, (fn, h, kind, a, b, cap, buf) in zip(self.specs, calls):
            size = ctypes.sizeof(buf)
            s.fn, s.handle = ctypes.cast(fn, ctypes.c_void_p).value, ctypes.cast(h, ctypes.c_void_p).value
            s.kind, s.a, s.b, s.cap, s.size, s.off = kind, a, b, cap, size, off
            s.tmpl = ctypes.addressof(buf)
            offs.append(off)
            off = (off + size + 7) & ~7
        self.rec_size = off
        self.one = (ctypes.c_char * off)()  # the record being decoded; the views below look into it
        view = lambda k: type(calls[k][6]).from_buffer(self.one, offs[k])  # noqa: E731
        self.gpus: dict[int, tuple] = {}
        for i, d, first, ns, p, f in per_gpu:
            specs = [(c, fn, (), view(first + k), kind) for k, (c, fn, _, _, kind) in enumerate(d.specs)]
            self.gpus[i] = (d, specs, first, first + ns, p, view(p) if p is not None else None,
                            f, view(f) if f is not None else None, d.batch)
        self.key = key(sampler)


def key(sampler) -> tuple:
    """What the C thread's call list depends on: when it changes, the thread is started again."""
    direct = getattr(sampler.gpu, "direct", None)  # no GPU: a host-only call list
    gpus = tuple((i, id(d), id(d.specs), d.procs_fn is not None, d.procs_cap, id(d.batch), d.fields_fn is not None)
                 for i in sampler.active_gpus for d in (direct(i),))
    return gpus, sampler.host.raw_source()


class CLoop:
    def __init__(self, sampler, lib) -> None:
        self.s, self.lib = sampler, lib
        # records the ring holds: 60 s at 10 Hz, so only a decoding thread stalled that long loses ticks
        # (counted as late ticks and said in an event, like the Python loop's skipped deadlines)
        self.cap = max(round(60 / sampler.interval), 4 * sampler.deliver_n)
        self._closed = False
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)  # the C thread's notify never blocks
        self._h: int | None = None
        self._late = self._dropped = 0  # from C threads already stopped
        self._last_ns: int | None = None
        self.dropped = 0

    def wake(self) -> None:
        """Sampler.stop: the decoding thread wakes, stops the C thread, decodes what is left."""
        if self._closed:
            return
        try:
            os.write(self._w, b"s")
        except OSError:
            pass

    def _start(self) -> _Layout:
        lay = _Layout(self.s)
        interval = int(self.s.interval * 1e9)
        first = self._last_ns + interval if self._last_ns is not None else 0  # a restart: the same deadlines
        h = self.lib.gw_start(lay.specs, lay.n, lay.host_fd, lay.host_off, lay.host_size, lay.rec_size,
                              interval, first, self.cap, self._w, self.s.deliver_n)
        if not h:
            raise OSError("gw_start failed")
        self._h = h
        return lay

    def _halt(self) -> None:
        """Stop the C thread (the ring stays readable)."""
        self.lib.gw_stop(self._h)

    def _free(self) -> None:
        late, dropped = ctypes.c_int64(), ctypes.c_int64()
        self.lib.gw_stats(self._h, ctypes.byref(late), ctypes.byref(dropped))
        self._late, self._dropped = self._late + late.value, self._dropped + dropped.value
        self.lib.gw_free(self._h)
        self._h = None

    def _stats(self) -> None:
        late, dropped = ctypes.c_int64(), ctypes.c_int64()
        self.lib.gw_stats(self._h, ctypes.byref(late), ctypes.byref(dropped))
        dropped = self._dropped + dropped.value
        if dropped > self.dropped:
            self.s.bus.emit("sampler_error", f"sampler: {dropped - self.dropped} ticks dropped (the decoding thread "
                            "fell behind the C loop by more than its ring holds)", "warning",
                            dropped=dropped - self.dropped)
        self.dropped = dropped
        self.s.late_ticks = self._late + late.value + dropped

    def run(self, slow_inline: bool = False) -> None:
        s = self.s
        slow_every = max(1, round(s.slow_interval / s.interval)) if slow_inline else 0
        n, why = 0, None
        s.set_waker(self.wake)
        if s.stopping:  # a stop() that came before the waker was set would not wake the read below
            self.wake()
        try:
            lay = self._start()
            while True:
                try:
                    os.read(self._r, 4096)  # blocks until ticks are delivered (or stop)
                except InterruptedError:
                    pass
                stopping = s.stopping
                if stopping:
                    self._halt()
                n = self._drain(lay, n, slow_every)
                self._stats()
                if stopping:
                    break
                if key(s) != lay.key:  # a GPU lost, a field dropped, ...: a new call list
                    self._halt()
                    n = self._drain(lay, n, slow_every)
                    self._free()
                    lay = self._start()
        except (OSError, AttributeError, TypeError, ValueError) as e:  # could not (re)start the C thread
            why = e
        finally:
            s.set_waker(None)
            self._closed = True
            if self._h is not None:
                self._free()
            os.close(self._r)
            os.close(self._w)
        if why is not None and not s.stopping:
            s.loop, s.loop_note = "python", f"python loop (the C loop failed: {why})"
            s.bus.emit("sampler_error", s.loop_note, "warning")
            s.run(slow_inline)

    def _drain(self, lay: _Layout, n: int, slow_every: int) -> int:
        one, drain, h = lay.one, self.lib.gw_drain, self._h
        while drain(h, one, 1):
            self._decode(lay)
            if slow_every:
                n += 1
                if n == slow_every:
                    n = 0
                    self.s.slow_tick()
        return n

    def _decode(self, lay: _Layout) -> Tick:
        """One record -> the Tick Sampler.tick() builds (same rows; timings from the C thread)."""
        s, one = self.s, lay.one
        ts, mono, cost, cpu, host_len, n = _HEAD.unpack_from(one)
        rets = struct.unpack_from(f"={n}i", one, _HEAD.size)
        counts = struct.unpack_from(f"={n}I", one, _HEAD.size + 4 * n)
        if s.host:
            data = one[lay.host_off:lay.host_off + host_len] if host_len >= 0 else None
            common = s.host.decode_fast(lay.host_fd, data, mono)
        else:
            common = {}
        gpu = s.gpu

        def read_gpu(i: int) -> dict[str, Any]:
            g = lay.gpus.get(i)
            if g is None or gpu.direct(i) is not g[0]:  # the reader was rebuilt since: read now
                return gpu.read_fast(i)
            d, specs, lo, hi, p, parr, f, farr, batch = g
            return gpu.direct_row(i, lambda: d.decode(
                specs, rets[lo:hi], rets[p] if p is not None else None, counts[p] if p is not None else 0,
                parr, rets[f] if f is not None else None, batch, farr))

        def timing() -> tuple[int | None, int, int]:  # the C thread's
            last, self._last_ns = self._last_ns, mono
            return (mono - last) // 1000 if last is not None else None, cost // 1000, cpu // 1000
        return s.emit(ts, common, read_gpu, timing)
