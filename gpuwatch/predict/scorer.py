"""Scoring: the model over one window (`Scorer.score`), the live loop that scores every GPU a few times
a second and publishes the risk (`LiveScorer`), and a whole recording at once (`score_source`, for
`gpuwatch score` and replay of older sessions). All three call the one feature function.

Reasons are occlusion effects: each feature in turn set to its healthy median (from the training
data, in the manifest) and how far the risk falls; computed only when the risk is within reach of the
alarm, so a calm GPU costs one prediction per scoring.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Callable

import numpy as np
import polars as pl

from gpuwatch.predict.ahead import FEATURES as LOOKAHEAD_FEATURES, RISK_NEXT
from gpuwatch.predict.dataset import plan_changes
from gpuwatch.predict.evaluate import CLEAR_RATIO, alarm_next, alarm_state
from gpuwatch.predict.features import NAMES, features, vector
from gpuwatch.predict.model import RiskModel
from gpuwatch.recording import schema
from gpuwatch.recording.recorded import event_detail
from gpuwatch.recording.source import ReplaySource
from gpuwatch.recording.window import Window
from gpuwatch.threads import start_thread

REASONS_FROM = 0.5  # compute reasons when risk >= threshold x this
_AHEAD, _AHEAD_FRAC = (NAMES.index(n) for n in LOOKAHEAD_FEATURES)  # blanked together: the lookahead's part
_PEAK, _NEXT_FRAC = NAMES.index("peak_cross_p"), NAMES.index("next_peak_est_frac")


class Scorer:
    def __init__(self, model: RiskModel) -> None:
        self.model = model
        self.ref = np.array([np.nan if v is None else v for v in model.reference], dtype=np.float64)
        est = model.estimator
        proba = _fast_proba(est)
        # One OpenMP thread: a single row costs ~30x more with spinning threads (`one_openmp_thread`).

        def predict(X):
            with one_openmp_thread():
                return proba(X)
        self._predict = proba if getattr(proba, "pure_python", False) else predict

    def proba(self, X: np.ndarray) -> np.ndarray:
        """(1 - risk, risk) per row of feature vectors X, as the model scores them."""
        return self._predict(X)

    def score_vector(self, x: list[float]) -> float:
        return float(self._predict(np.asarray([x], dtype=np.float64))[0, 1])

    def reasons(self, x: list[float], risk: float, top: int = 3) -> list[tuple[str, float]]:
        base = np.asarray(x, dtype=np.float64)
        rows = np.repeat(base[None, :], len(NAMES), axis=0)
        for i in range(len(NAMES)):
            rows[i, i] = self.ref[i]
        drops = risk - self._predict(rows)[:, 1]
        order = np.argsort(-drops)
        return [(NAMES[i], round(float(drops[i]), 3)) for i in order[:top] if drops[i] > 0.01]

    def score(self, w: Window, plan: dict | None = None) -> tuple[float, list, dict[str, float]]:
        f = features(w, plan, self.model.prior)
        x = vector(f)
        r = self.score_vector(x)
        why = self.reasons(x, r) if r >= self.model.threshold * REASONS_FROM else []
        f[RISK_NEXT] = self.risk_next(x, r)
        return r, why, f

    def risk_next(self, x: list[float], r: float) -> float:
        """The risk of the next step: `r` without the lookahead's part (predict/ahead.py) - what the
        guard acts on. `r` itself where the lookahead adds nothing (one prediction more only where it does)."""
        a, p, af, nf = x[_AHEAD], x[_PEAK], x[_AHEAD_FRAC], x[_NEXT_FRAC]
        adds = a == a and (a > (p if p == p else 0.0)  # the lookahead's probability, or its excess above the alarm
                           or (af == af and af > 1.0 and af > (nf if nf == nf else 0.0)))
        if not adds or r < self.model.threshold * CLEAR_RATIO:
            return r  # (under the alarm's clearing level the guard decides the same on r as on anything lower)
        y = list(x)
        y[_AHEAD] = y[_AHEAD_FRAC] = float("nan")
        return self.score_vector(y)


def _fast_proba(est):
    """predict_proba for one row at a time, without scikit-learn's per-call overhead (input checks,
    thread pools: ~1 ms a call, most of a window's cost): where the model is a column selection in
    front of a binary HistGradientBoostingClassifier (the shipped kind), its trees are walked directly
    (`_TreeWalker`, checked equal to predict_proba by a test); otherwise scikit-learn's own."""
    from gpuwatch.predict.composite import RiskComposite

    if isinstance(est, RiskComposite):
        fn = est.fast(_fast_proba(est.classifier))
        fn.pure_python = True
        return fn
    steps = getattr(est, "steps", None)
    cols, final = None, est
    if steps and len(steps) == 2:
        ct = steps[0][1]
        trs = [t for t in getattr(ct, "transformers_", None) or [] if not (isinstance(t[1], str) and t[1] == "drop")]
        fitted_passthrough = len(trs) == 1 and (trs[0][1] == "passthrough" or (
            type(trs[0][1]).__name__ == "FunctionTransformer" and getattr(trs[0][1], "func", 0) is None))
        if not fitted_passthrough:
            return est.predict_proba
        cols, final = np.asarray(trs[0][2]), steps[1][1]
    walker = _TreeWalker.of(final)
    if walker is not None:
        fn = (lambda X: walker.proba(X)) if cols is None else (lambda X: walker.proba(np.asarray(X)[:, cols]))
        fn.pure_python = True  # no OpenMP: no thread-pool limit needed around it
        return fn
    if cols is not None:
        return lambda X: final.predict_proba(np.asarray(X)[:, cols])
    return est.predict_proba


