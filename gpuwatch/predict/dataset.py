"""From recorded sessions to labelled windows: every scored moment of every GPU, its features (the
one feature function, over windows cut by the replay source exactly as replay shows them) and its
label per failure kind.

Labels (per GPU, kind "oom"): a window ending at t is
- positive when an OOM at t_f follows with t_f - horizon <= t <= the last moment before the failing
  attempt began: the end of the last step that finished before it, or, where the workload started or
  recovered from an OOM since, that moment (a guard acting then still saves it, so the minimum warning
  is one step of the run; an attempt that fails before any step ran is warned only before it began);
- dropped between that moment and the OOM (too late to act: neither positive nor negative), and from
  an OOM until its recovery (`oom_recovered`) or, without one, the next finished step;
- negative otherwise.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import polars as pl

from gpuwatch.errors import RecordingError, UsageError
from gpuwatch.predict.features import NAMES, features, vector
from gpuwatch.recording.reader import SessionReader
from gpuwatch.recording.source import ReplaySource

HORIZON_S = 5.0
KIND = "oom"
# The features evaluation reads of every window (predict/evaluate.py: the baselines, the estimator's part, "near
# the limit"): all a recorded timeline keeps of them where its windows wait on disk (`on_disk`, `Timeline.cols`).
EVAL_COLUMNS = ("mem_used_frac", "mem_headroom_gib", "time_to_full_s", "next_peak_est_frac", "peak_cross_p",
                "ahead_cross_p", "trend_cross_p", "ahead_peak_est_frac")


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
    w: np.ndarray | None = None  # per window, how many it stands for in the fit (predict/sampling.py); None: 1 each
    whole: dict[str, Any] | None = None  # `compacted`: what the timeline held before (for `describe`)
    inf: np.ndarray | None = None  # per window, informative (predict/sampling.py: always kept); None: not known
    shard: Path | None = None  # `on_disk`: its fit's rows are in this file (predict/budget.py), none held here
    windows: Path | None = None  # `on_disk` for evaluation: every window's features in this file (predict/shards.py)
    cols: dict[str, np.ndarray] | None = None  # ... and of them only what evaluation reads (EVAL_COLUMNS)

    def __post_init__(self) -> None:
        self.source = self.source or self.session


def scenario_of(meta: dict[str, Any]) -> str:
    """What kind of run a session was, from its meta.json (for leave-one-scenario-out evaluation)."""
    raw = meta.get("config")
    cfg = raw if isinstance(raw, dict) else {}
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
    began = np.union1d(np.union1d(steps_ts, rec), ev.filter(pl.col("kind") == "workload_start")["ts"].dt.epoch("us")
                       .to_numpy()).astype(np.int64)  # the moments an attempt could begin after
    warn, rend = np.empty(f.size, dtype=np.int64), np.empty(f.size, dtype=np.int64)
    for i, tf in enumerate(f):
        before = began[began < tf]
        warn[i] = before[-1] if before.size else tf - 1  # an old recording without its start: to the failure
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
                      feature_fn: Callable = features, sample: bool = False) -> list[Timeline]:
    """Every GPU of one recorded session (a folder, or the session already opened), scored at every
    `stride`-th sample; with `sample`, each window's weight in the fit (`sampled`)."""
    src = path if isinstance(path, ReplaySource) else ReplaySource(path)
    meta = src.reader.meta
    out = []
    gpus: list[int | None] = [m.index for m in src.gpus] or [None]  # a CPU-only session: its one timeline
    for g in gpus:
        ts_all = src.times(g)
        if ts_all is None or not ts_all.size:
            continue
        steps = src.steps_df.filter(pl.col("gpu") == g) if g is not None else src.steps_df
        steps_ts = steps["ts"].dt.epoch("us").to_numpy()
        ts = np.union1d(ts_all[::stride], plan_changes(steps))
        X = np.array([vector(feature_fn(src.window_at(g, int(t)))) for t in ts], dtype=np.float64)
        f, warn, rend = failure_marks(steps_ts, src.events_df, g)
        d = meta.get("derived") if isinstance(meta.get("derived"), dict) else None
        y = label(ts, f, warn, rend, horizon_s)
        inf = informative_of(ts, X, y, src.events_df, g, plan_changes(steps))
        out.append(Timeline(src.reader.path.name, d.get("scenario", "") if d else scenario_of(meta), g,
                            ts.astype(np.int64), X, y, f, warn, steps_ts,
                            src.interval_s, meta, source=str(d.get("from", "")) if d else "", derived=bool(d),
                            w=sampled(ts, inf) if sample else None, inf=inf))
    return out


