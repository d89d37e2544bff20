"""The next step's peak estimator, the memory basis on a shared GPU, counterfactual caps, and the model
file / output checks - on real H200 sessions where the behaviour depends on data."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from gpuwatch.errors import UsageError
from gpuwatch.predict import counterfactual as CF
from gpuwatch.predict import features as F
from gpuwatch.predict.model import ModelError, check_output, load_model
from gpuwatch.predict.peak import fit_steps, forecast, usable_limit
from gpuwatch.recording.frames import own_used
from gpuwatch.recording.source import ReplaySource

from conftest import ROOT

GiB = 2**30
NEAR = ROOT / "recordings" / "h200-nearcap-2026-12-01"
CAPPED = ROOT / "recordings" / "sample-h200-capped-ramp-train"  # 3 OOMs at batch 15 under 80 GiB
RAMP = ROOT / "recordings" / "sample-h200-ramp-train"  # uncapped ramp to the card's edge
ALONE = ROOT / "recordings" / "h200-oom-2026-11-30" / "ok-small-prefill-cap20"


def _fc(batches, peaks, allocs, plan_batch, limit, seq=512, prec=None, plan_prec=None, step_s=0.5):
    n = len(batches)
    return forecast(np.array(batches, float), np.full(n, float(seq)), np.ones(n), prec or ["bf16"] * n,
                    np.array(allocs, float), np.array(peaks, float), np.full(n, step_s), plan_batch, seq,
                    plan_prec, limit)


def test_a_repeated_shape_predicts_its_own_peak():
    fc = _fc([8] * 10, [40 * GiB] * 10, [30 * GiB] * 10, 8, 48 * GiB)
    assert fc.mean == pytest.approx(40 * GiB)
    assert fc.p_next < 1e-6  # 8 GiB of room, a tight spread: no danger in a steady run at 83 %
    near = _fc([8] * 10, [40 * GiB] * 10, [30 * GiB] * 10, 8, 40.2 * GiB)
    assert 0.0 < near.p_next < 0.5  # right at the limit: uncertain, below even odds


def test_accumulating_steps_hold_their_gradients_and_the_plan_adds_them_once():
    """A train step of 2 micro-batches holds the first one's gradients (here 10 GiB) over the second: learned
    where steps ran both ways, the prior (all allocated between steps) before any accumulated, and nothing added
    where every step accumulated (their activations carry it already)."""
    from gpuwatch.predict.peak import fit_steps

    alloc, lim = 10 * GiB, 100 * GiB
    n = 8
    # 4 steps of 8 x 512 whole (activation 20 GiB), 4 of 8 as 2 x 4 (4 x 512: activation 10 GiB + 10 GiB held)
    batch, micro = np.array([8.0] * n), np.array([1.0] * 4 + [2.0] * 4)
    peak = alloc + np.array([20 * GiB] * 4 + [20 * GiB] * 4, float)
    args = (np.full(n, 512.0), micro, ["bf16"] * n, np.full(n, float(alloc)), peak, np.full(n, 0.5), None)
    f = fit_steps(batch, *args, held=True)
    assert f.held == pytest.approx(10 * GiB, rel=0.01)
    assert f.at(4, 512, lim, micro_batches=2).mean == pytest.approx(alloc + 20 * GiB, rel=0.01)
    assert f.at(4, 512, lim).mean == pytest.approx(alloc + 10 * GiB, rel=0.01)
    whole = fit_steps(batch[:4], np.full(4, 512.0), micro[:4], ["bf16"] * 4, np.full(4, float(alloc)), peak[:4],
                      np.full(4, 0.5), None, held=True)
    # the prior: everything allocated between steps, on top of the shape's own activations
    assert whole.at(8, 512, lim, micro_batches=2).mean - whole.at(8, 512, lim).mean == pytest.approx(alloc)
    # learned only against whole steps of the same length: at 1,024 tokens a step (attention's T x S) is not
    # half the memory of 512 x 2 - compared across lengths the held bytes would come out too small
    other_len = fit_steps(batch, np.array([1024.0] * 4 + [512.0] * 4), micro, ["bf16"] * n, np.full(n, float(alloc)),
                          alloc + np.array([50 * GiB] * 4 + [20 * GiB] * 4, float), np.full(n, 0.5), None, held=True)
    assert not np.isfinite(other_len.held) and other_len.at(4, 512, lim, micro_batches=2).mean >= alloc + 20 * GiB
    split = fit_steps(batch[4:], np.full(4, 512.0), micro[4:], ["bf16"] * 4, np.full(4, float(alloc)), peak[4:],
                      np.full(4, 0.5), None, held=True)
    assert split.at(4, 512, lim, micro_batches=2).mean == pytest.approx(alloc + 20 * GiB, rel=0.01)


def _fit_on(session: str, batch: int, held: bool):
    """The estimator fitted on one recorded session's whole steps of one batch size alone."""
    from gpuwatch.predict.peak import fit_steps

    st = pl.read_parquet(ROOT / "recordings" / session / "steps.parquet").filter(pl.col("mode") == "train")
    sub = st.filter(pl.col("batch") == batch)
    col = lambda c: sub[c].cast(pl.Float64).to_numpy()  # noqa: E731
    return fit_steps(col("batch"), col("seq_len"), np.ones(sub.height), sub["precision"].to_list(),
                     col("torch_allocated_bytes"), col("torch_peak_bytes"), col("step_time_s"), "bf16", held=held), st


