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
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from gpuwatch import __version__
from gpuwatch.contract import SessionWorkload
from gpuwatch.control.policy import GuardConfig
from gpuwatch.errors import GpuwatchError
from gpuwatch.recording.backends import BackendFactory, make_gpu_backend
from gpuwatch.recording.source import LiveSource
from gpuwatch.recording.window import GpuMeta
from gpuwatch.resume import ResumeMismatch, ResumePoint, restore_workloads, resume_entry, resumed_event
from gpuwatch.telemetry.bus import Bus, Event
from gpuwatch.telemetry.host import HostSampler
from gpuwatch.telemetry.sampler import Sampler
from gpuwatch.units import fmt_bytes
from gpuwatch.waiting import signals_deferred, wait_until
from gpuwatch.workload.factory import WorkloadSpec

if TYPE_CHECKING:  # built lazily (each import costs time, or pulls in scikit-learn)
    from gpuwatch.control.guard import Guard
    from gpuwatch.export.prometheus import PrometheusExporter
    from gpuwatch.predict.scorer import LiveScorer
    from gpuwatch.recording.writer import Recorder
    from gpuwatch.telemetry.sampler_process import SamplerProcess


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
    gpus: tuple[int, ...] | None = None  # sample only these GPU indices (NVML's; a replay's recorded); None: all
    sampler: str = "process"  # "process" (default: immune to the GIL) or "thread"
    deliver_s: float = 0.0  # process sampler: hand ticks over this many seconds at a time (0 = each)
    name: str | None = None  # the session folder's name (default: UTC start + host)
    workload: WorkloadSpec | None = None
    model: ModelChoice = field(default_factory=ModelChoice)
    guard: GuardConfig = field(default_factory=GuardConfig)
    prometheus: tuple[str, int] | None = None
    score_hz: float | None = None  # default: 5 Hz with a workload (the guard reads it), else 2 Hz
    resume: ResumePoint | None = None  # continue this interrupted session (record_dir/name is its folder)


