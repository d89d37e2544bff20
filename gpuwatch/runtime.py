"""The composition root: one `Session` assembles everything a run has - bus, sampler, recorder,
workloads, the live telemetry source, the risk scorer, the guard and the Prometheus exporter - the
same way for `gpuwatch`, `watch`, `stress` and `record`, with no Textual import, so a headless
`stress` scores risk exactly as the dashboard does.

Front ends hand it typed configs (`SessionConfig`, `WorkloadSpec`, `GuardConfig`), never an argparse
Namespace. It is a context manager: whatever fails after the sampler started, the sampler, the
workloads and the recorder are still stopped (and the recording closed).
"""

from __future__ import annotations

import os
import platform
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from gpuwatch import __version__
from gpuwatch.control.policy import GuardConfig
from gpuwatch.errors import GpuwatchError
from gpuwatch.recording.backends import BackendFactory, make_gpu_backend
from gpuwatch.recording.source import GpuMeta, LiveSource
from gpuwatch.telemetry.bus import Bus
from gpuwatch.telemetry.host import HostSampler
from gpuwatch.telemetry.sampler import Sampler
from gpuwatch.workload.factory import WorkloadSpec


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version(), "gpuwatch": __version__}
    for pkg in ("polars", "nvidia-ml-py", "psutil", "textual", "torch", "transformers", "scikit-learn"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


@dataclass(frozen=True)
class ModelChoice:
    """Which failure-risk model scores the session. `path` None = the shipped default (models/)."""

    path: Path | None = None
    enabled: bool = True
    trust: bool = False  # load a model whose hash does not match its manifest (runs its code!)
    threshold: float | None = None  # override the model's alarm threshold (more or less sensitive)


@dataclass(frozen=True)
class SessionConfig:
    interval_s: float = 0.1
    record_dir: Path | None = None
    source: str | None = None  # a recording replayed as if live (labelled REPLAY everywhere)
    sampler: str = "process"  # "process" (default: immune to the GIL) or "thread"
    deliver_s: float = 0.0  # process sampler: hand ticks over this many seconds at a time (0 = each)
    name: str | None = None  # the session folder's name (default: UTC start + host)
    workload: WorkloadSpec | None = None
    model: ModelChoice = field(default_factory=ModelChoice)
    guard: GuardConfig = field(default_factory=GuardConfig)
    prometheus: tuple[str, int] | None = None
    score_hz: float | None = None  # default: 5 Hz with a workload (the guard reads it), else 2 Hz
    resume: "ResumePoint | None" = None  # continue this interrupted session (record_dir/name is its folder)


class Session:
    """One monitored run. Build it, then `with session:` (or start()/stop()) runs it on background
    threads; `wait()` blocks the caller until a deadline, a signal or the workloads finish."""

    def __init__(self, config: SessionConfig | None = None, bus: Bus | None = None,
                 on_status: Callable[[str], None] | None = None, workload_factory: Callable | None = None,
                 workloads: Callable[[Bus, Callable], list] | None = None) -> None:
        """`workload_factory(spec, bus, nvml_index) -> [Workload]` replaces the default
        (`gpuwatch.workload.factory.make_workloads`): benchmarks reuse one built model across runs.
        `workloads(bus, nvml_index) -> [GuardedWorkload]`: workloads driven from outside (the library loop
        around a user's training loop), guarded and recorded like gpuwatch's own."""
        self.config = cfg = config or SessionConfig()
        self._workload_factory = workload_factory
        self._external = workloads
        self.bus = bus or Bus()
        self._say = on_status or (lambda _msg: None)
        self.workloads: list = []
        self.recorder = self.scorer = self.guard = self.exporter = None
        self.model_note = "no risk model"
        self._started = self._stopped = False
        self.sampler = None
        self.gpu = None
        try:
            self._assemble(cfg)
        except BaseException:
            self.stop()
            raise

    # -- assembly ---------------------------------------------------------------------------------------
    def _assemble(self, cfg: SessionConfig) -> None:
        model = self._load_model(cfg)  # before the sampler starts: loading scikit-learn takes a second
        first_tick = cfg.resume.next_tick if cfg.resume is not None else 0  # ticks stay unique per session
        self.host = HostSampler()
        if cfg.sampler == "process":
            from gpuwatch.telemetry.sampler_process import SamplerProcess

            self.sampler = SamplerProcess(self.bus, BackendFactory(cfg.source), cfg.interval_s, deliver_s=cfg.deliver_s,
                                          first_tick=first_tick)
            self.gpu, self.gpu_note = self.sampler.launch()
        else:
            self.gpu, self.gpu_note = make_gpu_backend(cfg.source)
            self.sampler = Sampler(self.bus, self.gpu, self.host, interval=cfg.interval_s, first_tick=first_tick)
        if self.gpu is None:
            self.bus.emit("no_gpu", self.gpu_note, "warning")
        if cfg.workload is not None:
            self._say("loading torch and building the workload...")
            from gpuwatch.workload.factory import make_workloads

            self.workloads = (self._workload_factory or make_workloads)(cfg.workload, self.bus, self._nvml_index)
        elif self._external is not None:
            self.workloads = list(self._external(self.bus, self._nvml_index))
        self.resumed_after_s = 0.0  # run time before this process (a resumed session), for --duration
        if cfg.resume is not None:
            self._restore(cfg.resume)
        self.source = LiveSource(self.bus, self.gpu_meta(), getattr(self.gpu, "label", None) or "CPU-only",
                                 interval_s=cfg.interval_s)
        if cfg.record_dir is not None:
            from gpuwatch.recording.writer import Recorder

            self.recorder = Recorder(self.bus, cfg.record_dir, self.meta(), name=cfg.name,
                                     resume=self._resume_entry() if cfg.resume is not None else None)
            if cfg.sampler == "process" and cfg.deliver_s > 0:
                self.sampler.on_delivery = self.recorder.kick
                self.recorder.wait_s = 2 * max(cfg.deliver_s, self.recorder.flush_interval)
        self._make_scorer(cfg, model)
        if cfg.prometheus is not None:
            from gpuwatch.export.prometheus import PrometheusExporter

            host, port = cfg.prometheus
            self.exporter = PrometheusExporter(self.bus, list(self.gpu.gpus) if self.gpu else [], host, port,
                                               interval_s=cfg.interval_s)

    def _restore(self, point: "ResumePoint") -> None:
        """Put each workload back where the interrupted run left it (step, schedule, precision, counters)."""
        if len(point.workloads) != len(self.workloads):
            raise SessionFailed(f"{point.dir}: the run had {len(point.workloads)} workload(s), this resume "
                                f"builds {len(self.workloads)}")
        for w, rec in zip(self.workloads, point.workloads):
            w.restore_state(rec["state"], rec["history"])
        self.resumed_after_s = point.elapsed_s

    def _resume_entry(self) -> dict[str, Any]:
        from datetime import datetime, timezone

        return {"at": datetime.now(timezone.utc).isoformat(), "after_s": round(self.config.resume.elapsed_s, 3),
                "steps": [w.export_state()["step"] for w in self.workloads], "host": socket.gethostname(),
                "argv": sys.argv, "gpuwatch": __version__}

    def _load_model(self, cfg: SessionConfig):
        if not cfg.model.enabled:
            self.model_note = "risk scoring off"
            return None
        from gpuwatch.predict.model import ModelError, load_model

        try:
            return load_model(cfg.model.path, trust=cfg.model.trust, threshold=cfg.model.threshold)
        except ModelError as e:
            if cfg.model.path is not None:
                raise  # the user asked for this model: a one-line fatal error
            self.model_note = f"no risk model ({e})"
            return None

    def _make_scorer(self, cfg: SessionConfig, model) -> None:
        """The risk model scores every GPU of every session that has one; the guard acts on it. A guard
        that was asked for and cannot act (no GPU, no model) still exists, to say so once."""
        unable = None
        if model is None:
            unable = self.model_note
        elif not self.source.gpus:
            self.model_note = unable = "no GPU: nothing to score"
        else:
            from gpuwatch.predict.scorer import LiveScorer

            self.model_note = f"risk model {model.label}"
            hz = cfg.score_hz or (5.0 if self.workloads else 2.0)
            self.scorer = LiveScorer(self.source, model, self.bus, self._plan, hz=hz)
        if self.workloads and cfg.guard.mode != "off":
            from gpuwatch.control.guard import Guard

            limits = {m.index: m.effective_limit_bytes for m in self.source.gpus}
            self.guard = Guard(self.bus, cfg.guard, {w.gpu_index: w for w in self.workloads},
                               model.threshold if model is not None else 1.0,
                               rescore=self.scorer.rescore if self.scorer else None, limits=limits, unable=unable,
                               snapshot_dir=lambda: self.recorder.dir if self.recorder and not self.recorder.error else None)
            if self.scorer:
                self.scorer.on_risk = self.guard.on_risk

    def _nvml_index(self, ident: dict[str, Any]) -> int | None:
        """The NVML index of a CUDA device, matched by UUID, then PCI bus id (never by CUDA ordinal)."""
        for g in getattr(self.gpu, "gpus", []) or []:
            if ident.get("uuid") and g.uuid and ident["uuid"].lower() == g.uuid.lower():
                return g.index
        for g in getattr(self.gpu, "gpus", []) or []:
            if ident.get("pci_bus_id") and g.pci_bus_id and _bus_id(ident["pci_bus_id"]) == _bus_id(g.pci_bus_id):
                return g.index
        return None

    def _plan(self, gpu: int | None) -> dict[str, Any] | None:
        """The next step a GPU's workload will run (what the model scores), or None."""
        for w in self.workloads:
            if w.gpu_index == gpu:
                p = w.next_plan()
                return None if p is None else p.scored()
        return None

    def gpu_meta(self) -> list[GpuMeta]:
        if self.gpu is None:
            return []
        caps = {w.gpu_index: w.memory_limit_bytes for w in self.workloads}
        return [GpuMeta(g.index, g.name, g.mem_total_bytes, g.power_limit_w, g.temp_slowdown_c,
                        mem_limit_bytes=caps.get(g.index)) for g in self.gpu.gpus]

    def meta(self) -> dict[str, Any]:
        c = self.config
        config = {"interval_s": c.interval_s, "deliver_s": c.deliver_s, "sampler": c.sampler,
                  "workloads": [w.describe() for w in self.workloads],
                  "guard": asdict(c.guard), "source": c.source}
        return {
            "host": socket.gethostname(), "platform": platform.platform(), "pid": os.getpid(),
            "cpu_count": self.host.cores, "gpu_backend": self.gpu.kind if self.gpu else None,
            "sampler": type(self.sampler).__name__,
            "sampler_loop": getattr(self.sampler, "loop", None), "sampler_loop_note": getattr(self.sampler, "loop_note", None),
            "gpu_note": self.gpu_note, "driver_version": getattr(self.gpu, "driver_version", None),
            "memory_api": getattr(self.gpu, "memory_api", None),
            "gpus": [asdict(g) for g in self.gpu.gpus] if self.gpu else [],
            "versions": versions(), "argv": sys.argv, "config": config,
        }

    def attach_workload(self, w) -> None:
        """Add a Workload built elsewhere (benchmarks) before start(); it is recorded in meta.json."""
        if self._started:
            raise RuntimeError("attach workloads before start()")
        self.workloads.append(w)
        if self.recorder:
            self.recorder.meta["config"]["workloads"] = [x.describe() for x in self.workloads]

    @property
    def workload(self):
        """The first workload (the one the dashboard shows and the keys control), or None."""
        return self.workloads[0] if self.workloads else None

    # -- lifecycle --------------------------------------------------------------------------------------
    def __enter__(self) -> "Session":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        if self.recorder:
            self.recorder.start()
        if self.exporter:
            self.exporter.start()
            self._say(f"Prometheus metrics at {self.exporter.url}")
        self.bus.emit("session_start", f"session started: {self.gpu_note}; {self.model_note}")
        if self.config.resume is not None:
            p = self.config.resume
            steps = [w.export_state()["step"] for w in self.workloads]
            self.bus.emit("session_resumed", f"session resumed after {p.elapsed_s:.0f} s of run time, at step "
                          f"{', '.join(map(str, steps))} ({p.previous_close})", after_s=round(p.elapsed_s, 3),
                          steps=steps, previous_close=p.previous_close, resumes=len(p.meta.get("resumed") or []) + 1)
        self.sampler.start()
        if self.scorer:
            self.scorer.start()
        for w in self.workloads:
            if self.guard:
                w.guard = self.guard
            w.start()

    def stop(self) -> None:
        """Idempotent, and safe on a half-built session: stops what exists, in dependency order."""
        if self._stopped:
            return
        self._stopped = True
        for w in self.workloads:
            w.stop(join=False)
        for w in self.workloads:
            w.stop()
        if self.scorer:
            self.scorer.stop()
        if self.sampler is not None:
            self.sampler.stop()
        if self._started:
            self.bus.emit("session_end", "session stopped")
        if self.recorder and self._started:
            self.recorder.stop()
        if self.exporter and self._started:
            self.exporter.stop()
        if self.gpu is not None:
            self.gpu.close()

    def wait(self, duration_s: float | None = None, until_done: bool = False, poll_s: float = 0.5,
             on_tick: Callable[[], None] | None = None, tick_s: float = 0.0) -> str:
        """Block until `duration_s` passes, the workloads finish (`until_done`), or a signal arrives;
        `on_tick()` is called every `tick_s` seconds meanwhile (progress lines), signals still honoured.
        Returns why: "deadline", "done", "SIGINT", "SIGTERM" or "SIGHUP"."""
        done = (lambda: all(w.state in ("finished", "failed", "stopped") for w in self.workloads)) if until_done else None
        return wait_until(time.monotonic() + duration_s if duration_s is not None else None, done, poll_s,
                          on_tick=on_tick, tick_s=tick_s)


def _bus_id(s: str) -> str:
    """PCI bus ids compare without the domain's width or case: 00000000:1B:00.0 == 0000:1b:00.0."""
    parts = s.strip().lower().split(":")
    if len(parts) == 3:
        try:
            return f"{int(parts[0], 16):x}:{parts[1]}:{parts[2]}"
        except ValueError:
            pass
    return s.strip().lower()


SIGNAL_EXIT = {s.name: 128 + s for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}  # 130, 143, 129


def wait_until(deadline: float | None, done=None, poll_s: float = 0.5, on_tick: Callable[[], None] | None = None,
               tick_s: float = 0.0) -> str:
    """Sleep until the deadline, `done()` (checked every `poll_s`) or SIGINT/SIGTERM/SIGHUP (a dropped
    SSH link sends SIGHUP to a foreground run). One wake-up per poll, so a headless run costs nothing
    while it waits. Only the main thread can install handlers; elsewhere signals are left alone.
    `on_tick()` (if given, with `tick_s` > 0) runs every `tick_s` seconds inside the same wait, so the
    handlers stay installed between progress lines; what it raises is not this wait's business."""
    next_tick = time.monotonic() + tick_s if on_tick is not None and tick_s > 0 else None
    stop = threading.Event()
    why = {"sig": None}

    def handler(signum, _frame):
        why["sig"] = signal.Signals(signum).name
        stop.set()
    old = {}
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            old[s] = signal.signal(s, handler)
    try:
        while not stop.is_set():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return "deadline"
            if done is not None and done():
                return "done"
            timeout = left
            if done is not None:
                timeout = poll_s if left is None else min(left, poll_s)
            if next_tick is not None:
                now = time.monotonic()
                if now >= next_tick:
                    try:
                        on_tick()
                    except Exception:  # noqa: BLE001 - a progress line must never end the run
                        pass
                    next_tick = max(next_tick + tick_s, now + tick_s / 2)
                to_tick = max(0.0, next_tick - time.monotonic())
                timeout = to_tick if timeout is None else min(timeout, to_tick)
            stop.wait(timeout if timeout is not None else 3600)
        return why["sig"] or "SIGINT"
    finally:
        for s, h in old.items():
            signal.signal(s, h)


class SessionFailed(GpuwatchError):
    """A runtime fault that ends a run (exit 1)."""


# -- resume: where an interrupted session stopped -------------------------------------------------------
@dataclass
class ResumePoint:
    """What `gpuwatch stress --resume SESSION` continues from, read from the session folder: meta.json,
    the steps and events tables (the schedule's history), the run time so far and the first command."""

    dir: Path
    meta: dict[str, Any]
    argv: list[str]  # the command line the session was first started with, after the program name
    elapsed_s: float  # run time of every earlier part (the gaps between them not counted)
    previous_close: str  # "closed cleanly", or why not (a kill, a reboot: "interrupted")
    workloads: list[dict[str, Any]]  # per recorded workload: gpu, state (Workload.restore_state), history
    unrecovered: list[str] = field(default_factory=list)  # workload_error messages of earlier parts
    next_tick: int = 0  # one past the last tick recorded: the resumed sampler numbers on from there


def _read_table(folder: Path, table: str):
    import polars as pl

    from gpuwatch.errors import RecordingError
    from gpuwatch.recording import schema
    from gpuwatch.recording.reader import read_table_file, table_files

    frames = []
    for p in table_files(folder, table):
        try:
            frames.append(read_table_file(p, table)[1])
        except RecordingError:  # a segment a crash cut short: the reader skips it too
            continue
    return pl.concat(frames, how="vertical_relaxed").sort("ts") if frames else schema.empty(table)


def _last_sample_us(folder: Path) -> int | None:
    from gpuwatch.recording.reader import table_max

    ts = table_max(folder, "samples", "ts")
    return None if ts is None else int(ts.timestamp() * 1e6)


def _next_tick(folder: Path) -> int:
    """One past the highest tick in the session's samples (0 if none can be read)."""
    from gpuwatch.recording.reader import table_max

    top = table_max(folder, "samples", "tick")
    return 0 if top is None else int(top) + 1


def _iso_us(text: Any) -> int | None:
    from datetime import datetime, timezone

    try:
        t = datetime.fromisoformat(str(text))
    except ValueError:
        return None
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    return int(t.timestamp() * 1e6)


def load_resume(path: Path | str) -> ResumePoint:
    """Read where the session at `path` stopped. A folder that is not a gpuwatch session, or one with no
    workload, raises UsageError (one line)."""
    import json
    import math
    import re

    import polars as pl

    from gpuwatch.errors import RecordingError, UsageError
    from gpuwatch.recording.reader import SessionReader

    folder = Path(path)
    if not folder.is_dir() or not (folder / "meta.json").is_file():
        raise UsageError(f"--resume {path}: not a gpuwatch session folder (no meta.json)")
    try:
        meta = SessionReader(folder).meta
    except RecordingError as e:
        raise UsageError(f"--resume {path}: {e}") from None
    loads = (meta.get("config") or {}).get("workloads") or []
    argv = [str(a) for a in meta.get("argv") or []]
    if not loads:
        raise UsageError(f"--resume {path}: this session ran no workload (a watch or record session)")
    if "stress" not in argv[1:2]:
        raise UsageError(f"--resume {path}: not started by `gpuwatch stress` (argv {' '.join(argv[1:3])!r})")
    from gpuwatch.recording.writer import session_locked

    if session_locked(folder):
        raise UsageError(f"--resume {path}: another gpuwatch process is still recording this session")
    steps, events = _read_table(folder, "steps"), _read_table(folder, "events")

    # run time: the earlier parts (meta.resumed) plus the last part, from its session_start event (the
    # wait for --duration begins right after it) to its session_end event, or its last data after a kill
    resumed = [r for r in meta.get("resumed") or [] if isinstance(r, dict)]
    part_start = _iso_us(resumed[-1].get("at")) if resumed else _iso_us(meta.get("start"))
    before = float(resumed[-1].get("after_s") or 0) if resumed else 0.0
    starts = events.filter(pl.col("kind") == "session_start")["ts"]
    if starts.len():
        part_start = max(part_start or 0, int(starts.max().timestamp() * 1e6))
    ends = events.filter(pl.col("kind") == "session_end")["ts"]
    ends = [int(t.timestamp() * 1e6) for t in ends if part_start is None or int(t.timestamp() * 1e6) >= part_start]
    if ends:
        last_us = max(ends)
    else:
        last = [_last_sample_us(folder)]
        for df in (steps, events):
            if df.height:
                last.append(int(df["ts"].max().timestamp() * 1e6))
        last_us = max((x for x in last if x is not None), default=None)
    part = (last_us - part_start) / 1e6 if last_us is not None and part_start is not None else 0.0
    elapsed = before + max(0.0, part)
    if not math.isfinite(elapsed):
        elapsed = before

    out, unrecovered = [], []
    for rec in loads:
        gpu = rec.get("gpu_index")
        same = pl.col("gpu").is_null() if gpu is None else pl.col("gpu") == gpu
        st, ev = steps.filter(same), events.filter(same)
        merged = sorted([(r["ts"], 0, "step", r) for r in st.select("ts", "precision", "batch", "micro_batches").iter_rows(named=True)]
                        + [(r["ts"], 1, r["kind"], r) for r in ev.select("ts", "kind", "detail", "message").iter_rows(named=True)],
                        key=lambda x: (x[0], x[1]))
        history: list[tuple] = []
        state = {"step": int(st["step"].max()) + 1 if st.height else 0, "precision": rec.get("precision"),
                 "ooms": 0, "recovered": 0, "nonfinite": 0, "integrity_failures": 0, "retries": 0, "lost_steps": 0,
                 "last_ok_batch": None}
        oom_batch = None
        for _ts, _o, kind, r in merged:
            if kind == "step":
                history.append(("done",))
                state["precision"] = r["precision"] or state["precision"]
                k = r["micro_batches"] or 1
                state["last_ok_batch"] = -(-int(r["batch"]) // k) if r["batch"] else None
                continue
            try:
                d = json.loads(r["detail"] or "{}")
            except ValueError:
                d = {}
            if kind == "control" and d.get("control") in ("batch", "ceiling", "hold", "seq_len"):
                history.append((d["control"], d.get("value")))
            elif kind == "control" and d.get("control") == "precision":
                state["precision"] = d.get("value") or state["precision"]
            elif kind == "oom":
                state["ooms"] += 1
                oom_batch = d.get("batch")
            elif kind == "oom_recovered":
                state["recovered"] += 1
                if d.get("retried"):
                    state["retries"] += 1
                    if d.get("retry_control") in ("batch", "ceiling") and d.get("retry_value") is not None:
                        history.append((d["retry_control"], int(d["retry_value"])))
                    elif m := re.search(r"\b(batch|ceiling) -> (\d+)", str(d.get("decision") or "")):
                        history.append((m.group(1), int(m.group(2))))  # sessions recorded before the fields
                else:
                    state["lost_steps"] += 1
                    history.append(("oom", oom_batch))
            elif kind == "nonfinite":
                state["nonfinite"] += 1
            elif kind == "integrity_mismatch":
                state["integrity_failures"] += 1
            elif kind == "workload_error":
                unrecovered.append(r["message"])
        out.append({"gpu": gpu, "state": state, "history": history})
    previous = "closed cleanly" if meta.get("complete") else "interrupted"
    return ResumePoint(folder, meta, argv[1:], elapsed, previous, out, unrecovered, _next_tick(folder))
