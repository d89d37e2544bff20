"""From recorded sessions to labelled windows: every scored moment of every GPU, its features (the
one feature function, over windows cut by the replay source exactly as replay shows them) and its
label per failure kind.

Labels (per GPU, kind "oom"): a window ending at t is
- positive when an OOM at t_f follows with t_f - horizon <= t <= the end of the last step that
  finished before it (that is when the failing step began: a guard acting then still saves it, so
  the minimum warning is one step of the run);
- dropped between that moment and the OOM (too late to act: neither positive nor negative), and from
  an OOM until its recovery (`oom_recovered`) or, without one, the next finished step;
- negative otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import polars as pl

from gpuwatch.errors import RecordingError
from gpuwatch.predict.features import NAMES, features, vector
from gpuwatch.recording.source import ReplaySource

HORIZON_S = 5.0
KIND = "oom"


@dataclass
class Timeline:
    """One GPU of one session: the scored moments, their features, labels and what happened."""

    session: str
    scenario: str
    gpu: int | None
    ts_us: np.ndarray  # scored moments
    X: np.ndarray  # features, NAMES order
    y: np.ndarray  # 1 positive, 0 negative, -1 dropped
    failures: np.ndarray  # OOM times (us)
    warn_end: np.ndarray  # per failure: the last moment a guard could act (us)
    step_ts: np.ndarray  # finished steps' times (us), for lead times in steps
    interval_s: float = 0.1
    meta: dict[str, Any] = field(default_factory=dict)
    source: str = ""  # the recorded session it comes from (itself, unless derived)
    derived: bool = False  # a counterfactual-cap copy: training only, never evaluated

    def __post_init__(self) -> None:
        self.source = self.source or self.session


def scenario_of(meta: dict[str, Any]) -> str:
    """What kind of run a session was, from its meta.json (for leave-one-scenario-out evaluation)."""
    cfg = meta.get("config") if isinstance(meta.get("config"), dict) else {}
    loads = cfg.get("workloads") or []
    if not loads:
        return "watch"
    w = loads[0]
    f = w.get("faults") or {}
    if f.get("leak_mib"):
        return "leak"
    if f.get("fragment"):
        return "fragment"
    if f.get("fp16_overflow"):
        return "fp16-overflow"
    if w.get("schedule") in ("ramp", "sweep", "soak", "long"):
        return f"{w['schedule']}-{w.get('mode')}"
    if f.get("memory_limit_bytes"):
        return f"nearcap-{w.get('mode')}"
    argv = " ".join(str(a) for a in meta.get("argv") or [])
    if "bench_workload.py oom" in argv:
        return "oom-inject"
    return f"steady-{w.get('mode')}"


def label(ts: np.ndarray, failures: np.ndarray, warn_end: np.ndarray, recover_end: np.ndarray,
          horizon_s: float = HORIZON_S) -> np.ndarray:
    """Labels for moments `ts` (us) given failures, their last actionable moments and the end of
    their recovery (all us, same length). Pure numpy, tested on hand-built timelines."""
    y = np.zeros(ts.size, dtype=np.int8)
    h = int(horizon_s * 1e6)
    for tf, we, re_ in zip(failures, warn_end, recover_end):
        y[(ts >= tf - h) & (ts <= we) & (y != -1)] = 1
    for tf, we, re_ in zip(failures, warn_end, recover_end):
        y[(ts > we) & (ts <= re_)] = -1
    return y


def failure_marks(steps_ts: np.ndarray, events: pl.DataFrame, gpu: int | None, kind: str = KIND
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(failure times, last actionable moment, end of recovery) for one GPU's `kind` events."""
    ev = events.filter(pl.col("gpu").is_null() | (pl.col("gpu") == gpu)) if gpu is not None else events
    f = ev.filter(pl.col("kind") == kind)["ts"].dt.epoch("us").to_numpy()
    rec = ev.filter(pl.col("kind") == f"{kind}_recovered")["ts"].dt.epoch("us").to_numpy()
    warn, rend = np.empty(f.size, dtype=np.int64), np.empty(f.size, dtype=np.int64)
    for i, tf in enumerate(f):
        before = steps_ts[steps_ts < tf]
        warn[i] = before[-1] if before.size else tf - 1
        after_rec = rec[rec >= tf]
        after_step = steps_ts[steps_ts > tf]
        rend[i] = after_rec[0] if after_rec.size else (after_step[0] if after_step.size else tf + int(5e6))
    return f.astype(np.int64), warn, rend


def plan_changes(steps: pl.DataFrame) -> np.ndarray:
    """The moments a step ended planning a different next step (batch, length or precision): live, the
    guard rescores the plan right there, between the steps, so training and evaluation score those
    moments too, whatever the stride."""
    if not steps.height or "next_batch" not in steps.columns:
        return np.empty(0, dtype=np.int64)
    changed = ((steps["next_batch"] != steps["batch"]) | (steps["next_seq_len"] != steps["seq_len"])
               | (steps["next_precision"] != steps["precision"])).fill_null(False).to_numpy()
    return steps["ts"].dt.epoch("us").to_numpy()[changed].astype(np.int64)