class Session:
    """One monitored run. Build it, then `with session:` (or start()/stop()) runs it on background
    threads; `wait()` blocks the caller until a deadline, a signal or the workloads finish."""

    def __init__(self, config: SessionConfig | None = None, bus: Bus | None = None,
                 on_status: Callable[[str], None] | None = None, workload_factory: Callable | None = None,
                 workloads: Callable[[Bus, Callable], list] | None = None) -> None:
        """`workload_factory(spec, bus, nvml_index) -> [Workload]` replaces the default
        (`gpuwatch.workload.factory.make_workloads`): the data-parallel ranks' workloads (`stress --nproc`).
        `workloads(bus, nvml_index) -> [GuardedWorkload]`: workloads driven from outside (the library loop
        around a user's training loop), guarded and recorded like gpuwatch's own."""
        self.config = cfg = config or SessionConfig()
        self._workload_factory = workload_factory
        self._external = workloads
        self.bus = bus or Bus()
        self._say = on_status or (lambda _msg: None)
        self.workloads: list[SessionWorkload] = []
        self.recorder: Recorder | None = None
        self.scorer: LiveScorer | None = None
        self.guard: Guard | None = None
        self.exporter: PrometheusExporter | None = None
        self.model_note = "no risk model"
        self._started = self._stopped = False
        self.sampler: Sampler | SamplerProcess | None = None
        self.gpu: Any = None  # the GPU backend (telemetry.sampler.GpuBackend), None without a GPU
        # events of the assembly itself (no_gpu): held until the recorder exists (it reads the bus from its
        # creation on), then put on the bus with their own time stamps; see _emit_early / _flush_early
        self._early: list[Event] | None = []
        try:
            self._assemble(cfg)
        except BaseException:
            self._flush_early()
            self.stop()
            raise

    # -- assembly ---------------------------------------------------------------------------------------
    def _assemble(self, cfg: SessionConfig) -> None:
        model = self._load_model(cfg)  # before the sampler starts: loading scikit-learn takes a second
        first_tick = cfg.resume.next_tick if cfg.resume is not None else 0  # ticks stay unique per session
        self.host = HostSampler()
        if cfg.sampler == "process":
            from gpuwatch.telemetry.sampler_process import SamplerProcess

            proc = SamplerProcess(self.bus, BackendFactory(cfg.source, cfg.gpus), cfg.interval_s,
                                  deliver_s=cfg.deliver_s, first_tick=first_tick)
            self.sampler = proc
            self.gpu, self.gpu_note = proc.launch()
        else:
            self.gpu, self.gpu_note = make_gpu_backend(cfg.source, cfg.gpus)
            self.sampler = Sampler(self.bus, self.gpu, self.host, interval=cfg.interval_s, first_tick=first_tick)
        if self.gpu is None:
            self._emit_early("no_gpu", self.gpu_note, "warning")
        if cfg.workload is not None:
            self._say("loading torch and building the workload...")
            from gpuwatch.workload.factory import make_workloads

            self.workloads = (self._workload_factory or make_workloads)(cfg.workload, self.bus, self._nvml_index)
        elif self._external is not None:
            self.workloads = list(self._external(self.bus, self._nvml_index))
        self.resumed_after_s = 0.0  # run time before this process (a resumed session), for --duration
        if cfg.resume is not None:
            self._restore(cfg.resume)
        from gpuwatch.predict.features import SAMPLE_COLUMNS

        self.source = LiveSource(self.bus, self.gpu_meta(), (self.gpu.label if self.gpu is not None else None) or "CPU-only",
                                 interval_s=cfg.interval_s, sample_columns=SAMPLE_COLUMNS)
        if cfg.record_dir is not None:
            from gpuwatch.recording.writer import Recorder

            rec = self.recorder = Recorder(self.bus, cfg.record_dir, self.meta(), name=cfg.name,
                                           resume=resume_entry(cfg.resume, self.workloads) if cfg.resume is not None else None)
            if cfg.sampler == "process" and cfg.deliver_s > 0:
                self.sampler.on_delivery = rec.kick  # type: ignore[union-attr]  # the process sampler's
                rec.wait_s = 2 * max(cfg.deliver_s, rec.flush_interval)
        self._flush_early()  # the recorder (if any) reads the bus now
        self._make_scorer(cfg, model)
        if cfg.prometheus is not None:
            from gpuwatch.export.prometheus import PrometheusExporter

            host, port = cfg.prometheus
            self.exporter = PrometheusExporter(self.bus, list(self.gpu.gpus) if self.gpu else [], host, port,
                                               interval_s=cfg.interval_s, workloads=self.source.gpus)

    def _emit_early(self, kind: str, message: str, severity: str = "info", **detail: Any) -> None:
        """An event of the assembly: on the bus at once if the recorder exists (or never will), else held
        until `_flush_early` (a recorder records only what reaches the bus after it is created)."""
        if self._early is None:
            self.bus.emit(kind, message, severity, **detail)
        else:
            self._early.append(Event(kind, message, severity, None, detail))

    def _flush_early(self) -> None:
        """The held events onto the bus, once, in order and with the time they happened."""
        early, self._early = self._early, None
        for ev in early or ():
            self.bus.events.append(ev)

    def _restore(self, point: ResumePoint) -> None:
        """Put each workload back where the interrupted run left it (gpuwatch/resume.py)."""
        try:
            restore_workloads(point, self.workloads)
        except ResumeMismatch as e:
            raise SessionFailed(str(e)) from None
        self.resumed_after_s = point.elapsed_s

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

            limits: dict[int | None, int | None] = {m.index: m.effective_limit_bytes for m in self.source.gpus}
            self.guard = Guard(self.bus, cfg.guard, {w.gpu_index: w for w in self.workloads},
                               model.threshold if model is not None else 1.0,
                               rescore=self.scorer.rescore if self.scorer else None, limits=limits, unable=unable,
                               estimate=self.scorer.estimate if self.scorer else None,
                               snapshot_dir=lambda: self.recorder.dir if self.recorder and not self.recorder.error else None)
            if self.scorer:
                self.scorer.on_risk = self.guard.on_risk

    def _nvml_index(self, ident: dict[str, Any]) -> int | None:
        """The NVML index of a CUDA device, matched by UUID, then PCI bus id (never by CUDA ordinal)."""
        gpus = self.gpu.gpus if self.gpu is not None else []
        for g in gpus:
            if ident.get("uuid") and g.uuid and ident["uuid"].lower() == g.uuid.lower():
                return g.index
        for g in gpus:
            if ident.get("pci_bus_id") and g.pci_bus_id and _bus_id(ident["pci_bus_id"]) == _bus_id(g.pci_bus_id):
                return g.index
        return None

    def _plan(self, gpu: int | None) -> dict[str, Any] | None:
        """The next step a GPU's workload will run (what the model scores), or None."""
        for w in self.workloads:
            if w.gpu_index == gpu:
                if w.past_end():  # no step more, and not the last row's
                    return {"batch": None, "seq_len": None}      # plan either (features)
                p = w.next_plan()
                return None if p is None else p.scored()
        return None

    def gpu_meta(self) -> list[GpuMeta]:
        if self.gpu is None:
            return []
        caps = {w.gpu_index: w.memory_limit_bytes for w in self.workloads}
        desc: dict = {}
        for w in self.workloads:  # the first workload of a GPU, as a replay reads meta.json (recorded_workload)
            if w.gpu_index not in desc:
                desc[w.gpu_index] = w.describe()
        return [GpuMeta(g.index, g.name, g.mem_total_bytes, g.power_limit_w, g.temp_slowdown_c,
                        mem_limit_bytes=caps.get(g.index), pid=os.getpid() if g.index in caps else None,
                        workload=desc.get(g.index))
                for g in self.gpu.gpus]

    def meta(self) -> dict[str, Any]:
        c = self.config
        config = {"interval_s": c.interval_s, "deliver_s": c.deliver_s, "sampler": c.sampler,
                  "workloads": [w.describe() for w in self.workloads],
                  "guard": asdict(c.guard), "source": c.source}
        return {
            "host": socket.gethostname(), "platform": platform.platform(), "pid": os.getpid(),
            "cpu_count": self.host.cores, "gpu_backend": self.gpu.kind if self.gpu else None,
            "sampler": type(self.sampler).__name__,
            "sampler_loop": self.sampler.loop if self.sampler else None,
            "sampler_loop_note": self.sampler.loop_note if self.sampler else None,
            "gpu_note": self.gpu_note, "driver_version": self.gpu.driver_version if self.gpu is not None else None,
            # NVML's memory call (v1/v2): only the in-process NVML backend knows it (the sampler child does not say)
            "memory_api": getattr(self.gpu, "memory_api", None),
            "gpus": [asdict(g) for g in self.gpu.gpus] if self.gpu else [],
            "versions": versions(), "argv": sys.argv, "config": config,
        }

    def status(self) -> SessionStatus:
        """The guard's, the recorder's and each workload's state now, as every front end says it."""
        return session_status(self.model_note, self.guard, self.recorder, self.workloads, self.sampler)

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
            msg, fields = resumed_event(self.config.resume, self.workloads)
            self.bus.emit("session_resumed", msg, **fields)
        if self.sampler is not None:  # (always, once assembled)
            self.sampler.start()
        if self.scorer:
            self.scorer.start()
        for w in self.workloads:
            if self.guard:
                w.guard = self.guard
            w.start()

    def stop(self) -> None:
        """Idempotent, and safe on a half-built session: stops what exists, in dependency order. A signal
        that comes while the recording closes waits until it is closed (`waiting.signals_deferred`); one that
        comes before (a workload slow to stop) acts at once."""
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
            with signals_deferred():
                self.recorder.stop()
        if self.exporter and self._started:
            self.exporter.stop()
        if self.gpu is not None:
            self.gpu.close()

    def ends_in(self, seconds: float | None) -> None:
        """The run ends `seconds` from now (`--duration`): each workload's lookahead stops there
        (predict/ahead.py) - no warning about a ramp's steps the run will not live to take."""
        if seconds is None:
            return
        at = time.time() + seconds
        for w in self.workloads:
            if w.honours_deadline:
                w.ends_at = at
        self.bus.emit("deadline", f"the run ends in {seconds:.0f} s", ends_at=at)  # exact: rows compare with it

    def wait(self, duration_s: float | None = None, until_done: bool = False, poll_s: float = 0.5,
             on_tick: Callable[[], None] | None = None, tick_s: float = 0.0,
             on_hup: Callable[[], None] | None = None) -> str:
        """Block until `duration_s` passes, the workloads finish (`until_done`), or a signal arrives;
        `on_tick()` is called every `tick_s` seconds meanwhile (progress lines), signals still honoured.
        Returns why: "deadline", "done", "SIGINT", "SIGTERM" or "SIGHUP"."""
        done = (lambda: all(w.state in ("finished", "failed", "stopped") for w in self.workloads)) if until_done else None
        return wait_until(time.monotonic() + duration_s if duration_s is not None else None, done, poll_s,
                          on_tick=on_tick, tick_s=tick_s, on_hup=on_hup)


