"""The sampler in a child process (the default): its timing cannot be disturbed by Python work in the
monitored process (the workload's dispatch, the UI), which holds the GIL for milliseconds at a time.
A thread sampler beside a pure-Python busy thread was measured at p99 359 ms intervals (2 cores);
the child keeps its deadline because it has its own interpreter.

The child runs the same `Sampler` and sends each Tick (and each event: GPU lost, XID) through a pipe;
a receiver thread here appends them to the bus. Timestamps and intervals are taken in the child.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
from dataclasses import asdict
from typing import Any

from gpuwatch.telemetry.bus import Bus, Event
from gpuwatch.telemetry.nvml import GpuInfo


class _PipeChannel:
    def __init__(self, conn, stop) -> None:
        self.conn, self.stop = conn, stop

    def append(self, item) -> None:
        try:
            self.conn.send(item)
        except (BrokenPipeError, EOFError, OSError):  # the parent is gone: stop sampling
            self.stop.set()


class _PipeBus:
    """What the Sampler needs of a Bus, forwarding to the parent."""

    def __init__(self, conn, stop) -> None:
        self.ticks = _PipeChannel(conn, stop)

    def emit(self, kind, message, severity="info", gpu=None, **detail) -> None:
        self.ticks.append(Event(kind, message, severity, gpu, detail))


def _child(conn, stop, source: str | None, interval: float, slow_interval: float, pid: int) -> None:
    from gpuwatch.runtime import make_gpu_backend
    from gpuwatch.telemetry.host import HostSampler
    from gpuwatch.telemetry.sampler import Sampler

    try:
        gpu, note = make_gpu_backend(source)
    except Exception as e:  # e.g. a replay source that cannot be opened
        conn.send(("hello", {"error": str(e)}))
        return
    conn.send(("hello", {"note": note, "kind": getattr(gpu, "kind", None), "label": getattr(gpu, "label", None),
                         "driver_version": getattr(gpu, "driver_version", None),
                         "gpus": [asdict(g) for g in gpu.gpus] if gpu else []}))
    bus = _PipeBus(conn, stop)
    s = Sampler(bus, gpu, HostSampler(pid), interval=interval, slow_interval=slow_interval)
    s.start()
    while not stop.wait(1.0):
        if os.getppid() != pid:  # the parent was killed (kill -9): do not outlive it
            break
    s.stop()
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

    def __init__(self, bus: Bus, source: str | None = None, interval: float = 0.1,
                 slow_interval: float = 1.0) -> None:
        self.bus, self.interval = bus, interval
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe(duplex=False)
        self._stop = ctx.Event()
        self._proc = ctx.Process(target=_child, name="gpuwatch-sampler",
                                 args=(child_conn, self._stop, source, interval, slow_interval, os.getpid()),
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
        self._thread = threading.Thread(target=self._receive, name="gpuwatch-sampler-rx", daemon=True)
        self._thread.start()

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
            else:
                self.bus.ticks.append(item)

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
        self._proc.join(timeout=5)
        if self._proc.is_alive():
            self._proc.kill()
