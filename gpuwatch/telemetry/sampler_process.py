"""The sampler in a child process (the default): its timing cannot be disturbed by Python work in the
monitored process (the workload's dispatch, the UI), which holds the GIL for milliseconds at a time.
A thread sampler beside a pure-Python busy thread was measured at p99 359 ms intervals (2 cores);
the child keeps its deadline because it has its own interpreter.

The child runs the same `Sampler` and sends Ticks (and events: GPU lost, XID) through a pipe; a
receiver thread here appends them to the bus. Timestamps and intervals are taken in the child.

`deliver_s` batches ticks: 0 sends each tick as it is taken (the dashboard, a guard); a headless
recorder that writes once a second asks for 1.0, so the pipe, the receiver and the recorder wake once
a second instead of ten times (wake-ups are most of what a 10 Hz Python sampler costs). Events are
never held back: one flushes the held ticks and goes at once, in order.

Signals: Ctrl-C in a terminal (and a hang-up, or a SIGTERM sent to the process group) reaches the
whole foreground process group. The child must not die of it with a KeyboardInterrupt traceback: it
is started with SIGINT/SIGHUP/SIGTERM blocked (the mask survives exec), moves into its own process
group, ignores SIGINT and SIGHUP, and only stops when the parent tells it (the stop pipe) or dies
(the stop pipe reads EOF at once; a new parent pid is checked too). No multiprocessing Event: its
named semaphore made Python's resource tracker warn about a leak after `kill -9` of the parent.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import threading
from dataclasses import asdict
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable

from gpuwatch.telemetry.bus import Bus, Event, Tick
from gpuwatch.telemetry.nvml import GpuInfo
from gpuwatch.threads import set_native_name, start_thread


class _PipeChannel:
    """What the Sampler appends ticks to, in the child: sends them to the parent, `deliver_n` at a time."""

    def __init__(self, conn, stop, deliver_n: int = 1) -> None:
        self.conn, self.stop, self.deliver_n = conn, stop, deliver_n
        self._encode = ForkingPickler.dumps  # what conn.send does, in two steps (the profile times each)
        self._send_bytes = conn.send_bytes
        self._held: list[Tick] = []
        self._lock = threading.Lock()  # the tick thread, the slow thread and the XID thread all send

    def append(self, item) -> None:
        with self._lock:
            if isinstance(item, Tick) and self.deliver_n > 1:
                self._held.append(item)
                if len(self._held) < self.deliver_n:
                    return
                item, self._held = self._held, []
            else:
                self._send_held()
            self._send(item)

    def flush(self) -> None:
        with self._lock:
            self._send_held()

    def _send_held(self) -> None:
        if self._held:
            self._send(self._held)
            self._held = []

    def _send(self, item) -> None:
        try:
            self._send_bytes(self._encode(item))
        except (BrokenPipeError, EOFError, OSError):  # the parent is gone: stop sampling
            self.stop.set()


class _PipeBus:
    """What the Sampler needs of a Bus, forwarding to the parent."""

    def __init__(self, conn, stop, deliver_n: int) -> None:
        self.ticks = _PipeChannel(conn, stop, deliver_n)

    def emit(self, kind, message, severity="info", gpu=None, **detail) -> None:
        self.ticks.append(Event(kind, message, severity, gpu, detail))


_GROUP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGHUP", "SIGTERM") if hasattr(signal, n))


def _detach_from_terminal_signals() -> None:
    """In the child: leave the parent's process group (a terminal's Ctrl-C, hang-up and a group
    SIGTERM no longer reach it), ignore SIGINT/SIGHUP for good, drop any that arrived while they were
    blocked, then unblock. SIGTERM sent to this pid alone still ends it, quietly."""
    for sig in _GROUP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)  # discards a pending one
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _GROUP_SIGNALS)
    if hasattr(signal, "SIGTERM"):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _pin_from_env() -> None:
    """GPUWATCH_SAMPLER_CPU=N (or `last`): keep the sampler child (its threads are started after this) on
    one CPU, so each 100 ms wake-up finds that core's caches as it left them instead of a cold core. An
    experiment measured by `bench_sampler.py cost` (docs/BENCHMARKS.md); off unless set."""
    want = os.environ.get("GPUWATCH_SAMPLER_CPU", "").strip()
    if not want or not hasattr(os, "sched_setaffinity"):
        return
    try:
        allowed = sorted(os.sched_getaffinity(0))
        cpu = allowed[-1] if want == "last" else int(want)
        os.sched_setaffinity(0, {cpu})
    except (ValueError, OSError):  # a CPU this process may not use: leave the scheduler alone
        pass


PROFILER_ENV = "GPUWATCH_SAMPLER_PROFILER"


def profiler_from_env():
    """The child's one look at the environment for a tick profile: None in a normal run. The profiler
    is not shipped: with GPUWATCH_SAMPLER_PROFILE set (by `benchmarks/bench_sampler.py profile` only) the
    child imports the module GPUWATCH_SAMPLER_PROFILER names (default `support.sampler_profile`,
    tests/support/ on the PYTHONPATH the benchmark gives it) and asks it for the profiler."""
    from gpuwatch.telemetry.ticker import PROFILE_ENV

    if not os.environ.get(PROFILE_ENV):
        return None
    import importlib

    return importlib.import_module(os.environ.get(PROFILER_ENV) or "support.sampler_profile").from_env()


def _child(conn, stop_conn, factory: Callable[[], tuple[Any, str]], interval: float, slow_interval: float,
           pid: int, deliver_s: float = 0.0, first_tick: int = 0) -> None:
    _detach_from_terminal_signals()
    set_native_name("gw-sampler-proc")
    _pin_from_env()
    prof = profiler_from_env()  # None unless a benchmark asked (bench_sampler.py profile)
    stop = threading.Event()  # set by a broken pipe (the parent is gone) in the child's channel
    from gpuwatch.telemetry.host import HostSampler
    from gpuwatch.telemetry.sampler import Sampler

    try:
        gpu, note = factory()
    except Exception as e:  # e.g. a replay source that cannot be opened, a GPU asked for that is not there
        try:  # exit_code: a UsageError (2) stays one in the parent
            conn.send(("hello", {"error": str(e), "exit_code": getattr(e, "exit_code", 1)}))
        except (BrokenPipeError, EOFError, OSError):
            pass
        return
    deliver_n = max(1, round(deliver_s / interval))
    bus = _PipeBus(conn, stop, deliver_n)
    # the C loop (ticker.py) hands ticks over `deliver_n` at a time itself: the channel sends them on as they come
    s = Sampler(bus, gpu, HostSampler(pid), interval=interval, slow_interval=slow_interval, first_tick=first_tick,
                deliver_n=deliver_n, c_loop=prof is None)
    s.choose_loop()
    try:
        conn.send(("hello", {"note": note, "kind": gpu.kind if gpu else None, "label": gpu.label if gpu else None,
                             "driver_version": gpu.driver_version if gpu else None,
                             "gpus": [asdict(g) for g in gpu.gpus] if gpu else [],
                             "sampler_loop": s.loop, "sampler_loop_note": s.loop_note}))
    except (BrokenPipeError, EOFError, OSError):  # the parent died while this child started: nothing to say
        if gpu is not None:
            gpu.close()
        return
    if prof is not None:
        prof.instrument(s, bus.ticks)
    # Everything built so far lives as long as the process: out of the cyclic collector's sight, so its
    # occasional full collections walk only what the ticks allocate, not every imported module's objects.
    gc.collect()
    gc.freeze()
    s.start()
    # The parent says stop by writing to (or closing) the stop pipe; a killed parent closes it too, so
    # poll() returns at once either way. A broken data pipe sets `stop`; a new parent pid is checked.
    while not stop.is_set():
        try:
            if stop_conn.poll(2.0):
                break
        except (EOFError, OSError):
            break
        if os.getppid() != pid:
            break
    s.stop()
    if prof is not None:
        prof.dump()
    bus.ticks.flush()
    bus.ticks.append(("bye", {"late_ticks": s.late_ticks}))
    if gpu is not None:
        gpu.close()


class RemoteGpu:
    """The parent's view of the child's GPU backend (static facts only)."""

    def __init__(self, hello: dict[str, Any]) -> None:
        self.kind = hello.get("kind")
        self.label = hello.get("label")
        self.driver_version = hello.get("driver_version")
        self.gpus = [GpuInfo(**g) for g in hello.get("gpus", [])]

    def close(self) -> None:
        pass


class SamplerProcess:
    """Same start/stop/late_ticks surface as Sampler; the GPU backend lives in the child."""

    def __init__(self, bus: Bus, factory: Callable[[], tuple[Any, str]], interval: float = 0.1,
                 slow_interval: float = 1.0, deliver_s: float = 0.0, first_tick: int = 0) -> None:
        """`factory`: a picklable callable that builds the GPU backend in the child and returns
        (backend or None, a one-line note); `gpuwatch.recording.backends.BackendFactory`."""
        self.bus, self.interval = bus, interval
        self.on_delivery: Callable[[], None] | None = None  # called after each batch of ticks arrives
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe(duplex=False)
        stop_r, self._stop_w = ctx.Pipe(duplex=False)  # the parent's stop: a message, or EOF if it dies
        self._stopping = threading.Event()
        self._proc = ctx.Process(target=_child, name="gpuwatch-sampler",
                                 args=(child_conn, stop_r, factory, interval, slow_interval, os.getpid(), deliver_s,
                                       first_tick),
                                 daemon=True)
        self._child_ends = (child_conn, stop_r)
        self.late_ticks = 0
        self.gpu: RemoteGpu | None = None
        self.note = ""
        self.loop, self.loop_note = "python", ""  # the child's 10 Hz loop: "c" (ticker.py) or "python"
        self._thread: threading.Thread | None = None

    def launch(self, timeout: float = 30.0) -> tuple[RemoteGpu | None, str]:
        """Start the child and wait for it to say what it found."""
        from gpuwatch.errors import GpuwatchError, UsageError

        # Started with the terminal's signals blocked in this thread: the child inherits the mask
        # through exec, so a Ctrl-C during its start-up cannot kill it before it detaches.
        blocked = hasattr(signal, "pthread_sigmask")
        old = signal.pthread_sigmask(signal.SIG_BLOCK, _GROUP_SIGNALS) if blocked else None
        try:
            self._proc.start()
        finally:
            if blocked:
                signal.pthread_sigmask(signal.SIG_SETMASK, old)
        for c in self._child_ends:  # the child holds its own copies; ours would hide its death
            c.close()
        if not self._conn.poll(timeout):
            self._proc.kill()
            raise GpuwatchError("the sampler process did not start within 30 s")
        _, hello = self._conn.recv()
        if "error" in hello:
            raise (UsageError if hello.get("exit_code") == UsageError.exit_code else GpuwatchError)(hello["error"])
        self.note = hello["note"]
        self.loop, self.loop_note = hello.get("sampler_loop", "python"), hello.get("sampler_loop_note", "")
        self.gpu = RemoteGpu(hello) if hello.get("gpus") else None
        return self.gpu, self.note

    def start(self) -> None:
        self._thread = start_thread(self._receive, "gpuwatch-sampler-rx")

    def _receive(self) -> None:
        while True:
            try:
                item = self._conn.recv()
            except (EOFError, OSError):
                if not self._stopping.is_set():
                    self._proc.join(timeout=1)
                    code = self._proc.exitcode
                    how = ("still running" if code is None else
                           f"killed by signal {-code}" if code < 0 else f"exit code {code}")
                    self.bus.emit("sampler_error", f"the sampler process died ({how}); no more samples",
                                  "error", exitcode=code)
                return
            if isinstance(item, Event):
                self.bus.events.append(item)
            elif isinstance(item, tuple) and item[0] == "bye":
                self.late_ticks = item[1]["late_ticks"]
                return
            elif isinstance(item, list):
                for t in item:
                    self.bus.ticks.append(t)
                if self.on_delivery is not None:
                    self.on_delivery()
            else:
                self.bus.ticks.append(item)

    def stop(self) -> None:
        self._stopping.set()
        try:
            self._stop_w.send(b"stop")
        except (OSError, ValueError):  # the child is already gone, or stop() ran before
            pass
        if self._thread:
            self._thread.join(timeout=5)
        self._proc.join(timeout=5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=5)
        for c in (self._stop_w, self._conn):
            try:
                c.close()
            except OSError:
                pass