# -- what a run's front ends say about it ---------------------------------------------------------------
@dataclass(frozen=True)
class GuardStatus:
    mode: str
    rule: str
    actions: int
    misses: int
    unable: str | None = None  # why it cannot act (no GPU, no model): said once as an event, shown while it holds
    stopped: dict = field(default_factory=dict)  # workloads the guard stopped, and why

    def panel(self, manual: bool) -> str:
        """The dashboard's risk panel: mode, rule, actions so far, who has control."""
        if self.unable:
            return f"guard {self.mode}: cannot act ({self.unable})"
        return (f"guard {self.mode}/{self.rule}: {self.actions} act, {self.misses} miss"
                + (" (user has control: a hands back)" if manual else ""))

    def progress(self) -> str:
        return f"guard {self.actions} action(s), {self.misses} miss(es)"

    def summary(self) -> str:
        return f"guard ({self.mode}, {self.rule}): {self.actions} action(s), {self.misses} failure(s) not prevented"

    def as_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "rule": self.rule, "actions": self.actions, "misses": self.misses,
                "unable": self.unable, "stopped": self.stopped or None}


@dataclass(frozen=True)
class RecorderStatus:
    dir: Path
    rows: int
    bytes: int
    dropped: int
    error: str | None
    incomplete_reason: str | None
    complete: bool
    resumed: list
    late_ticks: int | None  # the sampler's ticks that started more than one interval late

    @property
    def bad(self) -> str | None:
        """What makes the recording fail a run: its error, else why it is incomplete."""
        return self.error or self.incomplete_reason

    def header(self) -> str:
        """The dashboard's header."""
        return (f"rec {self.rows} rows {fmt_bytes(self.bytes)} dropped {self.dropped} {self.dir.name}"
                if not self.error else f"REC ERROR: {self.error}")

    def progress(self) -> str:
        return f"{self.rows} rows" + (" RECORDER ERROR" if self.error else "")

    def summary(self, late: bool = True) -> str:
        """The line a run ends with (`late`: with the sampler's counts)."""
        counts = f"{self.rows} rows, {self.bytes} bytes" + (f", {self.dropped} dropped, {self.late_ticks} late ticks"
                                                            if late else "")
        return (f"recording: {self.dir} ({counts})" + (f"; ERROR {self.error}" if self.error else "")
                + (f"; INCOMPLETE {self.incomplete_reason}" if late and self.incomplete_reason and not self.error else ""))

    def check(self) -> str:
        """The CI check's message."""
        bad = self.bad
        return f"{self.error or 'INCOMPLETE ' + str(self.incomplete_reason)}" if bad else f"{self.rows} sample rows in {self.dir}"

    def as_json(self) -> dict[str, Any]:
        return {"dir": str(self.dir), "rows": self.rows, "bytes": self.bytes, "dropped": self.dropped,
                "late_ticks": self.late_ticks, "error": self.error, "incomplete_reason": self.incomplete_reason,
                "complete": self.complete, "resumed": self.resumed}