class _TreeWalker:
    """A fitted binary HistGradientBoostingClassifier's trees as flat numpy arrays, walked in Python:
    ~0.1 ms for one row of 100 small trees, the same numbers as predict_proba (NaN goes where the
    tree sends missing values)."""

    BATCH = 32  # rows from which scikit-learn's vectorized predict_proba is faster than the walk

    def __init__(self, trees: list[tuple], baseline: float, clf=None) -> None:
        self.trees, self.baseline, self.clf = trees, baseline, clf

    @classmethod
    def of(cls, clf) -> _TreeWalker | None:
        preds = getattr(clf, "_predictors", None)
        if type(clf).__name__ != "HistGradientBoostingClassifier" or not preds or len(preds[0]) != 1:
            return None
        if any(getattr(p[0], "raw_left_cat_bitsets", np.empty(0)).size for p in preds):
            return None  # categorical splits: leave them to scikit-learn
        trees = []
        for (tp,) in preds:
            n = tp.nodes
            trees.append((n["feature_idx"].tolist(), n["num_threshold"].tolist(), n["missing_go_to_left"].tolist(),
                          n["left"].tolist(), n["right"].tolist(), n["is_leaf"].tolist(), n["value"].tolist()))
        return cls(trees, float(np.ravel(clf._baseline_prediction)[0]), clf)

    def raw(self, x: list[float]) -> float:
        total = self.baseline
        for feat, thr, miss_left, left, right, leaf, value in self.trees:
            i = 0
            while not leaf[i]:
                v = x[feat[i]]
                i = (left[i] if miss_left[i] else right[i]) if v != v else (left[i] if v <= thr[i] else right[i])
            total += value[i]
        return total

    def proba(self, X) -> np.ndarray:
        X = np.asarray(X, dtype=np.float64)
        if self.clf is not None and len(X) >= self.BATCH:  # `score` of a recording: thousands of rows
            # on one OpenMP thread: the same numbers (rows are independent), and the pool's threads cost
            # far more than the trees - the first batch of a process spun for ~1 s of CPU on the shared
            # 2-core dev box (3,000 rows: 0.02 s on one thread), and `score --jobs N` on N cores would
            # start N pools of N threads each
            with one_openmp_thread():
                return self.clf.predict_proba(X)
        p = np.array([1.0 / (1.0 + np.exp(-self.raw(row))) for row in X.tolist()])
        return np.stack([1.0 - p, p], axis=1)


_CTL: list = []  # the threadpoolctl controller, built once a process (building one scans its libraries: 3 ms)


def one_openmp_thread():
    """A context in which scikit-learn's OpenMP pool runs one thread: the same numbers (rows are independent);
    a single row costs ~30x more with spinning threads, and a recording's batch spun for ~1 s of CPU in a
    process's first predict on a shared 2-core box."""
    if not _CTL:
        from threadpoolctl import ThreadpoolController

        _CTL.append(ThreadpoolController())
    return _CTL[0].limit(limits=1, user_api="openmp")


