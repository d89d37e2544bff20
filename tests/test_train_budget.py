"""Issue 31 (3): bounded memory - the final fit's rows under a budget (`train --max-windows`,
predict/budget.py), the windows waiting on disk rather than in the main process, the same model where the
budget holds them all and for any number of workers where it does not."""

from __future__ import annotations

import hashlib
import pickle

import numpy as np
import pytest

from conftest import ROOT

LONG = ROOT / "recordings" / "h200-oom-2026-11-30" / "ok-long-train-b13-soak"  # 4 min, quiet stretches
CAPPED = ROOT / "recordings" / "sample-h200-capped-ramp-train"


def _timeline(name: str, n: int, pos: int, inf: int, rng: np.random.Generator):
    """A hand-built sampled timeline: `pos` positives, `inf` other informative windows, the rest quiet
    (weights 1..10, as the sample of a quiet stretch gives them)."""
    from gpuwatch.predict.dataset import Timeline
    from gpuwatch.predict.features import NAMES

    y = np.zeros(n, dtype=np.int8)
    y[:pos] = 1
    informative = np.zeros(n, dtype=bool)
    informative[:pos + inf] = True
    w = np.where(informative, 1.0, rng.integers(1, 11, n).astype(np.float64))
    X = rng.random((n, len(NAMES)))
    e = np.empty(0, dtype=np.int64)
    return Timeline(name, "steady-train", 0, np.arange(n, dtype=np.int64) * 100_000, X, y, e, e, e, w=w,
                    inf=informative)


def test_allocate_splits_a_budget_in_proportion_and_leaves_no_group_out():
    from gpuwatch.predict.budget import allocate

    assert allocate([3, 4], 10) == [3, 4]
    q = allocate([1000, 10, 0, 1], 101)
    assert sum(q) == 101 and q[2] == 0 and q[3] == 1 and q[1] >= 1 and q[0] > 90
    assert allocate([5, 9, 7], 2) == [0, 1, 1]  # fewer rows than groups: the largest groups first
    assert allocate([5, 9, 7], 0) == [0, 0, 0]


def test_the_budget_is_honoured_informative_windows_kept_and_weights_preserved():
    """Over the budget: rows <= N, every positive and informative window kept (they fit), the quiet ones
    sampled so that each timeline's quiet weight is what it was; deterministic for a seed."""
    from gpuwatch.predict.budget import build

    rng = np.random.default_rng(7)
    tls = [_timeline(f"s{i}", n, pos, inf, rng) for i, (n, pos, inf) in
           enumerate([(5000, 40, 300), (2000, 0, 100), (800, 10, 10), (300, 0, 0)])]
    budget = 1500
    fs = build(tls, budget, seed=3)
    assert fs.X.shape[0] == fs.y.size == fs.raw_w.size <= budget
    s = fs.summary
    assert s["seen"] == 8100 and s["kept"] == fs.y.size
    assert s["tiers"]["positive"] == {"seen": 50, "kept": 50}
    assert s["tiers"]["informative"] == {"seen": 410, "kept": 410}
    assert s["tiers"]["quiet"]["kept"] == budget - 460 and "every informative window kept" in s["note"]
    for t, (a, b) in zip(tls, fs.bounds):
        n_inf = int(t.inf.sum())
        assert np.array_equal(fs.X[a:a + n_inf], t.X[:n_inf])  # the informative rows first in each, all there
        assert np.all(fs.raw_w[a:a + n_inf] == 1.0)
        assert fs.raw_w[a + n_inf:b].sum() == pytest.approx(t.w[~t.inf].sum(), rel=1e-12)  # the quiet weight kept
        assert b - a - n_inf >= 1  # every timeline keeps some of its quiet running
    again = build(tls, budget, seed=3)
    assert np.array_equal(again.X, fs.X) and np.array_equal(again.raw_w, fs.raw_w)
    assert not np.array_equal(build(tls, budget, seed=4).X, fs.X)


def test_informative_windows_over_the_budget_are_sampled_too_and_said_so():
    from gpuwatch.predict.budget import QUIET_SHARE, build

    rng = np.random.default_rng(1)
    tls = [_timeline(f"s{i}", 3000, 20, 1500, rng) for i in range(3)]
    fs = build(tls, 1000)
    s = fs.summary
    assert fs.y.size == 1000 and s["tiers"]["positive"]["kept"] == 60  # positives first
    assert s["tiers"]["quiet"]["kept"] == int(1000 * QUIET_SHARE)  # idle running keeps its share
    assert s["tiers"]["informative"]["kept"] == 1000 - 60 - 100 < s["tiers"]["informative"]["seen"]
    assert "informative windows alone exceed it" in s["note"]
    for t, (a, b) in zip(tls, fs.bounds):  # each timeline weighs in the fit what it weighed whole
        assert fs.raw_w[a:b].sum() == pytest.approx(t.w.sum(), rel=1e-12)