def test_below_the_smallest_shape_the_planner_scales_with_tokens_down_to_the_optimizer_floor():
    """The planner's estimate of a step smaller than any it has seen (H200, v2-lite train, 512 tokens): in
    proportion to tokens (fitted on 16 x 512 alone, 10 x 512 comes out at its measured 68.2 GB, where "a smaller
    step needs no more" said 90.2 GB - so 3 x 7 was never weighed fairly), but never under the phase that forms
    the gradients: at 2-8 x 512 the peak stays at ~63 GB whatever the batch (everything allocated between steps,
    31.6 GB, is the floor). The risk's features keep the old rule: the shipped model was trained on it."""
    lim = 200e9
    planner, st = _fit_on("guard-h200-2026-12-06/ramp-train-gpuwatch", 16, held=True)
    features, _ = _fit_on("guard-h200-2026-12-06/ramp-train-gpuwatch", 16, held=False)
    measured = float(st.filter(pl.col("batch") == 10)["torch_peak_bytes"].median())
    fc = planner.at(10, 512, lim)
    assert fc.mean == pytest.approx(measured, rel=0.01) and fc.mean + 1.645 * fc.sigma >= measured
    assert features.at(10, 512, lim).mean == pytest.approx(planner.at(16, 512, lim).mean)  # unchanged
    floor_fit, st2 = _fit_on("sample-h200-capped-ramp-train", 10, held=True)
    for b in (2, 5, 8):
        m = float(st2.filter(pl.col("batch") == b)["torch_peak_bytes"].median())
        fb = floor_fit.at(b, 512, lim)
        assert m - 1.645 * fb.sigma <= fb.mean <= m + 0.02 * m, b  # the floor, not b/10 of the activations
    # a micro-batch of an accumulating step has no floor of its own: the held gradients added to it are that phase
    two = planner.at(7, 512, lim, micro_batches=3)
    assert two.mean == pytest.approx(planner.alloc_now + planner.prior_held() + (planner.at(16, 512, lim).mean
                                     - planner.alloc_now) * 7 / 16, rel=0.01)


def test_a_larger_plan_extrapolates_from_the_two_largest_shapes():
    # train memory is flat while the optimizer dominates, then linear: one line over all would miss the bend
    batches = [2, 4, 8, 10, 12]
    peaks = [58.7, 58.7, 59.3, 63.5, 70.4]
    fc = _fc(batches, [p * GiB for p in peaks], [29.4 * GiB] * 5, 15, usable_limit(80 * GiB))
    assert fc.mean / GiB == pytest.approx(70.4 + (70.4 - 63.5) / 2 * 3, abs=0.05)
    assert fc.p_next > 0.5
    between = _fc(batches, [p * GiB for p in peaks], [29.4 * GiB] * 5, 11, usable_limit(80 * GiB))
    assert 63.5 < between.mean / GiB < 70.4


def _curved(seqs, a, b, c, batch=8, alloc=4.0, plan_seq=None):
    """Steps of `batch` x each length whose activations are a + b T + c T S (GiB, T = tokens), planned at plan_seq."""
    acts = [a + b * batch * s + c * batch * s * s for s in seqs]
    n = len(seqs)
    return forecast(np.full(n, float(batch)), np.array(seqs, float), np.ones(n), ["bf16"] * n,
                    np.full(n, alloc * GiB), np.array([(alloc + x) * GiB for x in acts]), np.full(n, 0.5),
                    batch, plan_seq, None, 80 * GiB)


def test_a_plan_longer_than_any_length_seen_follows_the_sessions_own_curvature():
    # attention that keeps its scores grows with tokens x length: with three lengths seen the session's own
    # curvature is fitted, where the slope in tokens of the two longest came out short (2910's loop, 588 -> 675)
    a, b, c = 0.5, 2e-4, 3e-7
    fc = _curved([256, 384, 512], a, b, c, plan_seq=768)
    exact = a + b * 8 * 768 + c * 8 * 768 * 768
    linear = (a + b * 8 * 512 + c * 8 * 512 ** 2) + (b + c * (512 + 384)) * 8 * 256  # the tokens' slope, carried on
    assert fc.mean / GiB - 4.0 == pytest.approx(exact, rel=1e-6)
    assert linear < exact - 0.05
    # no curvature in the session (SDPA keeps no scores): the slope in tokens, as before
    flat = _curved([256, 384, 512], a, b, 0.0, plan_seq=768)
    assert flat.mean / GiB - 4.0 == pytest.approx(a + b * 8 * 768, rel=1e-6)
    # a plan within the lengths seen is not touched
    inside = _curved([256, 384, 512], a, b, c, plan_seq=448)
    act = lambda s: a + b * 8 * s + c * 8 * s * s  # noqa: E731
    assert inside.mean / GiB - 4.0 == pytest.approx((act(384) + act(512)) / 2, rel=1e-6)  # the chord, as before


def test_with_two_lengths_seen_a_longer_plan_leans_toward_tokens_times_length():
    # nothing to learn the curvature from: a quarter of the way to all activations growing as T x S, that
    # bound at 1.645 sigma
    fc = _curved([512, 588], 1.0, 5e-4, 0.0, plan_seq=675)
    a512, a588 = 1.0 + 5e-4 * 8 * 512, 1.0 + 5e-4 * 8 * 588
    lin = a588 + (a588 - a512) / 76 * 87
    bound = a588 * 675 / 588 * 675 / 588
    assert fc.mean / GiB - 4.0 == pytest.approx(lin + 0.25 * (bound - lin), rel=1e-6)
    assert fc.mean + 1.645 * fc.sigma >= bound * GiB + 4.0 * GiB - 1


def test_a_longer_plan_after_a_split_leans_on_the_longest_shape_not_its_neighbour_in_tokens():
    # call s47a: a Trainer curriculum split 16 -> 8 as lengths grew; with two lengths seen, the shape the
    # estimate in tokens leaned on was the largest in tokens - 16 x 600, not the longest, 8 x 1,140 - whose
    # tokens x length bound doubled a 8 x 1,268 step (+-22 % in the call, the planner fell to 3 then 2).
    # Linear activations (SDPA): the lean is the longest shape's, a few per cent.
    batches, seqs = [16, 16, 16, 8, 8, 8], [600, 600, 600, 1140, 1140, 1140]
    acts = [1e-4 * b * s for b, s in zip(batches, seqs)]  # GiB, in proportion to tokens
    n = len(seqs)
    fc = forecast(np.array(batches, float), np.array(seqs, float), np.ones(n), ["bf16"] * n, np.full(n, 4.0 * GiB),
                  np.array([(4.0 + a) * GiB for a in acts]), np.full(n, 0.5), 8, 1268, None, 40 * GiB)
    act, exact = fc.mean / GiB - 4.0, 1e-4 * 8 * 1268
    assert exact <= act < 1.05 * exact  # leaning up by a quarter of 1,268 / 1,140, not of 1,268 / 600
    assert fc.sigma / GiB < 0.08 * exact  # the lean's own and the floor's; 0.55 x leaning on 16 x 600