class LiveScorer:
    """Scores every GPU of a live source on its own thread and publishes `bus.risk` rows; the alarm's
    onset and end are `risk_alarm` / `risk_clear` events."""

    def __init__(self, source, model: RiskModel, bus, plan: Callable[[int | None], dict | None],
                 hz: float = 10.0, on_risk: Callable | None = None) -> None:
        self.source, self.model, self.bus, self.plan = source, model, bus, plan
        self.scorer = Scorer(model)
        self.period = 1.0 / hz
        self.on_risk = on_risk
        self._alarm: dict[int | None, bool] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.cost_us: list[int] = []  # CPU per scoring round (the last 600)
        self._why: dict[int | None, tuple[float, list]] = {}  # reasons, recomputed at most once a second
        self._publish_lock = threading.Lock()  # the scorer thread and the workload thread (rescore) both publish
        self._seen: dict[int | None, tuple] = {}  # per GPU: the window and plan last scored

    def rescore(self, gpu: int | None, plan: dict) -> tuple[float, list, dict]:
        """Score a plan that stepped up since the last round (the guard asks, between steps); the result
        is published like any other scoring, so the recorded risk holds what the guard acted on."""
        with self._publish_lock:
            w = self.source.window(gpu)
            r, why, f = self.scorer.score(w, plan)
            self._publish(gpu, w.end_us, r, why, plan="rescored")
            return r, why, f

    def estimate(self, gpu: int | None, asks: list) -> list:
        """The estimator's peak of each (Config, seq_len) on this GPU's live window, a share of the usable
        limit (predict/plans.py); the planner's question, asked between steps. Nothing is published."""
        from gpuwatch.predict.plans import estimate

        with self._publish_lock:
            w = self.source.window(gpu)
        return estimate(w, asks)

    def score_once(self) -> None:
        c0 = time.thread_time_ns()
        for g in [m.index for m in self.source.gpus]:
            with self._publish_lock:
                w = self.source.window(g)
                if not w.samples.height:
                    continue
                plan = self.plan(g)
                seen = (w.end_us, w.samples.height, json.dumps(plan, sort_keys=True, default=str))
                if self._seen.get(g) == seen:  # nothing new since the last round (ticks come a second at a
                    continue                   # time to a headless recorder): no second, identical risk row
                self._seen[g] = seen
                f = features(w, plan, self.model.prior)
                x = vector(f)
                r = self.scorer.score_vector(x)
                why = self._reasons(g, x, r)
                f[RISK_NEXT] = self.scorer.risk_next(x, r)
                onset = self._publish(g, w.end_us, r, why, ahead=_ahead_text(plan, f[RISK_NEXT], self.model.threshold))
            if self.on_risk is not None:
                self.on_risk(g, r, why, f, plan, onset)
        self.cost_us = (self.cost_us + [(time.thread_time_ns() - c0) // 1000])[-600:]

    def _publish(self, g, ts_us: int, r: float, why: list, plan: str | None = None, ahead: str = "") -> bool:
        """One risk row; the alarm's onset and end as events (hysteresis). Returns True at the onset.
        `ahead`: what the alarm is about where a step planned further ahead raised it, not the next one."""
        was = self._alarm.get(g, False)
        alarm = alarm_next(was, r, self.model.threshold)
        self.bus.risk.append({"ts": ts_us, "gpu": g, "kind": self.model.kind, "risk": r, "alarm": alarm,
                              "threshold": self.model.threshold, "model": self.model.label,
                              "reasons": json.dumps(why)})
        if alarm and not was:
            self.bus.emit("risk_alarm", f"OOM risk {r:.2f} >= {self.model.threshold:.2f}"
                          + (" (the next step's plan)" if plan else ahead) + ": "
                          + (", ".join(n for n, _ in why) or "no single feature stands out"), "warning",
                          gpu=g, risk=r, threshold=self.model.threshold, model=self.model.label, reasons=why)
        elif was and not alarm:
            self.bus.emit("risk_clear", f"OOM risk back to {r:.2f}", gpu=g, risk=r)
        self._alarm[g] = alarm
        return alarm and not was

    def _reasons(self, g, x, r: float) -> list:
        """Occlusion reasons cost one batched prediction: only near the alarm, at most once a second
        (and at once when the alarm goes on)."""
        if r < self.model.threshold * REASONS_FROM:
            self._why.pop(g, None)
            return []
        t, why = self._why.get(g, (0.0, []))
        now = time.monotonic()
        if now - t >= 1.0 or (r >= self.model.threshold and not self._alarm.get(g, False)):
            why = self.scorer.reasons(x, r)
            self._why[g] = (now, why)
        return why

    def _run(self) -> None:
        """Score until stopped. A round that fails (a workload's plan read mid-change, say) is skipped
        and said once a minute at most; ten failures in a row stop scoring, and that is said too."""
        nxt = time.monotonic()
        failed, said = 0, -1e9
        while not self._stop.is_set():
            try:
                self.score_once()
                failed = 0
            except Exception as e:  # noqa: BLE001 - scoring must never take the run down
                failed += 1
                if failed >= 10:
                    self.bus.emit("risk_clear", f"risk scoring stopped after 10 failures: {type(e).__name__}: {e}", "error")
                    return
                if time.monotonic() - said > 60:
                    said = time.monotonic()
                    self.bus.emit("risk_clear", f"a risk scoring round failed: {type(e).__name__}: {e}", "warning")
            nxt += self.period
            self._stop.wait(max(0.0, nxt - time.monotonic()))

    def start(self) -> None:
        self._thread = start_thread(self._run, "gpuwatch-scorer")

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)


def _ahead_text(plan: dict | None, risk_next: float, threshold: float) -> str:
    """" (batch B x S planned in k steps)" where the next step alone is under the alarm: the warning is
    about a step the schedule will run later (predict/ahead.py); empty otherwise."""
    p = plan or {}
    if risk_next >= threshold or not p.get("ahead_batch") or not p.get("ahead_steps"):
        return ""
    return f" (batch {p['ahead_batch']} x {p.get('ahead_seq_len')} planned in {p['ahead_steps']} steps)"


def score_source(src: ReplaySource, model: RiskModel, stride: int = 1,
                 progress: Callable[[str], None] | None = None, jobs: int = 1) -> pl.DataFrame:
    """The risk timeline of a whole recording (the risk table's schema): every `stride`-th sample
    of every GPU, each window cut as replay would show it at that moment. `jobs` > 1: the windows' features
    are computed in that many processes (predict/parallel.py), each a stretch of the recording opened on
    its own - the same timeline as one."""
    sc = Scorer(model)
    rows: list[dict[str, Any]] = []
    for g in [m.index for m in src.gpus]:
        ts = src.times(g)
        if ts is None:
            continue
        steps = src.steps_df.filter(pl.col("gpu") == g) if g is not None else src.steps_df
        moments = np.union1d(ts[::stride], plan_changes(steps))  # and where the guard rescores, live
        X = feature_rows(src, g, moments, model.prior, jobs)
        if not X.size:
            continue
        risk = sc.proba(X)[:, 1]
        on = alarm_state(risk, model.threshold)
        for t, r, a in zip(moments, risk, on):
            rows.append({"ts": int(t), "gpu": g, "kind": model.kind, "risk": float(r),
                         "alarm": bool(a), "threshold": model.threshold,
                         "model": model.label, "reasons": "[]"})
        if progress:
            progress(f"GPU {g}: {len(moments)} windows scored")
    if not rows:
        return schema.empty("risk")
    return pl.from_dicts(rows, schema=schema.RISK, strict=False)


def feature_rows(src: ReplaySource, g: int | None, moments: np.ndarray, prior, jobs: int = 1) -> np.ndarray:
    """The feature vectors of GPU `g`'s windows at `moments` (us): here, or with `jobs` > 1 in stretches
    (a few per process, so that a slow one does not hold the rest) each cut from the session reopened."""
    if jobs <= 1 or moments.size < 2 * MIN_STRETCH:
        return _rows(src, g, moments, prior)
    from gpuwatch.predict.parallel import in_order

    parts = np.array_split(moments, min(4 * jobs, moments.size // MIN_STRETCH))
    work = ((str(src.reader.path), g, p, prior) for p in parts)
    return np.concatenate(list(in_order(_stretch, work, jobs)))


MIN_STRETCH = 500  # windows a process is handed at least (reopening a session costs ~ a few hundred windows)
_OPEN: dict[str, ReplaySource] = {}  # in a worker process: the session it cut a stretch of last


def _stretch(path: str, g: int | None, moments: np.ndarray, prior) -> np.ndarray:
    src = _OPEN.get(path)
    if src is None:
        _OPEN.clear()
        src = _OPEN[path] = ReplaySource(path)
    return _rows(src, g, moments, prior)


def _rows(src: ReplaySource, g: int | None, moments: np.ndarray, prior) -> np.ndarray:
    X = np.array([vector(features(src.window_at(g, int(t)), prior=prior)) for t in moments], dtype=np.float64)
    return X.reshape(len(moments), len(NAMES))


def alarms(timeline: pl.DataFrame) -> list[dict[str, Any]]:
    """One entry per moment the risk rises over the alarm threshold (per GPU)."""
    out = []
    for g, part in timeline.sort("ts").group_by("gpu", maintain_order=True):
        a = part["alarm"].to_numpy()
        on = np.where(a & ~np.r_[False, a[:-1]])[0]
        for i in on:
            r = part.row(int(i), named=True)
            out.append({"ts": r["ts"].isoformat().replace("+00:00", "Z"), "gpu": r["gpu"], "kind": r["kind"],
                        "risk": round(float(r["risk"]), 4)})
    return sorted(out, key=lambda x: x["ts"])


def guard_actions(events: pl.DataFrame) -> list[dict[str, Any]]:
    """The guard's recorded actions, for `gpuwatch score` to show beside the risk."""
    out = []
    for r in events.filter(pl.col("kind") == "guard_action").to_dicts():
        d = event_detail(r)
        out.append({"ts": r["ts"].isoformat().replace("+00:00", "Z"), "gpu": r["gpu"], "action": d.get("action"),
                    "risk": None if d.get("risk") is None else round(float(d["risk"]), 4), "message": r["message"]})
    return out
