"""Which windows the fit keeps: every window that carries information, and a weighted sample of the long
quiet stretches between them, so that the training set grows with what happened, not with hours of idle.

Informative (all kept, weight 1): a window that is not a plain negative (positive, or dropped near an
OOM), one near the limit (`NEAR_FRAC` of it used, or the estimator's next-step peak there, or any
probability of crossing it), one in the `BEFORE_EVENT_S` before an event of its GPU (or of the whole
session), one within `AROUND_PLAN_S` of a plan change. The rest are quiet; of each run of them, the
first and last `QUIET_EDGE_S` are kept too (the way into and out of a quiet stretch), and the inside is
sampled: every `QUIET_EVERY`-th window kept, weighing the windows it stands for (the last one of a
stretch the remainder), so each stretch weighs in the fit what it weighed whole. Deterministic (no
random draw): the same windows and weights in any process.

Evaluation never samples: the card's figures are over every window.
"""

from __future__ import annotations

import numpy as np

from gpuwatch.predict.features import NAMES

NEAR_FRAC = 0.8
BEFORE_EVENT_S = 60.0
AROUND_PLAN_S = 30.0
QUIET_EDGE_S = 60.0
QUIET_EVERY = 10

_NEAR = [NAMES.index(n) for n in ("mem_used_frac", "mem_max_frac_30s", "next_peak_est_frac", "torch_peak_max_frac")]
_CROSS = [NAMES.index(n) for n in ("peak_cross_p", "ahead_cross_p")]


def informative(ts: np.ndarray, X: np.ndarray, y: np.ndarray, events_us: np.ndarray, plans_us: np.ndarray
                ) -> np.ndarray:
    """True for the windows (times `ts`, us; features X; labels y) that are always kept."""
    keep = y != 0
    if X.size:
        near = np.nan_to_num(X[:, _NEAR], nan=0.0).max(axis=1) >= NEAR_FRAC
        cross = np.nan_to_num(X[:, _CROSS], nan=0.0).max(axis=1) > 0.0
        keep |= near | cross
    keep |= _within(ts, np.sort(events_us), BEFORE_EVENT_S, 0.0)
    keep |= _within(ts, np.sort(plans_us), AROUND_PLAN_S, AROUND_PLAN_S)
    return keep


def _within(ts: np.ndarray, marks: np.ndarray, before_s: float, after_s: float) -> np.ndarray:
    """True where some mark m has m - before <= t <= m + after."""
    if not marks.size or not ts.size:
        return np.zeros(ts.size, dtype=bool)
    i = np.searchsorted(marks, ts - int(after_s * 1e6), side="left")  # the first mark >= t - after
    ok = i < marks.size
    nxt = marks[np.minimum(i, marks.size - 1)]
    return ok & (nxt <= ts + int(before_s * 1e6))


def fit_weights(ts: np.ndarray, keep: np.ndarray, interval_s: float) -> np.ndarray:
    """Per window: how many windows it stands for in the fit (0: left out). `keep`: the informative ones."""
    w = keep.astype(np.float64)
    edge = max(1, int(round(QUIET_EDGE_S / max(interval_s, 1e-9))))
    quiet = ~keep
    if not quiet.any():
        return w
    d = np.diff(np.r_[0, quiet.astype(np.int8), 0])
    for a, b in zip(np.where(d == 1)[0], np.where(d == -1)[0]):  # each quiet run [a, b)
        if b - a <= 2 * edge:
            w[a:b] = 1.0
            continue
        w[a:a + edge] = 1.0
        w[b - edge:b] = 1.0
        inner = np.arange(a + edge, b - edge)
        picked = inner[::QUIET_EVERY]
        w[picked] = QUIET_EVERY
        w[picked[-1]] = inner.size - QUIET_EVERY * (picked.size - 1)
    return w