def test_under_the_budget_the_fit_is_the_whole_sample_s_byte_for_byte():
    """Where every row fits, the budget's matrix and weights are the timelines' own, and the classifier the
    same bytes as `fit` of the timelines (what keeps the shipped model's bytes)."""
    from gpuwatch.predict.budget import build
    from gpuwatch.predict.dataset import load_sessions
    from gpuwatch.predict.train import _xy, fit, fit_set, fit_threads, weights

    tls, _ = load_sessions([CAPPED, LONG], stride=10, sample=True)
    fs = build(tls)
    X, y = _xy(tls)
    assert fs.summary["note"] is None and fs.summary["kept"] == y.size
    assert np.array_equal(fs.X, X, equal_nan=True) and np.array_equal(fs.y, y)
    assert np.array_equal(fs.weights(), weights(tls, balance=False))
    with fit_threads(2):
        assert pickle.dumps(fit_set(fs)) == pickle.dumps(fit(tls))


def test_without_evaluation_the_main_process_holds_no_window(tmp_path):
    """With a fit folder, the workers write each timeline's fit rows there and hand back none (0 rows held
    per timeline); the budget then reads them one timeline at a time: at most the budget's rows and one
    timeline's at once - the same rows as from timelines held in memory."""
    from gpuwatch.predict.budget import build
    from gpuwatch.predict.dataset import describe, load_sessions

    held, _ = load_sessions([CAPPED, LONG], stride=10, compact=True)
    disk, _ = load_sessions([CAPPED, LONG], stride=10, compact=True, fit_dir=tmp_path / "fit")
    assert sum(t.X.shape[0] + t.y.size + t.ts_us.size for t in disk) == 0
    assert all(t.shard is not None and t.shard.exists() for t in disk)
    assert describe(disk) == describe(held)
    largest = max(t.y.size for t in held)
    for budget in (10**9, 300):
        a, b = build(held, budget), build(disk, budget)
        assert np.array_equal(a.X, b.X, equal_nan=True) and np.array_equal(a.raw_w, b.raw_w)
        assert b.y.size <= budget and b.peak_rows <= min(budget, b.summary["seen"]) + largest


def test_a_budgeted_fit_is_the_same_for_one_and_two_workers_and_the_card_says_what_was_kept(tmp_path):
    from gpuwatch.predict.train import train

    out = {}
    for jobs in (1, 2):
        rep = train([CAPPED, LONG], tmp_path / f"j{jobs}" / "m.joblib", progress=lambda _s: None, stride=10,
                    evaluate=False, counterfactual=False, jobs=jobs, max_windows=150)
        out[jobs] = hashlib.sha256(rep.model_path.read_bytes()).hexdigest()
        assert rep.data["fit"]["kept"] <= 150 < rep.data["fit"]["seen"]
    assert out[1] == out[2]
    card = rep.card_path.read_text()
    assert "The final fit saw" in card and "kept 150 (at most 150" in card and "sampled with weights" in card


def test_an_operating_point_tie_goes_to_the_earlier_warning_then_the_higher_thresholds():
    from gpuwatch.predict.evaluate import Metrics
    from gpuwatch.predict.train import preference

    def m(caught, fa, lead, p10):
        return Metrics(threshold=0.5, oom_events=282, caught=caught, recall=None, episodes=0, episodes_caught=0,
                       episode_recall=None, onsets=0, false_alarms=fa, event_precision=None, healthy_hours=3.3,
                       false_alarms_per_hour=None, lead_s_median=lead, lead_s_p10=p10, lead_steps_median=None,
                       lead_steps_p10=None)

    # the retrain of session 51: 0.6 and 0.9 caught 272 with 8 false alarms; 0.6 warned earlier (p10 3.2 s, 2.8 s)
    rows = [(0.6, 2.0, m(272, 8, 4.3, 3.2)), (0.9, 2.0, m(272, 8, 4.3, 2.8)), (0.5, 2.0, m(271, 8, 4.4, 3.5))]
    assert max(rows, key=preference)[0] == 0.6
    rows.append((0.7, 2.0, m(272, 8, 4.3, 3.2)))  # the same leads: the lower estimator threshold, which alarms no later
    assert max(rows, key=preference)[0] == 0.6
    assert max([(0.6, 0.9, m(272, 8, 4.3, 3.2)), (0.6, 2.0, m(272, 8, 4.3, 3.2))], key=preference)[1] == 2.0
    rows.append((0.8, 2.0, m(272, 7, 4.0, 2.0)))  # fewer false alarms come before the lead
    assert max(rows, key=preference)[0] == 0.8
    assert preference((0.6, 2.0, m(272, 8, None, None))) < preference((0.9, 2.0, m(272, 8, 0.1, 0.1)))
