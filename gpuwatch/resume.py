"""Resume: where an interrupted `gpuwatch stress` session stopped, read back from its folder, so
`stress --resume SESSION` continues it instead of starting over.

Everything is read through the recording layer's own rules (`layout.table_files` picks the files every
reader reads, `reader.read_table_file` reads them), so a resume sees exactly the rows a replay shows.
From the steps and the control/OOM events it rebuilds each workload's schedule history (ramp level,
ceiling, counters), which `Workload.restore_state` replays through the same schedule code; the run time
so far is summed over the earlier parts so `--duration` counts the whole run. The session folder is
reopened by the writer (`Recorder(resume=...)`); this module only reads.
"""

from __future__ import annotations

import json
import math
import re
import socket
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import polars as pl

from gpuwatch import __version__
from gpuwatch.errors import RecordingError, UsageError
from gpuwatch.recording import schema
from gpuwatch.recording.layout import session_locked, table_files
from gpuwatch.recording.reader import SessionReader, read_table_file, table_max
from gpuwatch.units import hms


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


def read_table(folder: Path, table: str) -> pl.DataFrame:
    """Every readable row of `table` in a session folder, by time; a file a crash cut short is skipped,
    as the reader skips it."""
    frames = []
    for p in table_files(folder, table):
        try:
            frames.append(read_table_file(p, table)[1])
        except RecordingError:
            continue
    return pl.concat(frames, how="vertical_relaxed").sort("ts") if frames else schema.empty(table)


def next_tick(folder: Path) -> int:
    """One past the highest tick in the session's samples (0 if none can be read)."""
    top = table_max(folder, "samples", "tick")
    return 0 if top is None else int(top) + 1


def _us(t: datetime) -> int:
    return int(t.timestamp() * 1e6)


def _iso_us(text: Any) -> int | None:
    try:
        t = datetime.fromisoformat(str(text))
    except ValueError:
        return None
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    return _us(t)


def _check_session(path: Path | str) -> tuple[Path, dict[str, Any], list[str]]:
    """(folder, meta, argv) of a session `stress --resume` can continue; UsageError (one line) if not."""
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
    if session_locked(folder):
        raise UsageError(f"--resume {path}: another gpuwatch process is still recording this session")
    return folder, meta, argv


def run_time(folder: Path, meta: dict[str, Any], steps: pl.DataFrame, events: pl.DataFrame) -> float:
    """Seconds the session has run: the earlier parts (meta.resumed) plus the last part, from its
    session_start event (the wait for --duration begins right after it) to its session_end event, or
    its last data after a kill."""
    resumed = [r for r in meta.get("resumed") or [] if isinstance(r, dict)]
    part_start = _iso_us(resumed[-1].get("at")) if resumed else _iso_us(meta.get("start"))
    before = float(resumed[-1].get("after_s") or 0) if resumed else 0.0
    starts = events.filter(pl.col("kind") == "session_start")["ts"]
    if starts.len():
        part_start = max(part_start or 0, _us(starts.max()))
    ends = [_us(t) for t in events.filter(pl.col("kind") == "session_end")["ts"]]
    ends = [t for t in ends if part_start is None or t >= part_start]
    if ends:
        last_us = max(ends)
    else:
        last_ts = table_max(folder, "samples", "ts")
        last = [None if last_ts is None else _us(last_ts)]
        last += [_us(df["ts"].max()) for df in (steps, events) if df.height]
        last_us = max((x for x in last if x is not None), default=None)
    part = (last_us - part_start) / 1e6 if last_us is not None and part_start is not None else 0.0
    elapsed = before + max(0.0, part)
    return elapsed if math.isfinite(elapsed) else before


def _history_rows(steps: pl.DataFrame, events: pl.DataFrame) -> list[tuple[str, dict[str, Any]]]:
    """A workload's steps and events merged in time order (a step before an event of the same instant)."""
    merged = sorted([(r["ts"], 0, "step", r) for r in steps.select("ts", "precision", "batch", "micro_batches")
                     .iter_rows(named=True)]
                    + [(r["ts"], 1, r["kind"], r) for r in events.select("ts", "kind", "detail", "message")
                       .iter_rows(named=True)], key=lambda x: (x[0], x[1]))
    return [(kind, r) for _ts, _o, kind, r in merged]


def _replay_event(kind: str, d: dict[str, Any], state: dict[str, Any], history: list[tuple],
                  oom_batch: Any) -> Any:
    """Apply one recorded event to a workload's state and schedule history; returns the batch of the
    last OOM (what a lost step is charged to)."""
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
    return oom_batch