def test_the_length_rule_is_bounded_by_tokens_times_length_and_reaches_below_the_smallest_tokens():
    """Review of 9c8a55e: three noisy shapes fitted exactly extrapolated to 44.6 GiB for a 2.5 GiB step (blind set
    2908's graph pool); one shape at 128 and a plan at 4,096 leaned toward 169 GiB; and a plan at or below the
    smallest tokens seen (a split, token-budget batching) skipped the rule."""
    from gpuwatch.predict.peak import LONGER_RATIO_MAX, activation_at, shapes

    def est(batches, seqs, acts, b, s, longer=True):
        T = np.array(batches, float) * np.array(seqs, float)
        uk, med, ut, resid = shapes(T, np.array(seqs, float), np.array(acts, float))
        return activation_at(uk, med, ut, resid, float(b * s), float(s), longer=longer)

    rnd = np.random.default_rng(3)
    seqs = [1000, 1004, 1010] * 3
    acts = [(0.5 + 1e-4 * 8 * s) * (1 + 0.005 * rnd.standard_normal()) for s in seqs]
    a, _, _ = est([8] * 9, seqs, acts, 8, 2000)
    longest = np.median([x for x, s in zip(acts, seqs) if s == 1010])
    assert a <= longest * 2000 / 1010 * 2.0 + 1e-9  # tokens x length from the longest shape, no more
    one, _, spread = est([8], [128], [0.1], 8, 4096)
    assert one <= 0.1 * 32 * LONGER_RATIO_MAX and spread <= one  # in proportion (32x), leaning to at most 3x that
    # token-budget batching, eager (activations 0.5 + 5e-5 T + 2e-8 T S): 16 x 512, 8 x 1,024, 4 x 2,048 -> 2 x 4,096
    tb = [(16, 512), (8, 1024), (4, 2048)]
    act = lambda b, s: 0.5 + 5e-5 * b * s + 2e-8 * b * s * s  # noqa: E731
    a_tb, _, _ = est([b for b, _ in tb], [s for _, s in tb], [act(b, s) for b, s in tb], 2, 4096)
    assert a_tb >= act(4, 2048) and a_tb == pytest.approx(act(2, 4096), rel=0.15)
    # the shape library's first-step prior keeps the estimate in tokens
    assert est([8], [128], [0.1], 8, 4096, longer=False)[0] == pytest.approx(0.1 * 32)


def test_blind_2910s_length_jump_is_warned_before_its_oom():
    # the miss read after scoring set 2910 (now seen): 12 x 588 -> 12 x 675 under a 9.14 GiB cap, two lengths
    # seen; the lookahead saw the longer step coming, its estimate in tokens alone said 0.99 of the limit (p 0.36)
    src = ReplaySource(ROOT / "recordings" / "heldout-h100-2026-12-07-blind-2910" / "ho-01-loop-curriculum-b12-s512-1024")
    g = src.gpus[0].index
    oom = src.events_df.filter(pl.col("kind") == "oom")["ts"].dt.epoch("us").to_numpy()[0]
    steps = src.steps_df["ts"].dt.epoch("us").to_numpy()
    f = F.features(src.window_at(g, int(steps[steps < oom][-3])))
    assert f["ahead_peak_est_frac"] > 1.0 and f["ahead_cross_p"] > 0.5


def test_a_leak_is_carried_over_the_horizon():
    allocs = [20 * GiB + i * 0.5 * GiB for i in range(12)]
    peaks = [a + 2 * GiB for a in allocs]
    fc = _fc([8] * 12, peaks, allocs, 8, 30 * GiB, step_s=0.5)  # 10 steps in 5 s: +5 GiB
    assert fc.growth == pytest.approx(0.5 * GiB)
    assert fc.p_next < 0.01 < 0.5 < fc.p_horizon


def test_precision_scales_the_activations():
    fp32 = _fc([8] * 5, [34 * GiB] * 5, [30 * GiB] * 5, 8, 60 * GiB, prec=["bf16"] * 5, plan_prec="fp32")
    assert fp32.mean == pytest.approx(38 * GiB)


