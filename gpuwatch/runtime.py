"""Wires one gpuwatch session together (bus, sampler, recorder, workload) with no Textual import, so
the same session runs headless (`gpuwatch record`, `gpuwatch stress`) or under the TUI."""

from __future__ import annotations

import platform
import socket
import sys
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any

from gpuwatch import __version__
from gpuwatch.telemetry.bus import Bus
from gpuwatch.telemetry.host import HostSampler
from gpuwatch.recording.backends import BackendFactory, make_gpu_backend
from gpuwatch.telemetry.sampler import Sampler


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version(), "gpuwatch": __version__}
    for pkg in ("polars", "nvidia-ml-py", "psutil", "textual", "torch", "transformers", "scikit-learn"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


class Session:
    """One monitored run: sampler + optional recorder + optional workload, all on background threads."""

    def __init__(self, interval: float = 0.1, record_dir: Path | str | None = None,
                 source: str | None = None, config: dict[str, Any] | None = None,
                 bus: Bus | None = None, name: str | None = None, sampler: str = "process",
                 deliver_s: float = 0.0) -> None:
        """`sampler`: "process" (default; immune to GIL contention here) or "thread".
        `deliver_s`: with the process sampler, hand ticks over this many seconds at a time (0: each
        tick at once, for the dashboard and the guard; a headless recorder uses 1.0, its flush interval)."""
        self.bus = bus or Bus()
        self.host = HostSampler()
        if sampler == "process":
            from gpuwatch.telemetry.sampler_process import SamplerProcess

            self.sampler = SamplerProcess(self.bus, BackendFactory(source), interval, deliver_s=deliver_s)
            self.gpu, self.gpu_note = self.sampler.launch()
        else:
            self.gpu, self.gpu_note = make_gpu_backend(source)
            self.sampler = Sampler(self.bus, self.gpu, self.host, interval=interval)
        self.config = dict(config or {}, interval_s=interval, deliver_s=deliver_s)
        self.workloads: list = []
        self.recorder = None
        if record_dir is not None:
            from gpuwatch.recording.writer import Recorder

            self.recorder = Recorder(self.bus, record_dir, self.meta(), name=name)
            if sampler == "process" and deliver_s > 0:
                self.sampler.on_delivery = self.recorder.kick
                self.recorder.wait_s = 2 * max(deliver_s, self.recorder.flush_interval)
        if self.gpu is None:
            self.bus.emit("no_gpu", self.gpu_note, "warning")

    def meta(self) -> dict[str, Any]:
        return {
            "host": socket.gethostname(), "platform": platform.platform(),
            "cpu_count": self.host.cores, "gpu_backend": self.gpu.kind if self.gpu else None,
            "sampler": type(self.sampler).__name__,
            "gpu_note": self.gpu_note, "driver_version": getattr(self.gpu, "driver_version", None),
            "gpus": [asdict(g) for g in self.gpu.gpus] if self.gpu else [],
            "versions": versions(), "argv": sys.argv, "config": self.config,
        }

    @property
    def workload(self):
        """The first workload (the one the dashboard shows and the keys control), or None."""
        return self.workloads[0] if self.workloads else None

    def attach_workload(self, workload) -> None:
        self.workloads.append(workload)
        self.config["workloads"] = [w.describe() for w in self.workloads]
        if self.recorder:
            self.recorder.meta["config"] = self.config

    def start(self) -> None:
        if self.recorder:
            self.recorder.start()
        self.bus.emit("session_start", f"session started: {self.gpu_note}")
        self.sampler.start()
        for w in self.workloads:
            w.start()

    def stop(self) -> None:
        for w in self.workloads:
            w.stop(join=False)
        for w in self.workloads:
            w.stop()
        self.sampler.stop()
        self.bus.emit("session_end", "session stopped")
        if self.recorder:
            self.recorder.stop()
        if self.gpu is not None:
            self.gpu.close()
