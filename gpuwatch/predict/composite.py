"""The shipped risk: the peak estimator's probability as the backbone, a classifier beside it for what
the estimator cannot see, each at its own operating point.

    risk = max(p_estimator x 0.5 / t_e [+ above the alarm: (1 - 0.5 / t_e) x (1 - exp(-over / OVER_SCALE))],
               p_classifier x 0.5 / t_c), clipped to 0..1; alarm at 0.5

`p_estimator` is the feature `peak_cross_p` (predict/peak.py: the probability that a step within the
horizon peaks over the usable limit; no learning), or `ahead_cross_p` where that is higher (the largest
step the workload plans within the lookahead, predict/ahead.py: the warning's lead time).
`p_classifier` is gradient-boosted trees over the context features only (leaks and slow growth, the allocator's fragmentation, other processes, telemetry
gaps, what happened before), trained without re-weighting the classes so that its output stays near a
frequency. `t_e` and `t_c` are picked on out-of-fold scores (predict/train.py): the pair that catches
the most OOMs within the false-alarm budget near the limit. Either part alone reaching its threshold
raises the alarm; below it the risk still rises with both. A part that is switched off has t = inf.

Above the alarm, the estimator's part goes on rising with `over`: how far the plan's estimated peak lies over
the usable limit (the next step's, `next_peak_est_frac`, or the lookahead's largest, `ahead_peak_est_frac`,
less 1). Without it a probability of ~1 is every alarm's ceiling (0.5 / t_e, 0.83 at t_e = 0.6), so a step
estimated 0.3 % over the usable limit (which fits under the cap: the limit keeps a fragmentation margin) and
one 20 % over score the same, and no threshold above the alarm tells them apart: on the four pooled blind sets
(2901, 2903, 2905, 2906) the risk caught nothing at vramtop's near-limit false-alarm rate (6.2/h) where vramtop
caught 98 of 262; ranked by `over` it catches 214 (session 43, docs/BENCHMARKS.md). A failed shape's alarm
(peak.py FAILED_P) carries no excess and stays at the ceiling: a threshold above the alarm drops it before
any alarm estimated over the limit. Where the alarm is raised
is unchanged (p_estimator >= t_e exactly as before): this orders the alarms, it adds or removes none.
OVER_SCALE = 0.1: of 0.005, 0.03, 0.1 and 0.5 the one that keeps catches on those sets both at 0 near-limit
false alarms and at vramtop's rate (benchmarks/alarm_excess.py; 0.005-0.03 saturate within a few percent over,
tying the alarms again); chosen on sets that are seen now, so a blind set recorded after it says what it is worth.

Why not one classifier over everything: measured on the H200 sessions (models/risk.md, ablation), trees
over the estimator's figures and the context together raised several times more false alarms near the
limit at the same recall than the estimator alone - the context features (memory at 95 %, say) make
a steady run near its cap look like the runs that failed.
"""

from __future__ import annotations

import math

import numpy as np

from gpuwatch.predict.features import NAMES

ALARM = 0.5  # the composite's alarm threshold (the manifest's)
OVER_SCALE = 0.1  # of the usable limit: the estimated excess at which the part above the alarm is 63 % of the way to 1