def workload_history(rec: dict[str, Any], steps: pl.DataFrame, events: pl.DataFrame,
                     unrecovered: list[str]) -> dict[str, Any]:
    """One recorded workload (`rec` from meta's config.workloads): its GPU, the state to restore and the
    schedule history to replay; its workload_error messages are appended to `unrecovered`."""
    gpu = rec.get("gpu_index")
    same = pl.col("gpu").is_null() if gpu is None else pl.col("gpu") == gpu
    st, ev = steps.filter(same), events.filter(same)
    history: list[tuple] = []
    state = {"step": int(st["step"].max()) + 1 if st.height else 0, "precision": rec.get("precision"),
             "ooms": 0, "recovered": 0, "nonfinite": 0, "integrity_failures": 0, "retries": 0, "lost_steps": 0,
             "last_ok_batch": None}
    oom_batch = None
    for kind, r in _history_rows(st, ev):
        if kind == "step":
            history.append(("done",))
            state["precision"] = r["precision"] or state["precision"]
            k = r["micro_batches"] or 1
            state["last_ok_batch"] = -(-int(r["batch"]) // k) if r["batch"] else None
            continue
        if kind == "workload_error":
            unrecovered.append(r["message"])
            continue
        try:
            d = json.loads(r["detail"] or "{}")
        except ValueError:
            d = {}
        oom_batch = _replay_event(kind, d, state, history, oom_batch)
    return {"gpu": gpu, "state": state, "history": history}


def load_resume(path: Path | str) -> ResumePoint:
    """Read where the session at `path` stopped. A folder that is not a gpuwatch session, or one with no
    workload, raises UsageError (one line)."""
    folder, meta, argv = _check_session(path)
    steps, events = read_table(folder, "steps"), read_table(folder, "events")
    elapsed = run_time(folder, meta, steps, events)
    unrecovered: list[str] = []
    out = [workload_history(rec, steps, events, unrecovered) for rec in (meta.get("config") or {})["workloads"]]
    previous = "closed cleanly" if meta.get("complete") else "interrupted"
    return ResumePoint(folder, meta, argv[1:], elapsed, previous, out, unrecovered, next_tick(folder))


# -- what the runtime does with a ResumePoint ------------------------------------------------------------------
def restore_workloads(point: ResumePoint, workloads: list) -> None:
    """Put each workload back where the interrupted run left it (step, schedule, precision, counters);
    `ResumeMismatch` when this resume builds a different number of workloads than the run had."""
    if len(point.workloads) != len(workloads):
        raise ResumeMismatch(f"{point.dir}: the run had {len(point.workloads)} workload(s), this resume "
                             f"builds {len(workloads)}")
    for w, rec in zip(workloads, point.workloads):
        w.restore_state(rec["state"], rec["history"])


def resume_entry(point: ResumePoint, workloads: list) -> dict[str, Any]:
    """The entry this part of the run appends to meta.json's `resumed` list."""
    return {"at": datetime.now(timezone.utc).isoformat(), "after_s": round(point.elapsed_s, 3),
            "steps": [w.export_state()["step"] for w in workloads], "host": socket.gethostname(),
            "argv": sys.argv, "gpuwatch": __version__}


def resumed_event(point: ResumePoint, workloads: list) -> tuple[str, dict[str, Any]]:
    """The session_resumed event's message and fields."""
    steps = [w.export_state()["step"] for w in workloads]
    msg = (f"session resumed after {point.elapsed_s:.0f} s of run time, at step {', '.join(map(str, steps))} "
           f"({point.previous_close})")
    return msg, {"after_s": round(point.elapsed_s, 3), "steps": steps, "previous_close": point.previous_close,
                 "resumes": len(point.meta.get("resumed") or []) + 1}


def refuse_finished(point: ResumePoint, duration_s: float | None, steps: int | None) -> None:
    """UsageError for a session whose run is over (its --duration ran, its --steps were done, or it closed
    cleanly with every workload finished): nothing is left to continue, and resuming it again and again
    used to reopen it, run 0 steps and append idle samples and another `resumed` entry each time."""
    if duration_s is not None and point.elapsed_s >= duration_s - 0.5:
        raise UsageError(f"--resume {point.dir}: finished: its --duration {hms(duration_s)} already ran "
                         f"({hms(point.elapsed_s)}); give a longer --duration to run on")
    done = [w["state"]["step"] for w in point.workloads]
    if steps is not None and done and min(done) >= steps:
        raise UsageError(f"--resume {point.dir}: finished: its --steps {steps} already ran; "
                         "give a larger --steps to run on")
    if point.previous_close == "closed cleanly" and duration_s is None and steps is None and \
            _all_finished(point):
        raise UsageError(f"--resume {point.dir}: finished: every workload ran its schedule to the end")


def _all_finished(point: ResumePoint) -> bool:
    """Every workload's last workload_stop event says it finished (its schedule ran out)."""
    from gpuwatch.recording.reader import open_recording

    try:
        ev = open_recording(point.dir).events
    except Exception:  # noqa: BLE001 - load_resume read it already; unreadable here means: not known
        return False
    stops = ev.filter(ev["kind"] == "workload_stop")["message"].to_list()
    return bool(stops) and len(stops) >= len(point.workloads) and \
        all("finished" in m for m in stops[-len(point.workloads):])


class ResumeMismatch(ValueError):
    """The resumed run does not match the recorded one (the runtime turns it into SessionFailed)."""
