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
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
from dataclasses import asdict
from typing import Any, Callable

from gpuwatch.telemetry.bus import Bus, Event, Tick
from gpuwatch.telemetry.nvml import GpuInfo
from gpuwatch.threads import set_native_name, start_thread


class _PipeChannel:
    """What the Sampler appends ticks to, in the child: sends them to the parent, `deliver_n` at a time."""

    def __init__(self, conn, stop, deliver_n: int = 1) -> None:
        self.conn, self.stop, self.deliver_n = conn, stop, deliver_n
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
            self.conn.send(item)
        except (BrokenPipeError, EOFError, OSError):  # the parent is gone: stop sampling
            self.stop.set()


class _PipeBus:
    """What the Sampler needs of a Bus, forwarding to the parent."""

    def __init__(self, conn, stop, deliver_n: int) -> None:
        self.ticks = _PipeChannel(conn, stop, deliver_n)

    def emit(self, kind, message, severity="info", gpu=None, **detail) -> None:
        self.ticks.append(Event(kind, message, severity, gpu, detail))


def _child(conn, stop, factory: Callable[[], tuple[Any, str]], interval: float, slow_interval: float,
           pid: int, deliver_s: float = 0.0) -> None:
    set_native_name("gw-sampler-proc")
    from gpuwatch.telemetry.host import HostSampler
    from gpuwatch.telemetry.sampler import Sampler

    try:
        gpu, note = factory()
    except Exception as e:  # e.g. a replay source that cannot be opened
        conn.send(("hello", {"error": str(e)}))
        return
    conn.send(("hello", {"note": note, "kind": getattr(gpu, "kind", None), "label": getattr(gpu, "label", None),
                         "driver_version": getattr(gpu, "driver_version", None),
                         "gpus": [asdict(g) for g in gpu.gpus] if gpu else []}))
    bus = _PipeBus(conn, stop, max(1, round(deliver_s / interval)))
    s = Sampler(bus, gpu, HostSampler(pid), interval=interval, slow_interval=slow_interval)
    s.start()
    # A killed parent shows as a broken pipe at the next send (which sets `stop`) or a new parent pid.
    while not stop.wait(2.0):
        if os.getppid() != pid:
            break
    s.stop()
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
                 slow_interval: float = 1.0, deliver_s: float = 0.0) -> None:
        """`factory`: a picklable callable that builds the GPU backend in the child and returns
        (backend or None, a one-line note); `gpuwatch.recording.backends.BackendFactory`."""
        self.bus, self.interval = bus, interval
        self.on_delivery: Callable[[], None] | None = None  # called after each batch of ticks arrives
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe(duplex=False)
        self._stop = ctx.Event()
        self._proc = ctx.Process(target=_child, name="gpuwatch-sampler",
                                 args=(child_conn, self._stop, factory, interval, slow_interval, os.getpid(), deliver_s),
                                 daemon=True)
        self.late_ticks = 0
        self.gpu: RemoteGpu | None = None
        self.note = ""
        self._thread: threading.Thread | None = None

    def launch(self, timeout: float = 30.0) -> tuple[RemoteGpu | None, str]:
        """Start the child and wait for it to say what it found."""
        from gpuwatch.errors import GpuwatchError

        self._proc.start()
        if not self._conn.poll(timeout):
            self._proc.kill()
            raise GpuwatchError("the sampler process did not start within 30 s")
        _, hello = self._conn.recv()
        if "error" in hello:
            raise GpuwatchError(hello["error"])
        self.note = hello["note"]
        self.gpu = RemoteGpu(hello) if hello.get("gpus") else None
        return self.gpu, self.note

    def start(self) -> None:
        self._thread = start_thread(self._receive, "gpuwatch-sampler-rx")

    def _receive(self) -> None:
        while True:
            try:
                item = self._conn.recv()
            except (EOFError, OSError):
                if not self._stop.is_set():
                    self.bus.emit("recorder_error", "the sampler process died; no more samples", "error")
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
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
        self._proc.join(timeout=5)
        if self._proc.is_alive():
            self._proc.kill()
