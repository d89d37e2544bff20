"""Event-level evaluation of risk scores (a model's or a baseline rule's) over labelled timelines.

- an OOM is *caught* when an alarm (score >= threshold) is raised between `horizon` before it and
  the last moment a guard could act (the end of the step before the failing one, or the workload's start
  or last recovery where that came later: predict/dataset.py `failure_marks`); an OOM before any step of
  its session ran is counted as well, and apart (`first_step_ooms`): only an alarm before the attempt
  began catches it, which no rule reading steps can raise;
- lead time: from the first such alarm to the failure, in seconds and in finished steps;
- an alarm *onset* (score crossing up, among scored moments; an alarm held on counts again every
  horizon) is true when an OOM follows within the next two horizons, else a false alarm; false
  alarms per healthy hour divide by the time not within a horizon before a failure nor in a recovery;
- event precision = true onsets / all onsets; PR-AUC is over windows (positives vs negatives).
Recall is reported over all OOMs and over *episodes* (OOMs with no other OOM in the horizon before
them: a cascade of retries after one failure counts once).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

from gpuwatch.predict.dataset import EVAL_COLUMNS, HORIZON_S, Timeline
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
    near_hours: float = 0.0  # healthy time at >= NEAR_FRAC of the effective limit
    near_false_alarms: int = 0  # false alarms that began there
    near_fa_per_hour: float | None = None
    first_step_ooms: int = 0  # OOMs before any step of their session had finished: warned only before it began
    first_step_caught: int = 0

    def row(self) -> dict:
        return asdict(self)


def event_metrics(timelines: list[Timeline], scores: list[np.ndarray], threshold: float,
                  horizon_s: float = HORIZON_S, with_auc: bool = False) -> Metrics:
    h = int(horizon_s * 1e6)
    n = caught = ep = ep_caught = onsets = false = first_n = first_caught = 0
    healthy_s = 0.0
    leads_s, leads_steps = [], []
    near_s, near_false = 0.0, 0
    for tl, sc in zip(timelines, scores):
        alarm = alarm_state(sc, threshold)
        valid = tl.y != -1
        healthy_s += float(((tl.y == 0)).sum()) * _stride_s(tl)
        near = np.nan_to_num(column(tl, "mem_used_frac"), nan=0.0) >= NEAR_FRAC
        near_s += float(((tl.y == 0) & near).sum()) * _stride_s(tl)
        prev_f = None
        for tf, we in zip(tl.failures, tl.warn_end):
            n += 1
            first = prev_f is None or tf - prev_f > h
            prev_f = tf
            ep += first
            unrun = not (tl.step_ts < tf).any()
            first_n += unrun
            win = (tl.ts_us >= tf - h) & (tl.ts_us <= we) & alarm
            if win.any():
                caught += 1
                first_caught += unrun
                ep_caught += first
                t0 = tl.ts_us[np.argmax(win)]
                leads_s.append((tf - t0) / 1e6)
                leads_steps.append(int(((tl.step_ts > t0) & (tl.step_ts < tf)).sum()) + 1)
        for t in alarm_starts(tl.ts_us, alarm & valid, h):
            onsets += 1
            if not ((tl.failures >= t) & (tl.failures <= t + 2 * h)).any():
                false += 1
                i = min(int(np.searchsorted(tl.ts_us, t)), tl.ts_us.size - 1)
                near_false += bool(near[i])
    hours = healthy_s / 3600
    return Metrics(
        threshold=float(threshold), oom_events=n, caught=caught, recall=caught / n if n else None,
        episodes=ep, episodes_caught=ep_caught, episode_recall=ep_caught / ep if ep else None,
        onsets=onsets, false_alarms=false, event_precision=(onsets - false) / onsets if onsets else None,
        healthy_hours=hours, false_alarms_per_hour=false / hours if hours > 0 else None,
        lead_s_median=_pct(leads_s, 50), lead_s_p10=_pct(leads_s, 10),
        lead_steps_median=_pct(leads_steps, 50), lead_steps_p10=_pct(leads_steps, 10),
        pr_auc=pr_auc(timelines, scores) if with_auc else None,
        near_hours=near_s / 3600, near_false_alarms=near_false,
        near_fa_per_hour=near_false / (near_s / 3600) if near_s > 0 else None,
        first_step_ooms=first_n, first_step_caught=first_caught)


NEAR_FRAC = 0.90  # "near the limit": memory in use at or above this share of the effective limit
CLEAR_RATIO = 0.5  # an alarm, once raised, holds until the score falls below threshold x this


def alarm_state(scores: np.ndarray, threshold: float, clear_ratio: float = CLEAR_RATIO) -> np.ndarray:
    """The alarm as the live scorer raises it: on at >= threshold, off again only below
    threshold x clear_ratio (hysteresis: a score hovering at the threshold is one alarm, not many)."""
    out = np.zeros(scores.size, dtype=bool)
    on = False
    for i, v in enumerate(scores.tolist()):
        on = out[i] = alarm_next(on, v, threshold, clear_ratio)
    return out


def alarm_next(on: bool, score: float, threshold: float, clear_ratio: float = CLEAR_RATIO) -> bool:
    """One step of that hysteresis (the live scorer's alarm, score by score)."""
    return score >= threshold or (on and score >= threshold * clear_ratio)


def _stride_s(tl: Timeline) -> float:
    return float(np.median(np.diff(tl.ts_us))) / 1e6 if tl.ts_us.size > 1 else tl.interval_s


def alarm_starts(ts: np.ndarray, on: np.ndarray, h: int) -> list[int]:
    """The alarm's starts, counting an alarm that stays on as a new one every horizon (an alarm held
    through an hour of healthy running is not one false alarm but many: otherwise a rule that is
    always on would look best). A start is true when a failure follows within the horizon after the
    block it covers."""
    out = []
    prev = np.r_[False, on[:-1]]
    for i in np.where(on & ~prev)[0]:
        j = i
        while j < on.size and on[j]:
            j += 1
        t = int(ts[i])
        end = int(ts[j - 1])
        while t <= end:
            out.append(t)
            t += h
    return out


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
    allv = allv[np.isfinite(allv) & (allv > 0.0) & (allv < 1.0)]
    if not allv.size:
        return np.array([0.5])
    # dense where the scores are (quantiles) and evenly over 0..1, so neither end is missed
    grid = np.r_[np.quantile(allv, np.linspace(0, 1, n)), np.linspace(0.02, 0.98, 49)]
    return np.unique(np.round(grid, 4))


def _fa(m: Metrics, near: bool) -> float | None:
    return m.near_fa_per_hour if near else m.false_alarms_per_hour


def pick_threshold(timelines: list[Timeline], scores: list[np.ndarray], max_fa_per_hour: float = 1.0,
                   horizon_s: float = HORIZON_S, min_recall: float = 0.95, near: bool = False) -> tuple[float, str]:
    """The threshold that catches the most OOMs with at most `max_fa_per_hour` false alarms per
    healthy hour (with `near`: per healthy hour at >= NEAR_FRAC of the limit), if that still catches
    `min_recall` of them; else the one with the fewest false alarms among those that do (the
    false-alarm target then is not met, and the card says so)."""
    rows = [(float(t), event_metrics(timelines, scores, float(t), horizon_s)) for t in _candidates(scores)]
    if not rows:
        return 0.5, "no scores to choose from"
    ok = [(t, m) for t, m in rows if (fa := _fa(m, near)) is not None and fa <= max_fa_per_hour]
    best = max(ok, key=lambda tm: (tm[1].caught, tm[0])) if ok else None
    if near and best is not None:  # near the limit the false-alarm target comes first: an alarm that
        m = best[1]                # fires every few minutes gets the guard switched off
        met = (m.recall or 0) >= min_recall
        return best[0], (f"the highest recall with at most {max_fa_per_hour:g} false alarms per healthy hour at >= "
                         f"{NEAR_FRAC:.0%} of the limit on out-of-fold scores"
                         + ("" if met else f" (recall {m.recall or 0:.2f}: the {min_recall:.0%} target is not met at that rate)"))
    if best is not None and (best[1].recall or 0) >= min_recall:
        return best[0], (f"the highest recall with at most {max_fa_per_hour:g} false alarms per healthy hour"
                         + (f" at >= {NEAR_FRAC:.0%} of the limit" if near else "") + " on out-of-fold scores")
    enough = [(t, m) for t, m in rows if (m.recall or 0) >= min_recall]
    if enough:
        t, m = min(enough, key=lambda tm: ((tm[1].near_false_alarms if near else tm[1].false_alarms), tm[1].false_alarms, -tm[0]))
        return t, (f"at most {max_fa_per_hour:g} false alarm per healthy hour would catch "
                   f"{best[1].caught if best else 0} of {m.oom_events} OOMs, so this is the threshold with the fewest "
                   f"false alarms that still catches {min_recall:.0%} of them (out-of-fold scores)")
    t, m = max(rows, key=lambda tm: (tm[1].caught, -tm[1].false_alarms))
    return t, f"no threshold catches {min_recall:.0%} of the OOMs out of fold; this one catches the most"


# -- baselines: simple rules anyone could write, scored as 0/1 over the same windows --------------------
COLUMNS = EVAL_COLUMNS  # the features read here of every window (dataset.EVAL_COLUMNS)


def column(tl: Timeline, name: str) -> np.ndarray:
    """Feature `name` (one of COLUMNS) of every window of `tl`: from its features, or what it kept of them."""
    return tl.X[:, NAMES.index(name)] if tl.cols is None else tl.cols[name]



BASELINES: dict[str, tuple[str, Callable[[Timeline], np.ndarray]]] = {
    "mem>90%": ("memory in use > 90 % of the effective limit", lambda tl: column(tl, "mem_used_frac") > 0.90),
    "mem>95%": ("memory in use > 95 % of the effective limit", lambda tl: column(tl, "mem_used_frac") > 0.95),
    "time-to-full": (f"time to full at the 5 s memory slope < {HORIZON_S:g} s",
                     lambda tl: column(tl, "time_to_full_s") < HORIZON_S),
    "next-step peak": ("estimated next-step peak > 100 % of the usable limit",
                       lambda tl: np.nan_to_num(column(tl, "next_peak_est_frac"), nan=0.0) > 1.0),
    "vramtop": ("vramtop's \"OOM in ~\" time-to-OOM alarm at its 1 s refresh (predict/vramtop.py, from its source)",
                lambda tl: _vramtop(tl, False)),
    "vramtop+85%": ("vramtop's time-to-OOM alarm or its \"Low VRAM\" warning at >= 85 % (predict/vramtop.py)",
                    lambda tl: _vramtop(tl, True)),
}


def _vramtop(tl: Timeline, any_warning: bool) -> np.ndarray:
    from gpuwatch.predict.vramtop import alarms

    return alarms(tl.ts_us, column(tl, "mem_used_frac"), column(tl, "mem_headroom_gib"), any_warning)
ESTIMATOR_RULE = ("estimator alone", "P(a step within the horizon, or the largest step planned within the lookahead, peaks over the usable limit) >= 0.5 (predict/peak.py, predict/ahead.py; no learning)",
                  lambda tl: _estimator_part(tl))


def _estimator_part(tl: Timeline) -> np.ndarray:
    """The composite's own estimator part (one rule: RiskComposite.p_estimator), missing as 0."""
    from gpuwatch.predict.composite import RiskComposite

    return np.nan_to_num(RiskComposite.estimator_part(*(column(tl, n) for n in RiskComposite.ESTIMATOR)), nan=0.0)


def baseline_metrics(timelines: list[Timeline], horizon_s: float = HORIZON_S) -> dict[str, Metrics]:
    return {name: event_metrics(timelines, [fn(tl).astype(float) for tl in timelines], 0.5, horizon_s)
            for name, (_, fn) in BASELINES.items()}


def recall_at_fa(timelines: list[Timeline], scores: list[np.ndarray], fa_per_hour: float,
                 horizon_s: float = HORIZON_S, near: bool = False) -> Metrics | None:
    """The model's best metrics with no more false alarms per healthy hour (near the limit, with
    `near`) than `fa_per_hour`."""
    best = None
    for t in _candidates(scores):
        m = event_metrics(timelines, scores, float(t), horizon_s)
        if (fa := _fa(m, near)) is not None and fa <= fa_per_hour + 1e-9:
            if best is None or m.caught > best.caught:
                best = m
    return best
