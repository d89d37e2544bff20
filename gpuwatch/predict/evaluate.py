"""Event-level evaluation of risk scores (a model's or a baseline rule's) over labelled timelines.

- an OOM is *caught* when an alarm (score >= threshold) is raised between `horizon` before it and
  the last moment a guard could act (the end of the step before the failing one);
- lead time: from the first such alarm to the failure, in seconds and in finished steps;
- an alarm *onset* (score crossing up, among scored moments) is true when an OOM follows within the
  horizon, else a false alarm; false alarms per healthy hour divide by the time not within a
  horizon before a failure nor in a recovery;
- event precision = true onsets / all onsets; PR-AUC is over windows (positives vs negatives).
Recall is reported over all OOMs and over *episodes* (OOMs with no other OOM in the horizon before
them: a cascade of retries after one failure counts once).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

from gpuwatch.predict.dataset import HORIZON_S, Timeline
from gpuwatch.predict.features import NAMES


@dataclass
class Metrics:
    threshold: float
    oom_events: int
    caught: int
    recall: float | None
    episodes: int
    episodes_caught: int
    episode_recall: float | None
    onsets: int
    false_alarms: int
    event_precision: float | None
    healthy_hours: float
    false_alarms_per_hour: float | None
    lead_s_median: float | None
    lead_s_p10: float | None
    lead_steps_median: float | None
    lead_steps_p10: float | None
    pr_auc: float | None = None

    def row(self) -> dict:
        return asdict(self)


def event_metrics(timelines: list[Timeline], scores: list[np.ndarray], threshold: float,
                  horizon_s: float = HORIZON_S, with_auc: bool = False) -> Metrics:
    h = int(horizon_s * 1e6)
    n = caught = ep = ep_caught = onsets = false = 0
    healthy_s = 0.0
    leads_s, leads_steps = [], []
    for tl, sc in zip(timelines, scores):
        alarm = sc >= threshold
        valid = tl.y != -1
        healthy_s += float(((tl.y == 0)).sum()) * _stride_s(tl)
        prev_f = None
        for tf, we in zip(tl.failures, tl.warn_end):
            n += 1
            first = prev_f is None or tf - prev_f > h
            prev_f = tf
            ep += first
            win = (tl.ts_us >= tf - h) & (tl.ts_us <= we) & alarm
            if win.any():
                caught += 1
                ep_caught += first
                t0 = tl.ts_us[np.argmax(win)]
                leads_s.append((tf - t0) / 1e6)
                leads_steps.append(int(((tl.step_ts > t0) & (tl.step_ts < tf)).sum()) + 1)
        on = _onsets(alarm, valid)
        for t in tl.ts_us[on]:
            onsets += 1
            if not ((tl.failures >= t) & (tl.failures <= t + h)).any():
                false += 1
    hours = healthy_s / 3600
    return Metrics(
        threshold=float(threshold), oom_events=n, caught=caught, recall=caught / n if n else None,
        episodes=ep, episodes_caught=ep_caught, episode_recall=ep_caught / ep if ep else None,
        onsets=onsets, false_alarms=false, event_precision=(onsets - false) / onsets if onsets else None,
        healthy_hours=hours, false_alarms_per_hour=false / hours if hours > 0 else None,
        lead_s_median=_pct(leads_s, 50), lead_s_p10=_pct(leads_s, 10),
        lead_steps_median=_pct(leads_steps, 50), lead_steps_p10=_pct(leads_steps, 10),
        pr_auc=pr_auc(timelines, scores) if with_auc else None)


def _stride_s(tl: Timeline) -> float:
    return float(np.median(np.diff(tl.ts_us))) / 1e6 if tl.ts_us.size > 1 else tl.interval_s


def _onsets(alarm: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Indices where the alarm turns on (over the valid moments; a dropped stretch re-arms it)."""
    a = alarm & valid
    prev = np.r_[False, a[:-1]]
    return np.where(a & ~prev)[0]


def _pct(v: list, q: float) -> float | None:
    return float(np.percentile(v, q)) if v else None