@dataclass(frozen=True)
class WorkloadStatus:
    preset: str
    mode: str
    state: str
    label: str  # "tiny prefill on GPU 0" ("... on CPU" without a GPU): the one name of a workload in every line
    unrecovered: str | None = None
    manual: bool = False  # a user's change overrides the guard until handed back

    @property
    def line(self) -> str:
        """The dashboard's workload line: the label, and the failure that stopped it."""
        return self.label + (f": {self.unrecovered}" if self.unrecovered else "")


def workload_label(preset: str, mode: str, gpu_index: int | None, device_name: str) -> str:
    return f"{preset} {mode} on {f'GPU {gpu_index}' if gpu_index is not None else device_name}"


@dataclass(frozen=True)
class SessionStatus:
    """What the dashboard, the CI lines and a run's summary say about a session, read once (`Session.status()`)."""

    model_note: str
    guard: GuardStatus | None = None
    recorder: RecorderStatus | None = None
    workloads: tuple[WorkloadStatus, ...] = ()

    def guard_panel(self) -> str:
        if self.guard is None:
            return "guard off" if self.workloads else ""
        return self.guard.panel(bool(self.workloads) and self.workloads[0].manual)

    def guard_progress(self) -> str:
        return self.guard.progress() if self.guard is not None else "guard off"

    def recorder_header(self) -> str:
        return self.recorder.header() if self.recorder is not None else "not recording"

    def recorder_progress(self) -> str:
        return self.recorder.progress() if self.recorder is not None else "not recording"


