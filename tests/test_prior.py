"""The first step's a-priori estimate (predict/prior.py, judged by predict/first_step.py) on real H200 recordings: a session's first step,
before anything has run, judged from earlier runs of the same model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gpuwatch.control.guard import Guard
from gpuwatch.control.policy import GuardConfig
from gpuwatch.predict import features as F
from gpuwatch.predict import first_step as J
from gpuwatch.predict import prior as P
from gpuwatch.predict.dataset import session_timelines
from gpuwatch.recording.source import ReplaySource
from gpuwatch.telemetry.bus import Bus

ROOT = Path(__file__).resolve().parents[1]
NC = ROOT / "recordings" / "h200-nearcap-2026-12-01"
# small-preset decode, three sessions: b32 ran out of memory on its first step under a 2.3 GiB cap; the other
# two ran (at 32 after their own first-step OOM at 64, and a ramp through 32..128) - the library's data
DECODE_FAILED = NC / "nc-small-decode-b32"
DECODE_OTHERS = [NC / "nc2-small-decode-b64", NC / "nc3-small-decode-rampmax-b128"]
# v2-lite prefill b48 ran its first step at 93 % of its cap; the library from other v2-lite prefill runs
V2_RAN = NC / "nc-v2lite-prefill-b48"
V2_OTHERS = [NC / "nc3-v2lite-prefill-rampmax-b64", NC / "nc2-v2lite-prefill-frag-b24"]
ALARM_P = 0.6


def _only(rows: list[dict], name: str) -> dict:
    hit = [r for r in rows if r["session"] == name]
    assert len(hit) == 1, rows
    return hit[0]


def test_a_first_step_that_cannot_fit_is_warned_and_one_that_fits_is_not():
    failed = J.judge(J.first_attempts(DECODE_FAILED)[0], P.build(DECODE_OTHERS), ALARM_P)
    assert failed["outcome"] == "OOM" and failed["shape"] == "32x512"
    assert failed["alarm"] and failed["p"] >= 0.9 and failed["room_over_act"] < 1.0
    ran = J.judge(J.first_attempts(V2_RAN)[0], P.build(V2_OTHERS), ALARM_P)
    assert ran["outcome"] == "ran" and not ran["alarm"] and ran["room_over_act"] > 1.3
    # no library entry for the model: no estimate, no alarm (a v2-lite library says nothing of the small preset)
    none = J.judge(J.first_attempts(DECODE_FAILED)[0], P.build(V2_OTHERS), ALARM_P)
    assert none["p"] is None and not none["alarm"]


def test_leave_one_out_never_lets_a_session_speak_for_itself():
    rows = J.leave_one_out([DECODE_FAILED, *DECODE_OTHERS], ALARM_P)
    # nc2-small-decode-b64 also failed its first step (64 under 3.7 GiB): the others' library warns it too
    assert _only(rows, "nc2-small-decode-b64")["alarm"] and _only(rows, "nc2-small-decode-b64")["outcome"] == "OOM"
    assert _only(rows, DECODE_FAILED.name)["alarm"]
    ramp = _only(rows, "nc3-small-decode-rampmax-b128")  # a ramp starts at a quarter of its batch: room enough
    assert ramp["outcome"] == "ran" and not ramp["alarm"]
    s = J.summary(rows)
    assert s == {"first_steps": 3, "oom": 2, "oom_warned": 2, "ran": 1, "ran_alarmed": 0, "no_estimate": 0}


def test_a_retry_before_any_step_is_judged_as_a_first_step_too():
    """Blind set 2906's steady decode failed its first step at 26 x 256 under a 1.55 GiB cap and ran the
    recovery's 13 x 256: both attempts are first steps (no step row before either), judged at the moment
    before each - the retry after its recovery, at the plan that recovery recorded."""
    import polars as pl

    s = ROOT / "recordings" / "heldout-h200-2026-12-06-blind-2906" / "ho-01-small-decode-none-b26-s256"
    a = J.first_attempts(s)
    assert [(x["attempt"], x["outcome"]) for x in a] == [(1, "OOM"), (2, "ran")]
    ev = a[0]["src"].events_df
    rec = int(ev.filter(pl.col("kind") == "oom_recovered")["ts"].dt.epoch("us")[0])
    oom = int(ev.filter(pl.col("kind") == "oom")["ts"].dt.epoch("us")[0])
    assert a[0]["end_us"] < oom <= rec <= a[1]["end_us"]
    lib = P.build(DECODE_OTHERS + [DECODE_FAILED])
    first, retry = (J.judge(x, lib, ALARM_P) for x in a)
    assert first["shape"] == "26x256" and retry["shape"] == "13x256" and retry["attempt"] == 2
    # a prefill's retry starts within milliseconds of its recovery, before any sample: judged at the recovery
    p = ROOT / "recordings" / "heldout-h100-2026-12-06-blind-2905" / "ho-04-small-prefill-none-b46-s384"
    b = J.first_attempts(p)
    assert [(x["attempt"], x["outcome"]) for x in b] == [(1, "OOM"), (2, "ran")]
    ev = b[0]["src"].events_df
    assert b[1]["end_us"] == int(ev.filter(pl.col("kind") == "oom_recovered")["ts"].dt.epoch("us")[0])
    assert J.judge(b[1], lib, ALARM_P)["shape"] == "23x384"


def test_the_library_survives_the_manifest_and_a_bad_one_is_none():
    lib = P.build(DECODE_OTHERS)
    back = P.ShapeLibrary.from_json(__import__("json").loads(__import__("json").dumps(lib.to_json())))
    a = lib.first_step("small:476282880", "decode", "bf16", 32, 512, 2.5 * 2**30)
    b = back.first_step("small:476282880", "decode", "bf16", 32, 512, 2.5 * 2**30)
    assert a is not None and (a.mean, a.sigma, a.p_next) == (b.mean, b.sigma, b.p_next)
    assert lib.first_step("small:476282880", "train", "bf16", 32, 512, 2.5 * 2**30) is None  # inference only
    assert lib.first_step("small:476282880", "decode", "bf16", 32, 512, None) is None  # no limit
    for bad in (None, {}, {"entries": {"k": {"keys": [1.0]}}}, {"entries": []}, "x"):
        assert P.ShapeLibrary.from_json(bad) is None
    good = lib.to_json()
    k = next(iter(good["entries"]))
    for field, value in (("keys", 5.0), ("act", [[1.0]] * len(good["entries"][k]["act"])), ("tokens", [float("nan")] *
                         len(good["entries"][k]["tokens"])), ("tokens", good["entries"][k]["tokens"][::-1]), ("weights", -1.0)):
        broken = {"entries": {k: {**good["entries"][k], field: value}}}
        assert P.ShapeLibrary.from_json(broken) is None, field  # never taken, so never a crash at scoring time


def test_after_a_first_step_failed_the_replay_plans_the_recovery_and_a_retry_is_certain():
    """nc5 (held out) ran out of memory at 48 on its first step and recovered at 24: between the OOM and the
    first row, the replay's plan is the recovery's; a first step no smaller than the one that failed is
    forecast to fail again (peak.py's censored observation), whatever the library says."""
    src = ReplaySource(ROOT / "recordings" / "heldout-h200-2026-12-02" / "nc5-small-decode-b48")
    g = src.gpus[0].index
    first_row = int(src.steps_df["ts"].dt.epoch("us")[0])
    rec = int(src.events_df.filter(src.events_df["kind"] == "oom_recovered")["ts"].dt.epoch("us")[0])
    ts = src.times(g)
    w = src.window_at(g, int(ts[(ts > rec) & (ts < first_row)][0]))
    assert w.first_plan == {"batch": 24, "seq_len": 512, "precision": "bf16"}
    lib = P.build(DECODE_OTHERS + [DECODE_FAILED])
    assert F.features(w, None, lib)["peak_cross_p"] < 0.6  # 24 fits by the library
    lib_says = lib.first_step("small:476282880", "decode", "bf16", 48, 512, src.gpus[0].mem_limit_bytes).p_next
    retry = F.features(w, {"batch": 48, "seq_len": 512, "precision": "bf16"}, lib)
    assert retry["peak_cross_p"] >= 0.99 and retry["peak_cross_p"] >= lib_says


def test_replay_knows_the_step_about_to_run_before_the_first_row():
    src = ReplaySource(DECODE_FAILED)
    g = src.gpus[0].index
    assert P.identity(src.gpus[0].workload) == "small:476282880"
    first_row = int(src.steps_df["ts"].dt.epoch("us")[0])
    oom = int(src.events_df.filter(src.events_df["kind"] == "oom")["ts"].dt.epoch("us")[0])
    ts = src.times(g)
    before = src.window_at(g, int(ts[ts < oom][-1]))
    assert before.first_plan["batch"] == 32 and before.first_plan["seq_len"] == 512  # the OOM's shape
    between = src.window_at(g, int(ts[(ts > oom + 500_000) & (ts < first_row)][-1]))
    assert between.first_plan is None  # recorded before oom_recovered carried the next plan: none, not 32 again
    after = src.window_at(g, int(ts[ts > first_row][0]))
    assert after.steps.height and after.first_plan is None


def test_features_take_the_library_only_where_given():
    src = ReplaySource(DECODE_FAILED)
    g = src.gpus[0].index
    oom = int(src.events_df.filter(src.events_df["kind"] == "oom")["ts"].dt.epoch("us")[0])
    w = src.window_at(g, int(src.times(g)[src.times(g) < oom][-1]))
    plain = F.features(w)
    assert np.isnan(plain["peak_cross_p"]) and np.isnan(plain["next_peak_est_frac"])
    lib = P.build(DECODE_OTHERS)
    f = F.features(w, None, lib)
    assert f["peak_cross_p"] >= 0.9 and f["next_peak_est_frac"] > 1.0
    live = F.features(w, {"batch": 48, "seq_len": 512, "precision": "bf16"}, lib)  # a live plan wins over the recorded one
    assert live["next_peak_est_frac"] > f["next_peak_est_frac"] * 1.2
    # training cuts its windows without a library: the first step's figures never come from the session itself
    tl = session_timelines(DECODE_FAILED, stride=5)[0]
    i = int(np.searchsorted(tl.ts_us, oom)) - 1
    assert np.isnan(tl.X[i, F.NAMES.index("peak_cross_p")])


def test_the_guard_scores_the_first_step_itself_when_nothing_was_scored_yet():
    """The first step can start before the scorer's first round: the guard scores its plan itself (the
    library's estimate lives there), and acts before anything ran."""
    pytest.importorskip("torch")
    from gpuwatch.workload.runner import Workload, WorkloadConfig

    w = Workload(Bus(), WorkloadConfig(mode="prefill", batch=32, seq_len=64, overrides={"num_hidden_layers": 1}))
    calls = []
    g = Guard(Bus(), GuardConfig(cooldown_s=0.0), {None: w}, threshold=0.5,
              rescore=lambda gpu, plan: calls.append(plan) or (0.95, [("peak_cross_p", 0.5)],
                                                               {"peak_cross_p": 0.99, "next_peak_est_frac": 1.3}))
    act = g.before_step(w)
    assert calls and calls[0]["batch"] == 32
    assert act.kind != "none" and w.next_plan().batch < 32  # acted before the first step ran
    quiet = Guard(Bus(), GuardConfig(cooldown_s=0.0), {None: w}, threshold=0.5)  # no scorer to ask: as before
    assert quiet.before_step(w).kind == "none" and quiet.last_decision[None]["why_none"] == "no risk scored yet"


def test_a_first_step_is_sized_to_the_library_not_cut_by_a_fifth():
    """On the H200 (calls 38-39), a 20 % cut left two of three first-step OOMs (192 -> 153, 96 -> 76 still
    failed); sized to the estimate they ran (135, 70). Sizing to 90 % of the whole limit cut a v2-lite step,
    weights 88 % of it, from 40 to 5 where 40 fitted: a first step keeps 90 % of the room above the weights
    (and is lowered by at least a fifth, as any step)."""
    from gpuwatch.control.policy import Observation, Policy

    def sized(est, a, batch):
        f = {"next_peak_est_frac": est, "peak_cross_p": 0.99}
        o = Observation(now_s=0.0, risk=0.9, threshold=0.5, planned_batch=batch, last_batch=None, ceiling=None,
                        floor=1, precision="bf16", alloc_frac=a, first_step=True, features=f, fresh=True)
        act = Policy(GuardConfig(cooldown_s=0.0)).decide(o)
        assert act.kind == "lower_ceiling", act
        return act.value
    # the shipped library's figures for the held-out first steps (est, weights / the usable limit)
    assert 28 <= sized(1.189, 0.414, 48) <= 33  # decode b48 under 2.93 GiB: 30 ran, 38 ran, 48 failed
    assert 125 <= sized(1.212, 0.148, 192) <= 140  # prefill b192: 135 ran, 153 failed
    assert 64 <= sized(1.173, 0.143, 96) <= 72  # prefill 96 x 1024: 70 ran, 76 failed
    assert sized(1.003, 0.885, 40) == 32  # v2-lite b40, a false alarm (it fitted at 40): the least cut, a fifth (was 5)


def test_the_guard_sizes_the_first_step_from_the_scored_features():
    """End to end through the guard: the features of a first step carry the library's weights share
    (first_step_base_frac), and the ceiling it sets is sized with it: prefill b192's figures give 138 - not
    a fifth's cut (153, which ran out of memory in call 38), not 90 % of the whole limit (135)."""
    pytest.importorskip("torch")
    from gpuwatch.predict.peak import FIRST_STEP_BASE
    from gpuwatch.workload.runner import Workload, WorkloadConfig

    w = Workload(Bus(), WorkloadConfig(mode="prefill", batch=192, seq_len=64, overrides={"num_hidden_layers": 1}))
    feats = {"peak_cross_p": 0.99, "next_peak_est_frac": 1.212, FIRST_STEP_BASE: 0.148}
    g = Guard(Bus(), GuardConfig(cooldown_s=0.0), {None: w}, threshold=0.5,
              rescore=lambda gpu, plan: (0.82, [("peak_cross_p", 0.6)], dict(feats)))
    act = g.before_step(w)
    assert act.kind == "lower_ceiling" and 136 <= act.value <= 140, act


def test_a_first_step_the_guard_cannot_score_is_no_decision_not_a_crash():
    pytest.importorskip("torch")
    from gpuwatch.workload.runner import Workload, WorkloadConfig

    bus = Bus()
    w = Workload(bus, WorkloadConfig(mode="prefill", batch=8, seq_len=64, overrides={"num_hidden_layers": 1}))
    calls = []

    def broken(gpu, plan):
        calls.append(plan)
        raise ValueError("a malformed library")
    g = Guard(bus, GuardConfig(cooldown_s=0.0), {None: w}, threshold=0.5, rescore=broken)
    assert g.before_step(w).kind == "none" and g.before_step(w).kind == "none"
    assert len(calls) == 1  # tried once, not before every step
    assert [e for e in bus.events.latest(20) if e.kind == "guard_unable" and "first step" in e.message]


def test_a_decodes_cache_is_part_of_its_shapes_need_not_of_the_weights_every_shape_shares():
    # the library's small decode from two near-cap runs at 512-token prompts: its weights are the parameters'
    # bf16 bytes, the KV cache and graph pool each shape kept go with the shape
    lib = P.build(DECODE_OTHERS + [DECODE_FAILED])
    e = lib.entries["small:476282880|decode|bf16"]
    assert e.weights == pytest.approx(476282880 * 2)
    # blind sets 2910 and 2911 (seen since): short-prompt decodes whose first steps ran; the cache at 32 x 512 had
    # been taken whole for them (p 1.0 both, room/act 0.11 and 0.48). The whole training library judges them now
    # and 56 x 512 (2026-12-02), which fitted with room for 1.19 x the need above the weights once the cache was
    # counted under the first step's overhead (the cache is made once, at its size: kept apart from it now)
    held = [ROOT / "recordings" / "heldout-h100-2026-12-07-blind-2910" / "ho-00-v2-lite-decode-none-b23-s128",
            ROOT / "recordings" / "heldout-h100-2026-12-07-blind-2911" / "ho-01-small-decode-none-b35-s128",
            ROOT / "recordings" / "heldout-h200-2026-12-02" / "nc6-small-decode-b56"]
    train = [ROOT / "recordings" / "h200-nearcap-2026-12-01" / n for n in
             ("nc-small-decode-b32", "nc2-small-decode-b64", "nc3-small-decode-rampmax-b128", "nc2-v2lite-decode-b32")]
    full = P.build(train)
    for i, s in enumerate(held):
        r = J.judge(J.first_attempts(s)[0], full, ALARM_P)
        assert r["outcome"] == "ran" and not r["alarm"], r
        assert r["room_over_act"] > (1.25 if i < 2 else 1.2), r  # 56 x 512: 1.23, a run near its cap
    # and the first steps that failed at 512-token prompts are still warned, each by the others' library
    rows = J.leave_one_out(train, ALARM_P)
    assert all(r["alarm"] for r in rows if r["outcome"] == "OOM") and sum(r["outcome"] == "OOM" for r in rows) == 2


def test_the_library_keeps_a_decodes_cache_apart_and_still_reads_an_older_manifest():
    import json

    lib = P.build(DECODE_OTHERS + [DECODE_FAILED])
    key = "small:476282880|decode|bf16"
    e = lib.entries[key]
    assert e.kept is not None and e.kept.shape == e.uk.shape and (e.kept > 0).all()
    j = lib.to_json()
    back = P.ShapeLibrary.from_json(json.loads(json.dumps(j)))
    np.testing.assert_array_equal(back.entries[key].kept, e.kept)
    # the first step needs the weights, what its shape keeps, and the activations under the overhead; its base (what
    # stays whatever the batch, which the guard sizes a cut above) is the weights alone
    fc = lib.first_step("small:476282880", "decode", "bf16", 32, 512, 3 * 2**30)
    kept_32 = float(e.kept[np.searchsorted(e.ut, 32 * 512)])
    assert fc.base == pytest.approx(e.weights)
    assert lib.kept_at("small:476282880", "decode", "bf16", 32, 512) == pytest.approx(kept_32)
    assert 16 * 256 < e.ut[0]  # below the smallest shape: in proportion to tokens
    assert lib.kept_at("small:476282880", "decode", "bf16", 16, 256) == pytest.approx(
        float(e.kept[0]) * 16 * 256 / float(e.ut[0]), rel=1e-9)
    assert lib.kept_at("small:476282880", "prefill", "bf16", 16, 256) == 0.0  # no entry: nothing kept
    act = float(e.med[np.searchsorted(e.ut, 32 * 512)])
    assert fc.mean == pytest.approx(e.weights + kept_32 + P.FIRST_STEP_OVERHEAD * act)
    # a manifest written before (no "kept"): loads, with nothing kept; a malformed "kept" drops the entry
    old = json.loads(json.dumps(j))
    for x in old["entries"].values():
        x.pop("kept", None)
    assert P.ShapeLibrary.from_json(old).entries[key].kept is None
    bad = json.loads(json.dumps(j))
    bad["entries"][key]["kept"] = [-1.0] * len(bad["entries"][key]["keys"])
    assert key not in (P.ShapeLibrary.from_json(bad) or P.ShapeLibrary({})).entries
    # a prefill keeps nothing apart
    assert all(v.kept is None for k, v in P.build(V2_OTHERS).entries.items() if "|prefill|" in k)
