"""The 10 Hz sampler: a deadline-scheduled thread (never on the UI loop) that reads every GPU and the
host, and appends one `Tick` to the bus. Its own cost and interval are columns of every row.

The slow reads (PCIe, energy, per-core CPU, memory, swap, load, and each GPU process's utilization, user
and command, added to its `gpu_procs` entry: once a second) run on the tick thread
after every tenth tick when the backend says they do not block (`slow_blocks` False: NVML with PCIe byte
counters, or no GPU): one thread, ten wake-ups a second. Where they can block (the legacy PCIe calls,
~21 ms; a backend that does not say) they keep a second, slower thread. The fast tick copies their latest
values. XID errors arrive on a third thread (NVML events) and become events.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Protocol

from gpuwatch.telemetry.bus import Bus, Tick
from gpuwatch.threads import start_thread
from gpuwatch.telemetry.nvml import GpuInfo, GpuLost
from gpuwatch.telemetry.procs import ProcInfo


class GpuBackend(Protocol):
    """What the sampler needs from a GPU source: NVML live, or a recording replayed as live."""

    kind: str
    label: str
    gpus: list[GpuInfo]
    driver_version: str | None

    def read_fast(self, i: int) -> dict[str, Any]: ...
    def read_slow(self, i: int) -> dict[str, Any]: ...
    def close(self) -> None: ...


class Sampler:
    """Samples at `interval` seconds. `clock`/`wait` are injectable for tests (fake time)."""

    def __init__(self, bus: Bus, gpu: GpuBackend | None, host, interval: float = 0.1,
                 slow_interval: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 wall_us: Callable[[], int] = lambda: time.time_ns() // 1000,
                 wait: Callable[[float], bool] | None = None, first_tick: int = 0, deliver_n: int = 1,
                 c_loop: bool = False) -> None:
        """`first_tick`: the number of the first tick (a resumed session goes on from its last one).
        `c_loop`: run the 10 Hz loop in C where it can (gpuwatch/telemetry/ticker.py; the sampler child),
        handing ticks to the bus `deliver_n` at a time."""
        self.bus, self.gpu, self.host = bus, gpu, host
        self.interval, self.slow_interval = interval, slow_interval
        self.clock, self.wall_us = clock, wall_us
        self._stop = threading.Event()
        self._wait = wait or self._sleep
        self._slow: dict[Any, dict[str, Any]] = {}
        self._tick = first_tick
        self._last_t: float | None = None
        self.late_ticks = 0  # ticks that started more than one interval late (skipped deadlines)
        self._threads: list[threading.Thread] = []
        self.active_gpus = [g.index for g in gpu.gpus] if gpu else []
        self.deliver_n, self.c_loop = deliver_n, c_loop
        self.loop, self.loop_note = "python", "python loop"  # which loop runs ("c" / "python") and why
        self._c = None  # the C loop (ticker.CLoop) once chosen
        self._wake: Callable[[], None] | None = None  # the C loop's: wakes its decoding thread at stop
        # the processes on each GPU: utilization, user and command added once a second to the entries NVML
        # lists (live NVML only: a replayed recording's rows carry what was recorded)
        self.procinfo = ProcInfo() if gpu is not None and getattr(gpu, "kind", None) == "nvml" else None
        self._last_procs: dict[int, list | None] = {}  # per GPU: the last tick's gpu_procs
        self._proc_info: dict[int, dict[int, dict[str, Any]]] = {}  # per GPU: pid -> the fields added

    # -- one tick ---------------------------------------------------------------------------------
    def tick(self) -> Tick:
        """One sample of every GPU and the host. Per tick it builds only what it sends: one dict per GPU row
        (the backend's, filled in place) and one shared dict of the host and tick columns merged into each."""
        clock = self.clock
        t0, c0 = clock(), time.thread_time_ns()
        ts = self.wall_us()
        common = self.host.read_fast() if self.host else {}

        def timing() -> tuple[int | None, int, int]:  # after the reads: the tick's interval, cost and CPU (us)
            last, self._last_t = self._last_t, t0
            return (int((t0 - last) * 1e6) if last is not None else None, int((clock() - t0) * 1e6),
                    (time.thread_time_ns() - c0) // 1000)
        return self.emit(ts, common, self.gpu.read_fast if self.gpu else None, timing)

    def emit(self, ts: int, common: dict[str, Any], read_gpu, timing) -> Tick:
        """The rows of one tick, handed to the bus: `read_gpu(i)` gives GPU i's fast columns (GpuLost drops the
        GPU), the last slow values are merged in, `common` (the host's columns) goes into every row, and
        `timing()`, called after the reads, gives (sampler_interval_us, sampler_cost_us, sampler_cpu_us).
        The Python loop (`tick`) and the C loop's decoding (`ticker.CLoop`) both build their rows here."""
        slow = self._slow
        host_slow = slow.get("host")
        if host_slow:
            common.update(host_slow)
        rows = []
        info_of = self._proc_info if self.procinfo is not None else None
        for i in self.active_gpus:
            try:
                row = read_gpu(i)
            except GpuLost as e:
                self._lost(i, e)
                continue
            gpu_slow = slow.get(i)
            if gpu_slow:
                row.update(gpu_slow)
            if info_of is not None:
                procs = self._last_procs[i] = row.get("gpu_procs")
                info = info_of.get(i) if procs else None
                if info:
                    for p in procs:
                        x = info.get(p["pid"])
                        if x is not None:
                            p.update(x)
            row["gpu"] = i
            rows.append(row)
        if not rows:
            rows.append({"gpu": None})
        common["ts"] = ts
        common["tick"] = self._tick
        common["sampler_interval_us"], common["sampler_cost_us"], common["sampler_cpu_us"] = timing()
        for row in rows:
            row.update(common)
        t = Tick(self._tick, ts, rows)
        self._tick += 1
        self.bus.ticks.append(t)
        return t

    def _lost(self, i: int, e: GpuLost) -> None:
        self.active_gpus = [g for g in self.active_gpus if g != i]  # a new list: the loop keeps its own
        self.bus.emit("gpu_lost", str(e), "error", gpu=i)

    def slow_tick(self) -> None:
        if self.host:
            self._slow["host"] = self.host.read_slow()
        pi = self.procinfo
        util = getattr(self.gpu, "read_proc_util", None) if pi is not None else None
        for i in list(self.active_gpus):
            try:
                self._slow.setdefault(i, {}).update(self.gpu.read_slow(i))
                if pi is not None:  # NVML's per-process utilization only where a process is listed
                    procs = self._last_procs.get(i)
                    self._proc_info[i] = pi.build(procs, util(i) if util and procs else None)
            except GpuLost:
                pass  # the fast tick reports it
        if pi is not None:
            pi.forget_except({p["pid"] for ps in list(self._last_procs.values()) for p in ps or ()})

    def _sleep(self, seconds: float) -> bool:
        """Wait for the next deadline; True when asked to stop. Short waits are a plain sleep (one
        clock_nanosleep): Event.wait builds a lock and a condition per call, which costs twice the CPU
        per wake-up, and a stop is still seen within one interval."""
        if seconds <= 0.25:
            time.sleep(seconds)
            return self._stop.is_set()
        return self._stop.wait(seconds)

    # -- loops --------------------------------------------------------------------------------------
    def slow_inline(self) -> bool:
        """Whether the slow reads can share the tick thread (they never block for long)."""
        return self.gpu is None or getattr(self.gpu, "slow_blocks", True) is False

    def run(self, slow_inline: bool = False) -> None:
        """Deadline loop: next = start + k*interval, so jitter never accumulates. A tick that is more
        than one interval late skips the missed deadlines (counted in `late_ticks`). `slow_inline`: the
        slow reads run here after every slow_interval/interval-th tick (instead of on their own thread)."""
        deadline = self.clock()
        slow_every = max(1, round(self.slow_interval / self.interval)) if slow_inline else 0
        n = 0
        while not self._stop.is_set():
            self.tick()
            if slow_every:
                n += 1
                if n == slow_every:
                    n = 0
                    self.slow_tick()
            deadline += self.interval
            now = self.clock()
            if now > deadline + self.interval:
                self.late_ticks += 1
                deadline = now
            if self._wait(max(0.0, deadline - now)):
                break

    def _run_slow(self) -> None:
        while not self._stop.is_set():
            self.slow_tick()
            if self._stop.wait(self.slow_interval):
                break

    def _run_xid(self) -> None:
        why = self.gpu.watch_xid(self._stop, lambda g, x: self.bus.emit(
            "xid", f"XID {x} on GPU {g}", "error", gpu=g if g >= 0 else None, xid=x))
        if why:
            self.bus.emit("xid", why, "info", watching=False)

    def choose_loop(self) -> str:
        """The C loop where `c_loop` asks for it and it can run (compiled on first use), else Python's."""
        if self.c_loop and self._c is None and self.loop == "python":
            from gpuwatch.telemetry import ticker

            self._c, self.loop_note = ticker.make(self)
            self.loop = "c" if self._c is not None else "python"
        return self.loop

    def start(self) -> None:
        self.slow_tick()
        self.choose_loop()
        run = self._c.run if self._c is not None else self.run
        if self.slow_inline():
            targets = [(lambda: run(slow_inline=True), "gpuwatch-sampler")]
        else:
            targets = [(run, "gpuwatch-sampler"), (self._run_slow, "gpuwatch-sampler-slow")]
        if self.gpu is not None and hasattr(self.gpu, "watch_xid"):
            targets.append((self._run_xid, "gpuwatch-xid"))
        self._threads += [start_thread(fn, name) for fn, name in targets]

    @property
    def stopping(self) -> bool:
        """True once `stop` was called (the C loop's decoding thread reads it between drains)."""
        return self._stop.is_set()

    def set_waker(self, wake: Callable[[], None] | None) -> None:
        """The C loop hands its wake-up here while it runs (None when it ends): `stop` calls it, so a
        decoding thread blocked on its pipe wakes at once."""
        self._wake = wake

    def stop(self) -> None:
        self._stop.set()
        wake = self._wake
        if wake is not None:
            wake()
        for th in self._threads:
            th.join(timeout=2.0)