def informative_of(ts: np.ndarray, X: np.ndarray, y: np.ndarray, events: pl.DataFrame, gpu: int | None,
                   plans_us: np.ndarray) -> np.ndarray:
    """Which windows carry information (predict/sampling.py `informative`). Events: the warnings and errors
    of this GPU and of the whole session."""
    from gpuwatch.predict.sampling import informative

    ev = events.filter(pl.col("severity").is_in(["warning", "error"]))
    if gpu is not None:
        ev = ev.filter(pl.col("gpu").is_null() | (pl.col("gpu") == gpu))
    return informative(ts, X, y, ev["ts"].dt.epoch("us").to_numpy().astype(np.int64), plans_us)


def sampled(ts: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """The fit's weight of each window (predict/sampling.py): the informative ones (`keep`), and the long
    quiet stretches sampled."""
    from gpuwatch.predict.sampling import fit_weights

    spacing = float(np.median(np.diff(ts))) / 1e6 if ts.size > 1 else 0.1
    return fit_weights(ts, keep, spacing)


def default_sessions(root: Path) -> list[Path]:
    """The shipped real H200 sessions: recordings/sample-h200-* and the recordings/h200-oom-* dataset."""
    recs = root / "recordings"
    found = sorted(p for p in recs.glob("sample-h200-*") if p.is_dir())
    for ds in sorted(recs.glob("h200-*")):
        found += sorted(p for p in ds.iterdir() if p.is_dir() and (p / "meta.json").exists())
    return found


@dataclass(frozen=True)
class Filters:
    """Which sessions to train on, from their meta.json: started at or after `since` and before `until`
    (aware datetimes), on a host matching one of `host`, of a scenario (`scenario_of`) matching one of
    `scenario` (shell patterns: `nearcap-*`). Empty: every session."""

    since: datetime | None = None
    until: datetime | None = None
    host: list[str] | None = None
    scenario: list[str] | None = None

    def __bool__(self) -> bool:
        return any(v is not None for v in (self.since, self.until, self.host, self.scenario))

    def match(self, meta: dict[str, Any]) -> bool:
        from fnmatch import fnmatchcase

        if self.since is not None or self.until is not None:
            start = _start(meta)
            if start is None or (self.since is not None and start < self.since) or (
                    self.until is not None and start >= self.until):
                return False
        if self.host is not None and not any(fnmatchcase(str(meta.get("host") or ""), h) for h in self.host):
            return False
        return self.scenario is None or any(fnmatchcase(scenario_of(meta), s) for s in self.scenario)


def _start(meta: dict[str, Any]) -> datetime | None:
    try:
        t = datetime.fromisoformat(str(meta.get("start")).replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


@dataclass
class Found:
    sessions: list[Path]  # in order: each path given, a folder's sessions sorted by path
    named: list[Path]  # those given as sessions themselves (an unusable one is an error, not a skip)
    said: list[str]  # one line each: what the filters left out, a meta.json they could not read


def is_session(p: Path) -> bool:
    """A folder that holds a session: its meta.json (even a broken one: the reader says what is wrong)
    or data files of its own."""
    from gpuwatch.recording.layout import data_names

    try:
        return p.is_dir() and (os.path.lexists(p / "meta.json") or bool(data_names(p)))
    except OSError:
        return False


def sessions_under(root: Path) -> list[Path]:
    """Every session folder under `root`, sorted; never into a session (its subfolders are its own) nor
    through a symbolic link to a folder (no loop, no session counted twice)."""
    out = []
    for d, dirs, _files in os.walk(root, onerror=lambda e: None):
        here = Path(d)
        if here != root and is_session(here):
            out.append(here)
            dirs[:] = []
            continue
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
    return sorted(out)


def find_sessions(paths: Iterable[Path], filters: Filters = Filters()) -> Found:
    """The sessions `gpuwatch train PATH...` trains on: a path that is a session is named; a folder is
    searched (`sessions_under`); anything else (no such path, a link loop) is named, for the reader to
    refuse in its own words. Each session once, in the order given. UsageError: a folder holding none."""
    seen: set[str] = set()
    out: list[Path] = []
    named: list[Path] = []
    said: list[str] = []
    for p in map(Path, paths):
        if p.is_dir() and not is_session(p):
            under = sessions_under(p)
            if not under:
                raise UsageError(f"{p}: no session under it (a session folder holds meta.json)")
        else:
            under = [p]
            named.append(p)
        for s in under:
            k = os.path.realpath(s)
            if k not in seen:
                seen.add(k)
                out.append(s)
    if not filters:
        return Found(out, named, said)
    kept, unread = [], 0
    for s in out:
        try:
            meta = SessionReader(s).meta  # meta.json alone: cheap
        except RecordingError as e:
            said.append(f"skipped: {e}")
            unread += 1
            continue
        if filters.match(meta):
            kept.append(s)
    said.append(f"{len(kept)} of {len(out)} session(s) kept, {len(out) - len(kept) - unread} left out by the filters")
    if not kept:
        raise UsageError(f"no session matches the filters ({len(out)} found)")
    return Found(kept, [p for p in named if p in kept], said)


def load_sessions(paths: Iterable[Path], stride: int = 1, progress: Callable[[str], None] | None = None,
                  horizon_s: float = HORIZON_S, counterfactual: Path | None = None,
                  feature_fn: Callable | None = None, jobs: int = 1, sample: bool = False,
                  compact: bool = False, features_dir: Path | None = None, fit_dir: Path | None = None
                  ) -> tuple[list[Timeline], list[str]]:
    """Timelines of every usable session (predict/usable.py); one that is not is left out, said in one
    line beginning "skipped: " among the warnings. With `counterfactual` (not None), each session's
    counterfactual-cap copies are derived in memory and loaded too, marked `derived`
    (predict/counterfactual.py `derive_sources`: nothing is written; the folder is no longer used). `feature_fn`: the feature function's stand-in (evaluation with a model's
    shape library: `functools.partial(features, prior=...)`). `jobs` > 1: sessions are cut in that many
    processes (joblib; or on the Dask cluster open: predict/parallel.py), their results taken in the order
    given - the same timelines as one process. `sample`: each window's weight in the fit
    (predict/sampling.py); `compact` too: each timeline holds only the windows the fit takes (`compacted`),
    what a fit without evaluation needs - memory then grows with the informative windows, not the hours.
    `features_dir`: every window of every timeline written there too (predict/shards.py), a folder per
    session, by the process that cut it. `fit_dir` (with `compact`): each timeline's fit rows written there
    by the process that cut them (`on_disk`), and only what describes them comes back - the main process then
    holds no window at all until the final fit reads them under its budget (predict/budget.py). `fit_dir`
    without `compact` (evaluation, which scores every window of the recorded timelines): the same, and each
    recorded timeline's windows written there too (or taken from `features_dir`) for the cross-validation's
    folds to score; of those only the times, labels and the few features evaluation reads come back, no
    feature matrix."""
    work = [(Path(p), stride, horizon_s, None if counterfactual is None else Path(counterfactual) / f"{i:05d}",
             feature_fn, sample or compact, compact, None if features_dir is None else Path(features_dir) / f"{i:05d}",
             None if fit_dir is None else Path(fit_dir) / f"{i:05d}")
            for i, p in enumerate(paths)]
    from gpuwatch.predict.parallel import in_order

    out, warnings = [], []
    for tls, derived, said, line in in_order(load_one, work, jobs):
        out += tls + derived
        warnings += said
        if progress and line:
            progress(line)
    return out, warnings


def load_one(p: Path, stride: int, horizon_s: float, counterfactual: Path | None, feature_fn: Callable | None,
             sample: bool = False, compact: bool = False, shards: Path | None = None, fit_dir: Path | None = None
             ) -> tuple[list[Timeline], list[Timeline], list[str], str | None]:
    """One session's (timelines, counterfactual copies' timelines, warnings, progress line); an unusable
    session gives no timelines and its one "skipped: " line. Its copies (where `counterfactual` is not None)
    are held in memory, cut and dropped."""
    from gpuwatch.predict.counterfactual import derive_sources
    from gpuwatch.predict.usable import Unusable, open_usable

    ff: dict[str, Any] = {"feature_fn": feature_fn} if feature_fn is not None else {}
    ff["sample"] = sample
    try:
        tls = session_timelines(open_usable(p), stride, horizon_s, **ff)
    except Unusable as e:
        return [], [], [f"skipped: {e}"], None
    except (RecordingError, pl.exceptions.PolarsError, ValueError) as e:
        return [], [], [f"skipped: {_why_unusable(p, e)}"], None
    derived: list[Timeline] = []
    warnings: list[str] = []
    if counterfactual is not None and tls:
        try:  # the copies are held in memory, cut into windows and dropped: no copy is written (issue 31)
            for _r, copy in derive_sources(p, tls[0].scenario):
                derived += session_timelines(copy, stride, horizon_s, **ff)
        except (RecordingError, pl.exceptions.PolarsError, ValueError, OSError) as e:
            warnings.append(f"{p.name}: no counterfactual copies ({_why_unusable(p, e)})")
            derived = []
    n = len({t.session for t in derived})
    line = f"{p.name}: {sum(t.ts_us.size for t in tls)} windows" + (f", {n} counterfactual-cap copies" if n else "")
    written: list[Path | None] = [None] * len(tls)  # the recorded timelines' windows on disk, where written
    if shards is not None:
        from gpuwatch.predict.shards import write

        written = [write(t, shards) for t in tls]
        for t in derived:
            write(t, shards)
    if compact:
        tls, derived = [compacted(t) for t in tls], [compacted(t) for t in derived]
    if fit_dir is not None:
        if not compact:  # evaluation: the folds score every window of the recorded timelines, from disk
            from gpuwatch.predict.shards import write

            written = [w or write(t, fit_dir / "windows") for t, w in zip(tls, written)]
        tls = [on_disk(t, fit_dir / f"{j:03d}.parquet", None if compact else written[j]) for j, t in enumerate(tls)]
        derived = [on_disk(t, fit_dir / f"{len(tls) + j:03d}.parquet") for j, t in enumerate(derived)]
    return tls, derived, warnings, line


def compacted(t: Timeline) -> Timeline:
    """`t` with only the windows a fit takes (labelled, sampled: weight > 0); what it had in all (windows,
    positives, healthy minutes) kept in `t.whole` for `describe`."""
    from dataclasses import replace

    keep = fit_rows(t)
    whole = _whole(t)
    return replace(t, ts_us=t.ts_us[keep], X=t.X[keep], y=t.y[keep], w=None if t.w is None else t.w[keep],
                   inf=None if t.inf is None else t.inf[keep], whole=whole)


def on_disk(t: Timeline, path: Path, windows: Path | None = None) -> Timeline:
    """`t` with its fit's rows written to `path` (predict/budget.py `write_part`) and none held: what
    describes it (`t.whole`, the rows of each of the budget's tiers) stays, for `describe` and the budget.
    `windows`: the file that holds every window of `t` (predict/shards.py; a recorded timeline that evaluation
    scores) - then what evaluation needs of each window stays too (times, labels, steps and `cols`, the
    features it reads: EVAL_COLUMNS), never the feature matrix."""
    from dataclasses import replace

    from gpuwatch.predict.budget import write_part

    whole = {**_whole(t), "tiers": write_part(t, path)}
    none: dict[str, Any] = {"X": np.empty((0, len(NAMES))), "w": None if t.w is None else np.empty(0),
                            "inf": None if t.inf is None else np.empty(0, dtype=bool), "whole": whole, "shard": path}
    if windows is not None:
        cols = {n: t.X[:, NAMES.index(n)].copy() for n in EVAL_COLUMNS}  # copies: the matrix itself is let go
        return replace(t, **none, windows=windows, cols=cols)
    return replace(t, ts_us=np.empty(0, dtype=np.int64), y=np.empty(0, dtype=np.int8),
                   step_ts=np.empty(0, dtype=np.int64), **none)


def stub(t: Timeline) -> Timeline:
    """What a fold's training side needs of a timeline (predict/budget.py `build`): of one on disk (`on_disk`)
    its file and counts, nothing per window; of a held one its fit's rows (`compacted`)."""
    from dataclasses import replace

    if t.shard is None:
        return compacted(t)
    e = np.empty(0, dtype=np.int64)
    return replace(t, ts_us=e, y=np.empty(0, dtype=np.int8), failures=e, warn_end=e, step_ts=e, meta={}, cols=None)


def _why_unusable(p: Path, e: Exception) -> str:
    """One line for a session that cannot be cut into windows (a retyped or truncated table, say)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text if str(p) in text else f"{p}: unusable for training ({text[:160]})"


def _step_s(t: Timeline) -> float:
    return float(np.median(np.diff(t.ts_us))) / 1e6 if t.ts_us.size > 1 else t.interval_s


def fit_rows(t: Timeline) -> np.ndarray:
    """The windows of `t` a fit takes: labelled ones, and of those the sample's (predict/sampling.py)."""
    from gpuwatch.predict.budget import fit_mask

    return fit_mask(t.y, t.w)


def _whole(t: Timeline) -> dict[str, Any]:
    return t.whole or {"windows": int(t.y.size), "positives": int((t.y == 1).sum()),
                       "healthy_s": float((t.y == 0).sum()) * _step_s(t), "labelled": int((t.y != -1).sum())}


def _fit_count(t: Timeline) -> int:
    return int(sum(t.whole["tiers"])) if t.shard is not None and t.whole else int(fit_rows(t).sum())


def describe(timelines: list[Timeline]) -> dict[str, Any]:
    real = [_whole(t) for t in timelines if not t.derived]
    der = [t for t in timelines if t.derived]
    return {"sessions": len({t.session for t in timelines if not t.derived}),
            "windows": int(sum(r["windows"] for r in real)), "positives": int(sum(r["positives"] for r in real)),
            "failures": int(sum(t.failures.size for t in timelines if not t.derived)),
            "healthy_minutes": round(sum(r["healthy_s"] for r in real) / 60, 1),
            "derived_sessions": len({t.session for t in der}),
            "derived_windows": int(sum(_whole(t)["windows"] for t in der)),
            "derived_failures": int(sum(t.failures.size for t in der)),
            "fit_windows": int(sum(_fit_count(t) for t in timelines)),
            "labelled_windows": int(sum(t.whole["labelled"] if t.whole else (t.y != -1).sum() for t in timelines)),
            "scenarios": sorted({t.scenario for t in timelines}), "features": list(NAMES)}