def session_timelines(path: Path | str | ReplaySource, stride: int = 1, horizon_s: float = HORIZON_S,
                      feature_fn: Callable = features) -> list[Timeline]:
    """Every GPU of one recorded session (a folder, or the session already opened), scored at every
    `stride`-th sample."""
    src = path if isinstance(path, ReplaySource) else ReplaySource(path)
    meta = src.reader.meta
    out = []
    for g in [m.index for m in src.gpus] or [None]:
        ts_all = src.times(g)
        if ts_all is None or not ts_all.size:
            continue
        steps = src.steps_df.filter(pl.col("gpu") == g) if g is not None else src.steps_df
        steps_ts = steps["ts"].dt.epoch("us").to_numpy()
        ts = np.union1d(ts_all[::stride], plan_changes(steps))
        X = np.array([vector(feature_fn(src.window_at(g, int(t)))) for t in ts], dtype=np.float64)
        f, warn, rend = failure_marks(steps_ts, src.events_df, g)
        d = meta.get("derived") if isinstance(meta.get("derived"), dict) else None
        out.append(Timeline(src.reader.path.name, d.get("scenario", "") if d else scenario_of(meta), g,
                            ts.astype(np.int64), X, label(ts, f, warn, rend, horizon_s), f, warn, steps_ts,
                            src.interval_s, meta, source=str(d.get("from", "")) if d else "", derived=bool(d)))
    return out


def default_sessions(root: Path) -> list[Path]:
    """The shipped real H200 sessions: recordings/sample-h200-* and the recordings/h200-oom-* dataset."""
    recs = root / "recordings"
    found = sorted(p for p in recs.glob("sample-h200-*") if p.is_dir())
    for ds in sorted(recs.glob("h200-*")):
        found += sorted(p for p in ds.iterdir() if p.is_dir() and (p / "meta.json").exists())
    return found


def load_sessions(paths: Iterable[Path], stride: int = 1, progress: Callable[[str], None] | None = None,
                  horizon_s: float = HORIZON_S, counterfactual: Path | None = None,
                  feature_fn: Callable | None = None) -> tuple[list[Timeline], list[str]]:
    """Timelines of every usable session (predict/usable.py); one that is not is left out, said in one
    line beginning "skipped: " among the warnings. With `counterfactual` (a folder), each session's
    counterfactual-cap copies are derived there and loaded too, marked `derived`
    (predict/counterfactual.py). `feature_fn`: the feature function's stand-in (evaluation with a model's
    shape library: `functools.partial(features, prior=...)`)."""
    out, warnings = [], []
    for i, p in enumerate(paths):
        tls, derived, said, line = load_one(Path(p), stride, horizon_s,
                                            None if counterfactual is None else Path(counterfactual) / f"{i:05d}",
                                            feature_fn)
        out += tls + derived
        warnings += said
        if progress and line:
            progress(line)
    return out, warnings


def load_one(p: Path, stride: int, horizon_s: float, counterfactual: Path | None, feature_fn: Callable | None
             ) -> tuple[list[Timeline], list[Timeline], list[str], str | None]:
    """One session's (timelines, counterfactual copies' timelines, warnings, progress line); an unusable
    session gives no timelines and its one "skipped: " line. Its copies go under `counterfactual`, a
    folder of its own (two sessions of one name never share it)."""
    from gpuwatch.predict.counterfactual import derive
    from gpuwatch.predict.usable import Unusable, open_usable

    ff = {"feature_fn": feature_fn} if feature_fn is not None else {}
    try:
        tls = session_timelines(open_usable(p), stride, horizon_s, **ff)
    except Unusable as e:
        return [], [], [f"skipped: {e}"], None
    except (RecordingError, pl.exceptions.PolarsError, ValueError) as e:
        return [], [], [f"skipped: {_why_unusable(p, e)}"], None
    derived: list[Timeline] = []
    warnings: list[str] = []
    if counterfactual is not None and tls:
        try:
            for r in derive(p, counterfactual, tls[0].scenario):
                derived += session_timelines(r.path, stride, horizon_s, **ff)
        except (RecordingError, pl.exceptions.PolarsError, ValueError, OSError) as e:
            warnings.append(f"{p.name}: no counterfactual copies ({_why_unusable(p, e)})")
            derived = []
    n = len({t.session for t in derived})
    return tls, derived, warnings, (f"{p.name}: {sum(t.ts_us.size for t in tls)} windows"
                                    + (f", {n} counterfactual-cap copies" if n else ""))


def _why_unusable(p: Path, e: Exception) -> str:
    """One line for a session that cannot be cut into windows (a retyped or truncated table, say)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text if str(p) in text else f"{p}: unusable for training ({text[:160]})"


def _step_s(t: Timeline) -> float:
    return float(np.median(np.diff(t.ts_us))) / 1e6 if t.ts_us.size > 1 else t.interval_s


def describe(timelines: list[Timeline]) -> dict[str, Any]:
    real = [t for t in timelines if not t.derived]
    der = [t for t in timelines if t.derived]
    return {"sessions": len({t.session for t in real}), "windows": int(sum(t.y.size for t in real)),
            "positives": int(sum((t.y == 1).sum() for t in real)),
            "failures": int(sum(t.failures.size for t in real)),
            "healthy_minutes": round(sum(float((t.y == 0).sum()) * _step_s(t) for t in real) / 60, 1),
            "derived_sessions": len({t.session for t in der}), "derived_windows": int(sum(t.y.size for t in der)),
            "derived_failures": int(sum(t.failures.size for t in der)),
            "scenarios": sorted({t.scenario for t in timelines}), "features": list(NAMES)}