def session_status(model_note: str, guard=None, recorder=None, workloads: Iterable[SessionWorkload] = (),
                   sampler=None) -> SessionStatus:
    """A `SessionStatus` of these parts (a Session's own, or a front end's stand-ins in tests)."""
    g = None if guard is None else GuardStatus(guard.cfg.mode, guard.cfg.label, guard.actions, guard.misses,
                                                guard.unable, dict(guard.stopped))
    r = None if recorder is None else RecorderStatus(
        recorder.dir, recorder.rows, recorder.bytes, recorder.dropped, recorder.error, recorder.incomplete_reason,
        bool(recorder.meta.get("complete")), list(recorder.meta.get("resumed") or []),
        sampler.late_ticks if sampler is not None else None)
    ws = tuple(WorkloadStatus(d["preset"], d["mode"], w.state,
                              workload_label(d["preset"], d["mode"], d.get("gpu_index"), w.device_name),
                              w.unrecovered, w.manual) for w, d in ((w, w.describe()) for w in workloads))
    return SessionStatus(model_note, g, r, ws)


def _bus_id(s: str) -> str:
    """PCI bus ids compare without the domain's width or case: 00000000:1B:00.0 == 0000:1b:00.0."""
    parts = s.strip().lower().split(":")
    if len(parts) == 3:
        try:
            return f"{int(parts[0], 16):x}:{parts[1]}:{parts[2]}"
        except ValueError:
            pass
    return s.strip().lower()


class SessionFailed(GpuwatchError):
    """A runtime fault that ends a run (exit 1)."""


__all__ = ["GuardStatus", "ModelChoice", "RecorderStatus", "Session", "SessionConfig", "SessionFailed",
           "SessionStatus", "WorkloadStatus", "session_status", "versions", "workload_label"]