class RiskComposite:
    """A scikit-learn-like classifier (predict_proba over rows of all features, NAMES order)."""

    # the features `over_limit` takes, in its order
    OVER = ("next_peak_est_frac", "ahead_peak_est_frac")

    def __init__(self, classifier, t_estimator: float, t_classifier: float) -> None:
        self.classifier = classifier
        self.t_estimator = float(t_estimator)
        self.t_classifier = float(t_classifier)
        self.est_index = NAMES.index("peak_cross_p")
        self.ahead_index = NAMES.index("ahead_cross_p")
        self.trend_index = NAMES.index("trend_cross_p")
        self.over_indices = tuple(NAMES.index(n) for n in self.OVER)
        self.classes_ = np.array([0, 1])

    def combine(self, p_est: np.ndarray, p_clf: np.ndarray, over: np.ndarray | None = None) -> np.ndarray:
        """The composite's (1 - risk, risk) from the estimator's and the classifier's probabilities, and
        the estimate's excess over the usable limit (`over_limit`; None: the estimator's part stops at its
        probability's ceiling)."""
        # np.where, not np.nan_to_num: the live scorer calls this for one row five times a second, and
        # nan_to_num costs ~65 us a call there (a profile of the live round: 3 of them were 0.2 ms)
        top = ALARM / self.t_estimator if math.isfinite(self.t_estimator) else 0.0
        a = np.where(p_est == p_est, p_est, 0.0) * top
        if over is not None and top > 0.0:  # above the alarm only: which alarms it raises is unchanged
            a = np.where(a >= ALARM, a + max(1.0 - top, 0.0) * -np.expm1(-np.maximum(over, 0.0) / OVER_SCALE), a)
        b = np.where(p_clf == p_clf, p_clf, 0.0) * (ALARM / self.t_classifier if math.isfinite(self.t_classifier) else 0.0)
        r = np.clip(np.maximum(a, b), 0.0, 1.0)
        return np.stack([1.0 - r, r], axis=1)

    def predict_proba(self, X) -> np.ndarray:
        X = np.asarray(X, dtype=np.float64)
        p_clf = self.classifier.predict_proba(X)[:, 1] if math.isfinite(self.t_classifier) else np.zeros(len(X))
        return self.combine(self.p_estimator(X), p_clf, self.over(X))

    def over(self, X: np.ndarray) -> np.ndarray:
        """`over_limit` of rows of all features."""
        i, j = self.over_indices  # (a model saved before them has other features: load_model refuses it)
        return self.over_limit(X[:, i], X[:, j])

    @staticmethod
    def over_limit(next_frac: np.ndarray, ahead_frac: np.ndarray) -> np.ndarray:
        """How far the plan's estimated peak lies over the usable limit (a fraction of it; 0 at or under
        it, and where nothing is estimated): the larger of the next step's and the lookahead's."""
        f = np.fmax(next_frac, ahead_frac)
        return np.where(f == f, np.maximum(f - 1.0, 0.0), 0.0)

    def p_estimator(self, X: np.ndarray) -> np.ndarray:
        """The estimator's part per row: the highest of the next step's probability (with the per-step
        growth carried on), the lookahead's (predict/ahead.py) and the trend's (growth the plan does not
        explain, predict/trend.py); missing ones count as 0, all missing stays missing."""
        return self.estimator_part(X[:, self.est_index], X[:, self.ahead_index], X[:, self.trend_index])

    # the features `estimator_part` takes, in its order
    ESTIMATOR = ("peak_cross_p", "ahead_cross_p", "trend_cross_p")

    @staticmethod
    def estimator_part(next_step: np.ndarray, ahead: np.ndarray, trend: np.ndarray) -> np.ndarray:
        """`p_estimator` of those three features' columns (evaluation's, where a timeline keeps only them)."""
        return np.fmax(np.fmax(next_step, ahead), trend)

    def signals(self, X: np.ndarray) -> dict[str, np.ndarray]:
        """Each signal of the estimator's part per row (missing = NaN): which one carries the risk."""
        return {"next step": X[:, self.est_index], "lookahead": X[:, self.ahead_index], "trend": X[:, self.trend_index]}

    def fast(self, classifier_proba):
        """predict_proba with the classifier's own fast path (the scorer's tree walker)."""
        def proba(X):
            X = np.asarray(X, dtype=np.float64)
            p_clf = classifier_proba(X)[:, 1] if math.isfinite(self.t_classifier) else np.zeros(len(X))
            return self.combine(self.p_estimator(X), p_clf, self.over(X))
        return proba

    def parts(self, x) -> dict[str, float]:
        """Each part's probability for one row (shown on screen and in `score --json`)."""
        X = np.asarray([x], dtype=np.float64)
        p_clf = float(self.classifier.predict_proba(X)[0, 1])
        return {"estimator": float(np.nan_to_num(self.p_estimator(X)[0])), "classifier": p_clf}