def pr_auc(timelines: list[Timeline], scores: list[np.ndarray]) -> float | None:
    from sklearn.metrics import average_precision_score

    y = np.concatenate([t.y for t in timelines]) if timelines else np.array([])
    s = np.concatenate(scores) if scores else np.array([])
    keep = y != -1
    if not keep.any() or len(set(y[keep].tolist())) < 2:
        return None
    return float(average_precision_score(y[keep], np.nan_to_num(s[keep], nan=0.0)))


def _candidates(scores: list[np.ndarray], n: int = 60) -> np.ndarray:
    allv = np.concatenate(scores) if scores else np.array([0.5])
    allv = allv[np.isfinite(allv) & (allv > 0.005) & (allv < 0.9995)]
    return np.unique(np.round(np.quantile(allv, np.linspace(0, 1, n)), 4)) if allv.size else np.array([0.5])


def pick_threshold(timelines: list[Timeline], scores: list[np.ndarray], max_fa_per_hour: float = 1.0,
                   horizon_s: float = HORIZON_S, min_recall: float = 0.95) -> tuple[float, str]:
    """The threshold that catches the most OOMs with at most `max_fa_per_hour` false alarms per
    healthy hour, if that still catches `min_recall` of them; else the one with the fewest false
    alarms among those that do (the false-alarm target then is not met, and the card says so)."""
    rows = [(float(t), event_metrics(timelines, scores, float(t), horizon_s)) for t in _candidates(scores)]
    if not rows:
        return 0.5, "no scores to choose from"
    ok = [(t, m) for t, m in rows if m.false_alarms_per_hour is not None and m.false_alarms_per_hour <= max_fa_per_hour]
    best = max(ok, key=lambda tm: (tm[1].caught, tm[0])) if ok else None
    if best is not None and (best[1].recall or 0) >= min_recall:
        return best[0], (f"the highest recall with at most {max_fa_per_hour:g} false alarm per healthy hour "
                         "on out-of-fold scores")
    enough = [(t, m) for t, m in rows if (m.recall or 0) >= min_recall]
    if enough:
        t, m = min(enough, key=lambda tm: (tm[1].false_alarms, -tm[0]))
        return t, (f"at most {max_fa_per_hour:g} false alarm per healthy hour would catch "
                   f"{best[1].caught if best else 0} of {m.oom_events} OOMs, so this is the threshold with the fewest "
                   f"false alarms that still catches {min_recall:.0%} of them (out-of-fold scores)")
    t, m = max(rows, key=lambda tm: (tm[1].caught, -tm[1].false_alarms))
    return t, f"no threshold catches {min_recall:.0%} of the OOMs out of fold; this one catches the most"


# -- baselines: simple rules anyone could write, scored as 0/1 over the same windows --------------------
def _col(tl: Timeline, name: str) -> np.ndarray:
    return tl.X[:, NAMES.index(name)]


BASELINES: dict[str, tuple[str, Callable[[Timeline], np.ndarray]]] = {
    "mem>90%": ("memory in use > 90 % of the effective limit", lambda tl: _col(tl, "mem_used_frac") > 0.90),
    "mem>95%": ("memory in use > 95 % of the effective limit", lambda tl: _col(tl, "mem_used_frac") > 0.95),
    "time-to-full": (f"time to full at the 5 s memory slope < {HORIZON_S:g} s",
                     lambda tl: _col(tl, "time_to_full_s") < HORIZON_S),
    "next-step peak": ("estimated next-step peak > 100 % of the effective limit",
                       lambda tl: np.nan_to_num(_col(tl, "next_peak_est_frac"), nan=0.0) > 1.0),
}


def baseline_metrics(timelines: list[Timeline], horizon_s: float = HORIZON_S) -> dict[str, Metrics]:
    return {name: event_metrics(timelines, [fn(tl).astype(float) for tl in timelines], 0.5, horizon_s)
            for name, (_, fn) in BASELINES.items()}


def recall_at_fa(timelines: list[Timeline], scores: list[np.ndarray], fa_per_hour: float,
                 horizon_s: float = HORIZON_S) -> Metrics | None:
    """The model's best metrics with no more false alarms per healthy hour than `fa_per_hour`."""
    best = None
    for t in _candidates(scores):
        m = event_metrics(timelines, scores, float(t), horizon_s)
        if m.false_alarms_per_hour is not None and m.false_alarms_per_hour <= fa_per_hour + 1e-9:
            if best is None or m.caught > best.caught:
                best = m
    return best
