"""From typed configs to a running dashboard (live, watch, replay, follow).

A crash inside the app restores the terminal (Textual does), writes the traceback to a log file (the
session's folder when recording, else the user's state folder) and exits 1 with one line naming it.
Without a terminal (stdin from /dev/null, output to a file or a pipe, TERM=dumb) the dashboard is not
started at all: one line says so and the exit code is 2, after the recording to replay was opened (so an
unreadable one is still named) and before any session, sampler or scoring starts.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from pathlib import Path

from gpuwatch.errors import UsageError
from gpuwatch.recording.source import ReplaySource

NO_TERMINAL = "needs an interactive terminal; use `record` or `stress`"
DUMB_TERMS = ("", "dumb", "unknown")


def interactive_terminal() -> bool:
    """The dashboard reads keys from stdin and draws on stderr (Textual's driver), and stdout must not be
    a file collecting its escape codes: all three a terminal, and one that can move the cursor."""
    streams = (sys.stdin, sys.stdout, sys.stderr)
    return all(f is not None and f.isatty() for f in streams) and os.environ.get("TERM", "").strip() not in DUMB_TERMS


def require_terminal(source: str | None = None) -> None:
    """UsageError without a terminal; a recording replayed as live (`watch --source`) that cannot be
    replayed is named first, as `replay` names it (read again only on this refusing path)."""
    if interactive_terminal():
        return
    if source:
        from gpuwatch.recording.replay_backend import ReplayGpuBackend

        ReplayGpuBackend(source)
    raise UsageError(NO_TERMINAL)


def crash_log(exc: BaseException, folder: Path | None = None) -> Path:
    base = folder or Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "gpuwatch"
    try:
        base.mkdir(parents=True, exist_ok=True)
        path = base / f"crash-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}.log"
        path.write_text("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        return path
    except OSError:
        return Path("/dev/stderr")


def _run_app(app, log_folder: Path | None, status) -> int:
    """Run the app; SIGTERM and SIGHUP (the SSH link dropped) end it like `q` does, so the session
    behind it is stopped and its recording closed, and the exit code says which signal it was."""
    import signal

    got: dict[str, int] = {}

    def on_signal(signum, _frame):
        got["code"] = 128 + signum
        app.exit(return_code=128 + signum)
    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        app.run()
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
    if "code" in got:
        status(f"stopped by {signal.Signals(got['code'] - 128).name}")
        return got["code"]
    exc = getattr(app, "crashed", None)
    if exc is not None:
        path = crash_log(exc, log_folder)
        status(f"error: the dashboard crashed ({type(exc).__name__}: {str(exc)[:120]}); traceback in {path}")
        return 1
    return app.return_code or 0


MAX_ON_THE_FLY = 1500  # windows scored when replaying a session recorded without risk (~3 s)
FIRST_PASS = 150  # a first, coarse pass so that the plot and the panel fill in within a second or two


def needs_scoring(source: ReplaySource) -> bool:
    return not source.follow and source.risk_df.is_empty() and bool(source.gpus)


def score_in_background(source: ReplaySource, model_path: Path | None, trust: bool, status=None,
                        model=None) -> threading.Thread | None:
    """A session recorded without risk (older, or without a model): the replay opens at once and the
    risk is scored on a thread with the model at hand - a coarse pass first, then every k-th sample -
    each pass handed to the source as it finishes; the risk panel says which it shows."""
    if not needs_scoring(source):
        return None
    source.risk_note = "scoring risk in the background..."

    def work() -> None:
        from gpuwatch.predict.model import ModelError, load_model
        from gpuwatch.predict.scorer import score_source

        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)  # the screen comes first
        except (AttributeError, OSError):
            pass
        try:
            m = model or load_model(model_path, trust=trust)
        except ModelError as e:
            source.risk_note = f"no risk shown: {e}"
            source.touch()
            if status:
                status(f"no risk shown: {e}")
            return
        n = int(source.ticks_ts.size)
        for i, budget in enumerate((FIRST_PASS, MAX_ON_THE_FLY)):
            stride = max(1, -(-n // budget))
            last = i == 1 or stride == 1
            note = f"scored on the fly by {m.label}" if last else \
                f"scored on the fly by {m.label}, coarse (every {stride} samples); refining..."
            try:
                source.set_risk(score_source(source, m, stride=stride), note)
            except Exception as e:  # noqa: BLE001 - the replay goes on; the panel says why risk is missing
                source.risk_note = f"risk scoring failed: {type(e).__name__}: {e}"
                source.touch()
                return
            if last:
                return
    t = threading.Thread(target=work, name="gpuwatch-score", daemon=True)
    t.start()
    return t


def run_replay(path: Path, follow: bool = False, speed: float = 1.0, status=None, model: Path | None = None,
               trust: bool = False, no_model: bool = False) -> int:
    from gpuwatch.ui.app import make_app

    status = status or (lambda m: print(f"gpuwatch: {m}", file=sys.stderr))
    source = ReplaySource(path, follow=follow, speed=speed)
    require_terminal()
    loaded = None
    unused = None
    if not no_model and model is not None:
        from gpuwatch.predict.model import load_model

        loaded = load_model(model, trust=trust)  # a model the user named: a bad one is a one-line error, always
        if not needs_scoring(source):  # (a new user's missing model went unsaid on a session with its risk)
            unused = (f"--model {model} not used: this session's {'risk as recorded' if not follow else 'live risk'}"
                      " is shown (the model scores only sessions recorded without risk)")
    if not no_model:
        score_in_background(source, model, trust, None, model=loaded)
    for w in source.reader.warnings:  # skipped files: said after the screen closes, and shown in it
        status(f"warning: {w}")
    if unused:
        status(f"warning: {unused}")
    app = make_app(source)
    notes = ([unused] if unused else []) + list(source.reader.warnings)
    why = getattr(source.reader, "incomplete_reason", None)
    if why and not follow:
        notes.insert(0, why)
    if notes:  # one notification, not a stack of them over the screen
        app.call_later(lambda: app.notify("\n".join(notes), severity="warning", timeout=15))
    return _run_app(app, None, status)


class _NullBus:
    """A placeholder until the session's bus exists (the feed is read before the session starts)."""


def attach_feed(session, feed) -> None:
    """Feed a replayed-as-live session what its recording holds besides GPU samples; its GPUs take the
    recorded workload caps, its label the recorded host."""
    from dataclasses import replace

    feed.bus = session.bus
    src = session.source
    src.feed = feed
    src.gpus[:] = [replace(g, mem_limit_bytes=feed.caps.get(g.index) or g.mem_limit_bytes) for g in src.gpus]
    exporter = getattr(session, "exporter", None)
    if exporter is not None:  # --prometheus exports what the session recorded, labelled with its host
        exporter.collector.host_override = lambda: feed.host_row
        if feed.host:
            exporter.collector.hostname = feed.host
    if feed.host:
        src.label = src.label.replace(" (not live)", f" from {feed.host} (not live)") \
            if "(not live)" in src.label else f"{src.label} from {feed.host}"
    if feed.has_risk:
        session.model_note = "risk as recorded"


def run_tui(cfg, duration_s: float | None = None, status=None) -> int:
    from gpuwatch.runtime import Session
    from gpuwatch.ui.app import make_app

    status = status or (lambda m: print(f"gpuwatch: {m}", file=sys.stderr))
    feed = None
    if cfg.source and cfg.workload is None:  # watch --source: the recording's steps, events, risk and host too
        from dataclasses import replace

        from gpuwatch.recording.source import RecordedFeed

        feed = RecordedFeed(_NullBus(), cfg.source)
        if feed.has_risk:  # show the risk that was live then, not a second scoring beside it
            cfg = replace(cfg, model=replace(cfg.model, enabled=False))
    require_terminal(cfg.source)
    with Session(cfg, on_status=status) as session:
        if feed is not None:
            attach_feed(session, feed)
        app = make_app(session.source, session=session, interval_s=cfg.interval_s)
        if duration_s:  # the run's end, told to the workloads when the exit timer starts
            app.call_later(lambda: (session.ends_in(duration_s), app.set_timer(duration_s, app.exit)))
        code = _run_app(app, session.recorder.dir if session.recorder else None, status)
    if session.recorder:
        status(session.status().recorder.summary(late=False))
    return code