def test_the_estimator_warns_one_step_before_each_real_capped_oom():
    src = ReplaySource(CAPPED)
    g = src.gpus[0].index
    ooms = src.events_df.filter(pl.col("kind") == "oom")["ts"].dt.epoch("us").to_numpy()
    steps = src.steps_df["ts"].dt.epoch("us").to_numpy()
    for t in ooms:
        f = F.features(src.window_at(g, int(steps[steps < t][-1])))
        assert f["peak_cross_p"] > 0.5 and f["next_peak_est_frac"] > 1.0
    # and stays calm through a healthy v3-slice prefill at 94 % of its cap (the hidden evaluation's case)
    v3 = ReplaySource(NEAR / "nc-v3slice-prefill-b8")
    ts = v3.times(0)
    ps = [F.features(v3.window_at(0, int(t)))["peak_cross_p"] for t in ts[len(ts) // 5::400]]
    assert max(ps) < 0.01


def test_the_kept_forecasts_change_no_feature(tmp_path):
    """Forecasts kept between windows (features._FORECASTS, for the live rounds that bring no step), and
    replay's step features kept by the rows they read (features._STEPS), give
    every feature the same as computing each window afresh: over real sessions with OOMs, recoveries and
    a lookahead, and a counterfactual copy that shares its source's steps under another cap."""
    from gpuwatch.predict.dataset import session_timelines

    copy = CF.derive(CAPPED, tmp_path)[0].path
    sessions = [CAPPED, NEAR / "nc3-small-prefill-rampmax-b256", ROOT / "recordings" / "sample-h200-guard-fragment"]
    calls = {"n": 0}
    real = F.fit_steps

    def counted(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    F.fit_steps = counted
    F._FORECASTS.clear()
    try:
        for path in [*sessions, copy]:  # not cleared between sessions: the copy's windows meet its source's
            kept = session_timelines(path, stride=1)
            kept_calls, calls["n"] = calls["n"], 0

            def fresh(w, plan=None):
                F._FORECASTS.clear()
                F._STEPS.clear()  # and the step features kept between replay windows (features._steps)
                return F.features(w, plan)
            afresh = session_timelines(path, stride=1, feature_fn=fresh)
            for a, b in zip(kept, afresh):
                assert np.array_equal(a.X, b.X, equal_nan=True), path
            assert kept_calls < calls["n"] * 0.7, (path, kept_calls, calls["n"])  # and most windows reuse them
            calls["n"] = 0
    finally:
        F.fit_steps = real
    # the same steps under another plan (the guard lowered the ceiling between two steps), another
    # lookahead, another cap (the copy's window beside its source's), one OOM more in the events
    src, cp = ReplaySource(CAPPED), ReplaySource(copy)
    t = int(cp.steps_df["ts"].dt.epoch("us").to_numpy()[cp.steps_df.height // 2])  # calm: each input shows
    w, wc = src.window_at(0, t), cp.window_at(0, t)
    assert w.steps.height == wc.steps.height and w.meta.mem_limit_bytes != wc.meta.mem_limit_bytes
    last = w.steps.row(w.steps.height - 1, named=True)
    plans = [None, {"batch": 4, "seq_len": last["seq_len"]}, {"batch": 40, "seq_len": last["seq_len"]},
             {"batch": last["batch"], "seq_len": last["seq_len"], "ahead_batch": 40, "ahead_seq_len": last["seq_len"],
              "ahead_steps": 3}]
    oom = w.events.head(1).with_columns(kind=pl.lit("oom"), detail=pl.lit(json.dumps(
        {"batch": last["batch"], "seq_len": last["seq_len"], "precision": last["precision"]})))
    w_oom = type(w)(w.gpu, w.end_us, w.interval_s, w.samples, w.steps, pl.concat([w.events, oom]), w.meta, w.own)
    same = {"batch": last["batch"], "seq_len": last["seq_len"]}
    cases = [(w, p) for p in plans] + [(wc, p) for p in plans] + [(w, same), (w_oom, same)]
    F._FORECASTS.clear()
    got = [F.vector(F.features(x, p)) for x, p in cases]
    want = []
    for x, p in cases:
        F._FORECASTS.clear()
        want.append(F.vector(F.features(x, p)))
    assert np.array_equal(np.array(got), np.array(want), equal_nan=True)
    assert len({tuple(np.nan_to_num(v)) for v in want}) >= 6  # the cases do differ


def test_a_shared_gpu_counts_the_process_own_memory():
    """Recorded beside 7 other capped workloads and alone: the same command, the same memory basis."""
    shared = ReplaySource(NEAR / "sbs-small-prefill-cap20")
    alone = ReplaySource(ALONE)
    assert shared.gpus[0].pid is not None and alone.gpus[0].pid is None
    fs = F.features(shared.window_at(0, int(shared.times(0)[2000])))
    fa = F.features(alone.window_at(0, int(alone.times(0)[300])))
    assert fs["others_mem_frac"] > 0.3 and fa["others_mem_frac"] < 0.01  # v1: the driver's reserve is in "used"
    assert fs["mem_used_frac"] == pytest.approx(fa["mem_used_frac"], abs=0.01)
    # the whole GPU's memory against this process's cap would read > 100 %
    whole = float(shared.window_at(0, int(shared.times(0)[2000])).samples["gpu_mem_used_bytes"][-1])
    assert whole / shared.gpus[0].mem_limit_bytes > 1.0


def test_counterfactual_cap_fails_the_first_step_over_it(tmp_path):
    steps = pl.read_parquet(RAMP / "steps.parquet")
    peaks = steps["torch_peak_bytes"].to_numpy()
    cap = int(100 * GiB)
    first = int(np.argmax(peaks > usable_limit(cap)))
    r = CF.relabel(RAMP, cap, tmp_path / "v", "ramp-train")
    assert r.virtual_oom and r.oom_step == first
    meta = json.loads((tmp_path / "v" / "meta.json").read_text())
    assert meta["config"]["workloads"][0]["faults"]["memory_limit_bytes"] == cap
    assert meta["derived"]["from"] == RAMP.name and meta["derived"]["scenario"] == "ramp-train"
    src = ReplaySource(tmp_path / "v")
    assert src.steps_df.height == first  # nothing after the virtual OOM
    ev = src.events_df.filter(pl.col("kind") == "oom")
    t_oom = ev["ts"].max()
    samples = pl.read_parquet(tmp_path / "v" / "samples.parquet")
    assert samples["ts"].max() <= t_oom
    assert (pl.read_parquet(tmp_path / "v" / "steps.parquet")["torch_reserved_bytes"] <= cap).all()
    # a cap above every peak: the same run, healthy, under a tighter limit
    hi = CF.relabel(RAMP, int(peaks.max() / 0.9), tmp_path / "h")
    assert not hi.virtual_oom
    assert ReplaySource(tmp_path / "h").steps_df.height == steps.height


def test_counterfactual_rule_never_fails_a_step_that_ran_under_a_real_cap():
    sessions = [CAPPED] + sorted(p for p in NEAR.iterdir() if (p / "meta.json").exists())
    v = CF.validate(sessions)
    assert v["capped_sessions"] >= 10 and v["steps_under_real_caps"] > 5000
    assert v["false_virtual_ooms"] == 0


def test_derived_copies_train_but_are_never_evaluated(tmp_path):
    from gpuwatch.predict.dataset import load_sessions
    from gpuwatch.predict.train import out_of_fold

    tls, warn = load_sessions([CAPPED, ALONE], stride=20, counterfactual=tmp_path)
    assert not warn
    derived = [t for t in tls if t.derived]
    assert derived and all(t.source in (CAPPED.name, ALONE.name) for t in derived)
    oof = out_of_fold(tls, lambda t: t.source)
    assert all(o.size == 0 for o, t in zip(oof, tls) if t.derived)
    assert all(o.size == t.y.size for o, t in zip(oof, tls) if not t.derived)


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_a_model_that_is_a_device_is_refused_at_once(tmp_path):
    shutil.copy(ROOT / "models" / "risk.manifest.json", tmp_path / "zero.manifest.json")
    (tmp_path / "zero.joblib").symlink_to("/dev/zero")
    t0 = time.monotonic()
    with pytest.raises(ModelError, match="not a regular file"):
        load_model(tmp_path / "zero.joblib", trust=True)
    with pytest.raises(ModelError, match="not a regular file"):
        load_model(tmp_path / "zero.joblib")
    assert time.monotonic() - t0 < 2


def test_score_with_a_dev_zero_model_exits_with_one_line(tmp_path, py, env):
    shutil.copy(ROOT / "models" / "risk.manifest.json", tmp_path / "zero.manifest.json")
    (tmp_path / "zero.joblib").symlink_to("/dev/zero")
    r = subprocess.run([py, "-m", "gpuwatch", "score", str(CAPPED), "--model", str(tmp_path / "zero.joblib")],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "not a regular file" in r.stderr and "Traceback" not in r.stderr


def test_train_output_is_checked_before_training(tmp_path):
    folder = tmp_path / "dir.joblib"
    folder.mkdir()
    with pytest.raises(UsageError, match="is a folder"):
        check_output(folder)
    with pytest.raises(UsageError, match="cannot write"):
        check_output(Path("/proc/nope/x.joblib"))
    with pytest.raises(UsageError, match="ends in .joblib"):
        check_output(tmp_path / "model.pkl")
    (tmp_path / "m.joblib").write_bytes(b"x")
    with pytest.raises(UsageError, match="--force"):
        check_output(tmp_path / "m.joblib")
    check_output(tmp_path / "m.joblib", force=True)
    with pytest.raises(UsageError, match="the shipped model"):
        check_output(ROOT / "models" / "risk.joblib")
    check_output(tmp_path / "new.joblib")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.joblib", "m.joblib"]  # no probe left behind


def test_train_cli_refuses_the_shipped_model_and_a_bad_path_before_fitting(py, env, tmp_path):
    for args, needle in ((["-o", "models/risk.joblib"], "--force"), (["-o", "/proc/nope/x.joblib"], "cannot write"),
                         (["-o", str(tmp_path)], "is a folder")):
        t0 = time.monotonic()
        r = subprocess.run([py, "-m", "gpuwatch", "train", str(CAPPED), *args], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert time.monotonic() - t0 < 30
    assert not list(tmp_path.iterdir())


def test_train_refuses_a_named_session_with_a_broken_steps_table(py, env, tmp_path):
    """A session named on the command line that cannot be used is a one-line error before any fitting (defect
    11: it was a warning and exit 0); one found under a folder is skipped instead (tests/test_train_sessions.py)."""
    bad = tmp_path / "bad"
    shutil.copytree(ALONE, bad)
    st = pl.read_parquet(bad / "steps.parquet")
    st.with_columns(pl.col("step_time_s").cast(pl.String)).write_parquet(bad / "steps.parquet")
    r = subprocess.run([py, "-m", "gpuwatch", "train", str(bad), str(CAPPED), "--stride", "20",
                        "--no-eval", "--no-counterfactual", "-o", str(tmp_path / "m.joblib")],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 1 and "steps table cannot be read" in r.stderr and str(bad) in r.stderr, r.stderr
    assert not (tmp_path / "m.joblib").exists()


def test_the_tree_walker_gives_predict_probas_numbers():
    """The scorer walks the shipped model's trees itself (~10x cheaper for one row); it must agree
    with scikit-learn to rounding, NaN (missing telemetry) included, through the column selection."""
    from gpuwatch.predict.scorer import _fast_proba
    from gpuwatch.predict.train import make_estimator

    rng = np.random.default_rng(0)
    X = rng.normal(size=(3000, len(F.NAMES)))
    X[rng.random(X.shape) < 0.1] = np.nan
    y = (np.nan_to_num(X[:, F.NAMES.index("peak_cross_p")]) + 0.5 * np.nan_to_num(X[:, F.NAMES.index("mem_used_frac")])
         + rng.normal(scale=0.5, size=3000) > 0.8).astype(int)
    est = make_estimator()
    est.fit(X, y)
    fast = _fast_proba(est)
    assert getattr(fast, "pure_python", False)
    Xt = rng.normal(size=(200, len(F.NAMES)))
    Xt[rng.random(Xt.shape) < 0.2] = np.nan
    np.testing.assert_allclose(fast(Xt), est.predict_proba(Xt), rtol=1e-9, atol=1e-12)  # a batch
    one = np.vstack([fast(Xt[i:i + 1]) for i in range(60)])  # one row at a time: the walk itself
    np.testing.assert_allclose(one, est.predict_proba(Xt[:60]), rtol=1e-9, atol=1e-12)


def test_a_shape_that_failed_before_is_forecast_to_fail_again():
    """A fragmented allocator fails a shape its activations alone would fit (set 2's prefill ramp failed
    at batch 145 with the estimate at 75 % of the limit); the OOM event is a censored observation."""
    from gpuwatch.predict.peak import FAILED_P, Failed

    batches, peaks, allocs = [93] * 6 + [116] * 6, [3.7 * GiB] * 6 + [4.4 * GiB] * 6, [1.0 * GiB] * 12
    lim = usable_limit(7 * GiB)
    fresh = _fc(batches, peaks, allocs, 145, lim)
    assert fresh.p_horizon < 0.01 and not fresh.failed_before  # the steps alone: it fits
    failed = [Failed(145 * 512, 512, 2.0, 1.0 * GiB)]
    n = len(batches)
    again = forecast(np.array(batches, float), np.full(n, 512.0), np.ones(n), ["bf16"] * n, np.array(allocs),
                     np.array(peaks), np.full(n, 0.5), 145, 512, None, lim, failed=failed)
    assert again.failed_before and again.p_horizon >= FAILED_P and again.mean >= lim
    smaller = forecast(np.array(batches, float), np.full(n, 512.0), np.ones(n), ["bf16"] * n, np.array(allocs),
                       np.array(peaks), np.full(n, 0.5), 116, 512, None, lim, failed=failed)
    assert not smaller.failed_before and smaller.p_horizon < 0.01  # a smaller shape is not condemned
    freed = forecast(np.array(batches, float), np.full(n, 512.0), np.ones(n), ["bf16"] * n,
                     np.array([0.5 * GiB] * n), np.array(peaks), np.full(n, 0.5), 145, 512, None, lim, failed=failed)
    assert not freed.failed_before  # memory freed since: the failure says nothing about now


def test_failed_shapes_come_from_the_recorded_oom_events_and_raise_the_risk_at_the_repeat():
    """nc2-small-prefill-rampmax-b192 (H200): the ramp failed at batch 145 x 512 24 times; from the
    second time on, the step before it (planning 145) has the failed shape in its events window; the
    first time, the plan outgrows the allocator's segments."""
    src = ReplaySource(NEAR / "nc2-small-prefill-rampmax-b192")
    shapes = F.failed_shapes(src.events_df)
    assert len(shapes) == 24 and {(s.tokens, s.seq) for s in shapes} == {(145 * 512, 512)}
    assert all(np.isfinite(s.alloc_before) for s in shapes)
    steps = src.steps_df.filter(pl.col("next_batch") == 145)
    ooms = src.events_df.filter(pl.col("kind") == "oom")["ts"]
    before_second = steps.filter((pl.col("ts") > ooms[0]) & (pl.col("ts") < ooms[1]))["ts"][-1]
    src.seek_to(before_second.timestamp() * 1e6)
    f = F.features(src.window(src.gpus[0].index))
    assert f["peak_cross_p"] >= 0.99 and f["next_peak_est_frac"] >= 1.0
    before_first = steps.filter(pl.col("ts") < ooms[0])["ts"][-1]
    src.seek_to(before_first.timestamp() * 1e6)
    f = F.features(src.window(src.gpus[0].index))
    # the first time: the steps alone put batch 145 at 75 % of the limit, but it needs 12 % of the limit
    # more than any step that ran and the allocator's segments already fill the cap (fragmentation)
    assert f["next_peak_est_frac"] < 0.8 and f["torch_reserved_frac"] > 0.97
    assert f["peak_cross_p"] >= 0.9
    assert f["frag_need_frac"] > 0.6  # the share of the cache it must reuse is high


def test_own_memory_is_the_polars_list_filter_on_every_shipped_recording():
    """frames.own_used (one query) = the per-sample filter it replaced, on real process lists."""
    n = 0
    for p in sorted(ROOT.glob("recordings/**/samples.parquet")):
        s = pl.read_parquet(p)
        meta = json.loads((p.parent / "meta.json").read_text())
        if "gpu_procs" not in s.columns or not meta.get("pid"):
            continue
        ref = s["gpu_procs"].list.eval(pl.element().filter(pl.element().struct.field("pid") == meta["pid"])
                                       .struct.field("used_bytes")).list.first().cast(pl.Float64).to_numpy()
        own, listed = own_used(s["gpu_procs"], meta["pid"])
        assert np.array_equal(own, ref, equal_nan=True), p
        assert np.array_equal(listed, s["gpu_procs"].is_not_null().to_numpy()), p
        n += 1
    assert n >= 16


def test_group_medians_are_numpys_median_per_shape():
    from gpuwatch.predict.peak import _group_medians

    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 8))
        inv = rng.integers(0, n, size=int(rng.integers(n, 40)))
        inv[:n] = np.arange(n)
        x = rng.normal(size=inv.size)
        assert np.allclose(_group_medians(inv, x, n), [np.median(x[inv == i]) for i in range(n)])


def test_a_plan_that_outgrows_full_segments_is_at_risk_and_one_within_them_is_not():
    from gpuwatch.predict.peak import FRAG_P

    batches, peaks, allocs = [93] * 6 + [116] * 6, [3.7 * GiB] * 6 + [4.4 * GiB] * 6, [1.0 * GiB] * 12
    lim = usable_limit(7 * GiB)
    n = len(batches)

    def fc(plan, reserved):
        return forecast(np.array(batches, float), np.full(n, 512.0), np.ones(n), ["bf16"] * n, np.array(allocs),
                        np.array(peaks), np.full(n, 0.5), plan, 512, None, lim, reserved=reserved)

    assert fc(145, 6.9 * GiB).p_horizon >= FRAG_P  # +0.8 GiB over the largest peak, segments at the cap
    assert fc(145, 5.0 * GiB).p_horizon < 0.01  # the same growth fits in the room outside the segments
    assert fc(118, 6.9 * GiB).p_horizon < 0.01  # a small step up: the cached blocks serve it
    assert fc(145, None).p_horizon < 0.01  # no allocator figures (a CPU): no such rule


def test_own_memory_from_row_dicts_is_the_same_as_from_the_frame():
    """The live source's twin of frames.own_used (the new rows still as dicts) gives the same figures."""
    from gpuwatch.recording.frames import own_of_rows

    for p in [NEAR / "nc-v2lite-prefill-b48", NEAR / "nc3-small-decode-rampmax-b128", NEAR / "sbs-small-prefill-cap20"]:
        s = pl.read_parquet(p / "samples.parquet")
        pid = json.loads((p / "meta.json").read_text())["pid"]
        own, listed = own_of_rows(s.to_dicts(), pid)
        ref_own, ref_listed = own_used(s["gpu_procs"], pid)
        assert np.array_equal(own, ref_own, equal_nan=True) and np.array_equal(listed, ref_listed), p


def test_the_plain_python_shapes_equal_numpys_to_the_bit():
    """`shapes` below SMALL_N steps runs in plain Python (a tenth of np.unique's cost at a live window's
    size); it must give numpy's arrays and residual exactly: repeated shapes, ties in tokens with other
    lengths, one step per shape, a single shape."""
    from gpuwatch.predict import peak as P

    rng = np.random.default_rng(7)
    for n in (1, 2, 3, 9, 40, 64):
        for _ in range(30):
            T = rng.choice([512.0, 1024.0, 2048.0, 4096.0], size=n)
            S = rng.choice([128.0, 256.0, 512.0], size=n)
            act = rng.normal(3e9, 2e8, size=n).round() * rng.choice([1.0, 1.0 + 1e-9], size=n)
            a, b = P.shapes(T, S, act), P.shapes_np(T, S, act)
            for x, y in zip(a[:3], b[:3]):
                assert x.dtype == y.dtype and np.array_equal(x, y)
            assert a[3] == b[3]


def test_an_accumulating_micro_batch_below_the_smallest_shape_keeps_the_optimizer_floor():
    """Review of the below-range estimate: a micro-batch of an accumulating step was floored at 0 (the held bytes
    standing for the gradients' phase) - but where the learned held bytes are small (a CUDA-graph pool loop of blind
    set 2904: 7 micro-batches of 1), its peak came out 7 sigma above the estimate. The micro-batch and the held
    bytes now reach everything allocated between steps together."""
    from gpuwatch.predict.peak import fit_steps

    st = pl.read_parquet(ROOT / "recordings" / "heldout-h200-2026-12-06-blind-2904"
                         / "ho-04-loop-graphpool-b7-s384-768-e5" / "steps.parquet").sort("ts")
    col = lambda c: st[c].cast(pl.Float64).to_numpy()  # noqa: E731
    al, pk, mb, b, s = col("torch_allocated_bytes"), col("torch_peak_bytes"), col("micro_batches"), col("batch"), col("seq_len")
    i = 78
    assert mb[i] == 7 and b[i] == 7
    j = np.arange(max(0, i - 64), i)
    fit = fit_steps(b[j], s[j], mb[j], st["precision"].to_list()[j[0]:i], al[j], pk[j], col("step_time_s")[j],
                    st["precision"][i], held=True)
    assert fit.ut[0] > s[i]  # one row at this length: below every shape the window saw
    fc = fit.at(1, s[i], 1e15, micro_batches=7)
    measured = pk[i] - al[i - 1] + fit.alloc_now
    assert measured <= fc.mean + 1.645 * fc.sigma


def test_a_replay_window_reads_the_same_features_from_its_converted_columns():
    """`score` and training read a replay window's rows from numpy columns its source converted once per
    recording (`Window.arrays`, window.Columns); the feature function's other path converts the window's own
    polars frames (live windows, and a window copied with other frames). Every feature is the same both ways,
    at every sample of real sessions: OOMs and recoveries, a guarded run, a side-by-side capped workload whose own
    memory counts, a cache loop's episodes."""
    from dataclasses import replace

    heldout = ROOT / "recordings"
    sessions = [CAPPED, ROOT / "recordings" / "sample-h200-guard-fragment",
                heldout / "heldout-h100-2026-12-06-blind-2905" / "ho-03-small-decode-decode-ramp-b152-s512",
                heldout / "heldout-h200-2026-12-06-blind-2906" / "ho-02-loop-cache-b6-s96-768-e2"]
    for path in sessions:
        src = ReplaySource(path)
        g = src.gpus[0].index
        ts = src.times(g)
        n = 0
        for t in ts[:: max(1, len(ts) // 150)]:
            w = src.window_at(g, int(t))
            assert w.cols is not None  # the columns' path is the one under test
            F._FORECASTS.clear(), F._STEPS.clear()
            a = F.features(w)
            F._FORECASTS.clear(), F._STEPS.clear()
            b = F.features(replace(w, samples=w.samples.clone()))  # other frames: the polars path
            assert replace(w, samples=w.samples.clone()).cols is None
            assert a.keys() == b.keys(), path
            for k in a:
                assert a[k] == b[k] or (a[k] != a[k] and b[k] != b[k]), (path, t, k, a[k], b[k])
            n += 1
        assert n >= 100, path


def test_the_feature_caches_take_inserts_from_two_threads():
    """The dashboard's thread and a background scoring thread fill the feature function's caches at once
    (`gpuwatch watch --source` with the risk scored in the background): dropping the oldest entry read the dict's
    order while the other thread inserted - "dictionary changed size during iteration", or a KeyError. Bounded,
    and no error, under two threads hammering one small cache."""
    import sys
    import threading

    from gpuwatch.threads import keep_bounded

    cache: dict = {}
    errors: list = []
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can

    def fill(base: int) -> None:
        try:
            for i in range(20_000):
                keep_bounded(cache, (base, i), i, 4)
        except Exception as e:  # noqa: BLE001 - what the test is about
            errors.append(e)
    try:
        ts = [threading.Thread(target=fill, args=(b,)) for b in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors and len(cache) <= 4


def test_a_followed_session_cuts_windows_from_its_frames():
    """Following a session still being recorded, each load brings rows: a window carries no columns converted for
    the whole recording (converting them again after every load cost 38-127 ms a window on 100 k-361 k samples,
    against ~8 ms from the window's frames); replay, `score` and training do, and the features are the same."""
    from gpuwatch.recording.source import ReplaySource

    replay, follow = ReplaySource(CAPPED), ReplaySource(CAPPED, follow=True)
    g = replay.gpus[0].index
    t = int(replay.times(g)[len(replay.times(g)) // 2])
    a, b = replay.window_at(g, t), follow.window_at(g, t)
    assert a.cols is not None and b.arrays is None
    F._FORECASTS.clear(), F._STEPS.clear()
    fa = F.features(a)
    F._FORECASTS.clear(), F._STEPS.clear()
    fb = F.features(b)
    assert fa.keys() == fb.keys() and all(fa[k] == fb[k] or (fa[k] != fa[k] and fb[k] != fb[k]) for k in fa)


def test_activations_linear_in_tokens_fit_no_curvature_beyond_the_longest_length():
    """Three lengths whose activations are exactly linear in tokens: the fit's curvature is rounding (+-1e-20 unscaled,
    its sign the CPU's BLAS kernel's: before the columns were scaled and the term's size tested, 76-108 of these 200
    cases took the linear fit for curvature under OpenBLAS' Haswell/SkylakeX/Prescott kernels, and the HF guard
    simulation's estimates moved 256 MiB between them). A real tokens x length term is still learned."""
    import numpy as np

    from gpuwatch.predict.peak import longer_than_seen

    taken = 0
    for k in range(200):
        rng = np.random.default_rng(k)
        lens = np.array(sorted(rng.choice(np.arange(256, 4096, 64), 3, replace=False)), dtype=float)
        m = np.full(3, 8.0) if k % 2 else np.array([16.0, 8.0, 6.0])
        ut = m * lens
        sp = lens[-1] * 1.2
        tp = m[-1] * sp
        a_hat = 2.0e9 + 1.9e5 * tp - 3e8  # the estimate in tokens, below the linear fit's
        taken += longer_than_seen(lens, 2.0e9 + 1.9e5 * ut, ut, tp, sp, a_hat, 1e7)[0] != a_hat
        curved = 2.0e9 + 1.9e5 * ut + 40.0 * ut * lens  # attention's scores kept: a real T x S term
        assert longer_than_seen(lens, curved, ut, tp, sp, a_hat, 1e7)[0] > a_hat
    assert taken == 0


def test_token_budget_batches_beyond_the_longest_length_are_not_underestimated():
    """4 x 1,024, 2 x 2,048, 1 x 4,096 (4,096 tokens each) with attention's scores kept: tokens are one count, so the
    fit cannot tell the constant from the tokens term; scaled, its minimum-norm answer split them and gave 1.61 GiB for
    a step of 1.76 (review of 4ca6819). A fit short of rank takes the prior toward the tokens x length bound."""
    import numpy as np

    from gpuwatch.predict.peak import activation_at, shape_key

    lens, ut = np.array([1024.0, 2048.0, 4096.0]), np.full(3, 4096.0)
    uk = np.array([shape_key(t, s) for t, s in zip(ut, lens)])
    med = 1.9e5 * ut + 5.0 * ut * lens
    tp = sp = 8192.0
    assert activation_at(uk, med, ut, 0.0, tp, sp)[0] >= 1.9e5 * tp + 5.0 * tp * sp


def test_the_usable_limit_is_no_lower_than_the_highest_peak_that_ran_under_it():
    cap = 1.623 * GiB  # blind set 2911's small decode: the 256 MiB floor is 15 % of it
    assert usable_limit(cap) == pytest.approx(cap - 256 * 2**20)
    assert usable_limit(cap, None) == usable_limit(cap)
    assert usable_limit(cap, 1.424 * GiB) == pytest.approx(1.424 * GiB)  # its steps' peak, served again and again
    assert usable_limit(cap, 1.0 * GiB) == usable_limit(cap)  # a lower peak proves nothing more
    assert usable_limit(cap, 1.62 * GiB) == pytest.approx(0.97 * cap)  # the fragmentation share is never given up
    assert usable_limit(48 * GiB, 47.5 * GiB) == usable_limit(48 * GiB)  # above ~8.5 GiB the share decides already


def test_an_inference_steps_kept_cache_is_not_counted_again_as_activations():
    # 2911's decode: 18 x 128 steps, then 34 x 128, whose first step grew the KV cache and graph pool it keeps
    # (allocated 1.016 -> 1.127 GB) and peaked at 1.425; the same step again peaks at 1.424
    G = 1e9
    batches, allocs, peaks = [18] * 6 + [34], [1.016 * G] * 6 + [1.127 * G], [1.019 * G] * 6 + [1.425 * G]

    def est(kept):
        n = len(batches)
        fit = fit_steps(np.array(batches, float), np.full(n, 128.0), np.ones(n), ["bf16"] * n, np.array(allocs),
                        np.array(peaks), np.full(n, 3.0), "bf16", kept=kept)
        return fit.at(34, 128, 1.5 * G).mean

    assert est(True) == pytest.approx(1.425 * G)
    assert est(False) == pytest.approx(1.536 * G)  # the training rule: the first optimizer state comes after its peak


def test_blind_2911s_steady_decode_after_its_oom_is_not_alarmed():
    # the four near-limit false alarms of set 2911 (seen since): 34 x 128 steps at a 1.424 GiB peak under a
    # 1.62 GiB cap, once the recovery had run; the risk (model and estimator) stays below its alarm
    from gpuwatch.predict.model import load_model
    src = ReplaySource(ROOT / "recordings" / "heldout-h100-2026-12-07-blind-2911" / "ho-01-small-decode-none-b35-s128")
    g = src.gpus[0].index
    rec = src.events_df.filter(pl.col("kind") == "oom_recovered")["ts"].dt.epoch("us").to_numpy()[0]
    steps = src.steps_df["ts"].dt.epoch("us").to_numpy()
    after = steps[steps > rec]
    model = load_model(ROOT / "models" / "risk.joblib")
    rows = [F.features(src.window_at(g, int(t))) for t in after]
    est = [r["next_peak_est_frac"] for r in rows if r["next_peak_est_frac"] == r["next_peak_est_frac"]]
    assert len(est) >= 10 and max(est) <= 1.0 + 1e-6  # the last row has no plan left: the workload stopped
    assert rows[-1]["usable_limit_bytes"] == pytest.approx(1.4247 * GiB, rel=1e-4)  # the steps' own peak
    risk = model.estimator.predict_proba(np.array([F.vector(r) for r in rows]))[:, 1]
    assert risk.max() < model.threshold


def test_the_planner_and_the_guard_weigh_plans_against_the_features_usable_limit():
    # 2911's steady decode after its recovery: the planner's estimate of the step that ran and the guard's event
    # bytes are fractions of the same usable limit as the risk's features (the window's own peak raised it)
    from gpuwatch.contract import Config
    from gpuwatch.control.guard import _usable
    from gpuwatch.predict.peak import USABLE
    from gpuwatch.predict.plans import estimate

    src = ReplaySource(ROOT / "recordings" / "heldout-h100-2026-12-07-blind-2911" / "ho-01-small-decode-none-b35-s128")
    g = src.gpus[0].index
    rec = src.events_df.filter(pl.col("kind") == "oom_recovered")["ts"].dt.epoch("us").to_numpy()[0]
    steps = src.steps_df["ts"].dt.epoch("us").to_numpy()
    w = src.window_at(g, int(steps[steps > rec][5]))
    f = F.features(w)
    lim = F.limits(w).alloc_limit
    assert f[USABLE] > usable_limit(lim)  # the evidence moved it
    (mean, _sigma), = estimate(w, [(Config(34, False, "bf16", 1), 128)])
    assert mean == pytest.approx(f["next_peak_est_frac"], rel=1e-9)
    assert _usable(lim, f) == f[USABLE]
    assert _usable(lim, {}) == usable_limit(lim)  # nothing scored yet: the limit's rule alone
