"""Lead from the trend (predict/trend.py), vramtop's rule as a baseline (predict/vramtop.py), and the risk
panel's range (ui/render.py outlook_text)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gpuwatch.predict import trend as T
from gpuwatch.predict import vramtop as V
from gpuwatch.predict.peak import shape_key, usable_limit

GiB = 2**30


def _ramp(cycles: int, kept_per_cycle: float, levels=(8, 10, 12, 16), per_level: int = 3, step_s: float = 0.5):
    """A ramp restarting after each climb: allocated after a step depends on the batch, plus what each
    cycle kept (memory kept across re-captures)."""
    t, key, alloc = [], [], []
    n = 0
    for c in range(cycles):
        for b in levels:
            for _ in range(per_level):
                t.append(n * step_s)
                key.append(shape_key(b * 512, 512))
                alloc.append(2 * GiB + b * 0.05 * GiB + c * kept_per_cycle)
                n += 1
    return np.array(t), np.array(key), np.array(alloc)


def test_a_ramp_alone_grows_nothing_at_the_same_shape():
    t, key, alloc = _ramp(3, 0.0)
    assert T.same_shape_rate(t, key, alloc) == pytest.approx(0.0)
    assert alloc[-1] > alloc[0]  # allocated does change - with the shape


def test_memory_kept_across_restarts_is_its_rate_in_time():
    t, key, alloc = _ramp(3, 0.3 * GiB)
    rate = T.same_shape_rate(t, key, alloc)
    cycle_s = 4 * 3 * 0.5
    # same-shape pairs within a level show 0, across a restart 0.3 GiB in one cycle: the sum over the time
    assert 0.3 * GiB / cycle_s * 0.2 < rate < 0.3 * GiB / cycle_s * 1.01


def test_a_steady_run_has_no_trend_and_a_leak_fills_within_the_horizon():
    limit = 10 * GiB
    t = np.arange(20) * 0.5
    key = np.full(20, shape_key(8 * 512, 512))
    peak_step = 1.0 * GiB
    steady = np.full(20, 6 * GiB)
    out: dict = {}
    T.trend(out, t, key, steady, steady + peak_step, steady + peak_step, limit, None)
    assert out["trend_cross_p"] == 0.0 and out["alloc_ttf_s"] == T.CAP_S
    for room_s, expect_high in ((2.0, True), (40.0, False)):
        rate = 0.2 * GiB  # per second
        end = usable_limit(limit) - peak_step - rate * room_s  # what is left at the last step: room_s seconds of growth
        leak = end - rate * (t[-1] - t)
        out = {}
        T.trend(out, t, key, leak, leak + peak_step, leak + peak_step, limit, None)
        assert out["alloc_rate_same_shape"] == pytest.approx(rate / GiB, rel=1e-6)
        assert out["alloc_ttf_s"] == pytest.approx(room_s, rel=1e-3)
        assert (out["trend_cross_p"] > 0.9) is expect_high and (out["trend_cross_p"] < 0.1) is not expect_high
        assert out[T.TTF_LO] <= out["alloc_ttf_s"] <= out[T.TTF_HI]


def test_what_fragmentation_holds_comes_off_the_usable_limit():
    limit = 10 * GiB
    t = np.arange(20) * 0.5
    key = np.full(20, 1.0)
    rate = 0.05 * GiB
    alloc = 5 * GiB + rate * t
    peak = alloc + GiB
    tight, loose = {}, {}
    T.trend(tight, t, key, alloc, peak, peak + 2 * GiB, limit, None)  # 2 GiB reserved above every peak
    T.trend(loose, t, key, alloc, peak, peak, limit, None)
    assert tight["frag_held_frac"] == pytest.approx(0.2)
    # the reserve grew with the peak (no reuse): what it holds beyond the usable limit's own margin is off the room
    margin = limit - usable_limit(limit)
    assert T.reuse(peak, peak + 2 * GiB) == 0.0
    assert tight["alloc_ttf_s"] == pytest.approx(loose["alloc_ttf_s"] - (2 * GiB - margin) / rate, rel=1e-6)


def test_a_leak_into_a_warm_cache_keeps_the_cache_on_the_limit():
    """Blind set 2902's ho-01 (5 MiB/step into a cache reserved at 98 % of the cap from the first step, no
    OOM in 90 s): the peak grew, the reserve did not - the cache met the growth, so it is usable room, and
    the trend's time to full is the peak's to the usable limit, not 0."""
    limit = 6.634 * GiB
    n = 40
    t = np.arange(n) * 0.5
    key = np.full(n, 1.0)
    alloc = 0.93 * GiB + np.arange(n) * 5 * 2**20
    peak = alloc + 3.46 * GiB
    flat = np.full(n, 6.488 * GiB)
    warm: dict = {}
    T.trend(warm, t, key, alloc, peak, flat, limit, None)
    assert T.reuse(peak, flat) == 1.0
    assert warm["alloc_ttf_s"] == pytest.approx((usable_limit(limit) - peak[-1]) / (10 * 2**20), rel=1e-3)
    assert warm["alloc_ttf_s"] > 100 and warm["trend_cross_p"] < 1e-3
    # the same growth met by a reserve that grows with it: fragmentation, the room is what the reserve can grow
    grows = flat - flat[-1] + peak + (flat[-1] - peak[-1])
    frag: dict = {}
    T.trend(frag, t, key, alloc, peak, grows, limit, None)
    assert T.reuse(peak, grows) == 0.0
    assert frag["alloc_ttf_s"] == pytest.approx((limit - grows[-1]) / (10 * 2**20), rel=1e-3)
    # too few steps to tell: no evidence of reuse, the conservative room
    assert T.reuse(peak[:8], flat[:8]) == 0.0


def test_p_of_is_half_at_the_horizon_and_falls_with_time():
    assert T.p_of(T.HORIZON_S) == pytest.approx(0.5)
    assert T.p_of(0.0) == 1.0 and T.p_of(T.HORIZON_S / 2) > 0.9 and T.p_of(2 * T.HORIZON_S) < 0.1


def test_the_outlook_names_the_signal_that_carries_the_risk():
    o = T.outlook({"peak_cross_p": 0.2, "ahead_cross_p": 0.3, "trend_cross_p": 0.8, T.TTF_LO: 3.0, T.TTF_HI: 7.0,
                   "steps_per_s": 2.0})
    assert (o.signal, o.lo_s, o.hi_s) == ("trend", 3.0, 7.0)
    o = T.outlook({"peak_cross_p": 0.9, "ahead_cross_p": 0.9, "trend_cross_p": float("nan"), "steps_per_s": 2.0})
    assert (o.signal, o.lo_s, o.hi_s) == ("next-step peak", 0.0, 0.5)
    o = T.outlook({"peak_cross_p": 0.1, "ahead_cross_p": 0.7, "steps_per_s": 2.0, "next_peak_est_frac": 0.8,
                   "ahead_peak_est_frac": 1.06})
    assert o.signal == "lookahead" and o.lo_s == 0.5 and o.est == 1.06
    assert T.outlook({"peak_cross_p": float("nan")}) is None


def test_the_panel_says_the_range_and_what_carries_it():
    from gpuwatch.ui.render import outlook_text

    assert outlook_text(T.Outlook(60.0, 110.0, "trend", 0.7)) == "OOM in ~60-110 s (trend)"
    assert outlook_text(T.Outlook(60.0, 300.0, "trend", 0.7)) == "OOM in ~60 s-5 min (trend)"
    assert outlook_text(T.Outlook(3.2, 7.5, "trend", 0.7)) == "OOM in ~3.2-7.5 s (trend)"
    assert outlook_text(T.Outlook(4.0, None, "trend", 0.7)) == "OOM in ~4 s or more (trend)"
    assert outlook_text(T.Outlook(0.0, 0.5, "next-step peak", 0.9),
                        [["mem_used_frac", 0.3]]) == "OOM in ~0-0.5 s (next-step peak; carried by mem_used_frac)"
    # the plan's step estimated over the usable limit: by how much (what ranks the risk above its alarm)
    assert outlook_text(T.Outlook(0.5, 4.0, "lookahead", 1.0, 1.124),
                        [["ahead_peak_est_frac", 0.1]]) == "OOM in ~0.5-4 s (lookahead 112%)"
    assert outlook_text(T.Outlook(0.0, 0.5, "next-step peak", 0.9, 0.97)) == "OOM in ~0-0.5 s (next-step peak)"


def test_vramtop_warns_on_sustained_growth_only_and_says_low_vram_when_flat():
    ts = (np.arange(40) * 1e6).astype(np.int64)
    lim = np.full(40, 10.0 * GiB)
    grow = 6 * GiB + np.arange(40) * 0.02 * GiB  # ~20 MB/s from 60 %
    oom, low = V.states(ts, grow, lim)
    first = int(np.argmax(oom))
    assert oom.any() and 10 <= first <= 14  # 3 rates to judge growth, then 10 growing refreshes
    assert not low[:first].any()
    flat_hi = np.full(40, 9.0 * GiB)
    oom, low = V.states(ts, flat_hi, lim)
    assert not oom.any() and low.all()
    oom, low = V.states(ts, np.full(40, 3.0 * GiB) + np.arange(40) * 0.02 * GiB, lim)  # growing, under 50 %
    assert not oom.any() and not low.any()


def test_vramtop_refreshes_once_a_second_whatever_the_timeline():
    ts = (np.arange(80) * 0.5e6).astype(np.int64)  # moments every 0.5 s
    used = 6 * GiB + np.arange(80) * 0.01 * GiB
    a = V.alarms(ts, used / (10 * GiB), (10 * GiB - used) / GiB, False)
    b, _ = V.states(ts[::2], used[::2], np.full(40, 10.0 * GiB))
    assert a[::2].tolist() == b.tolist() and not math.isnan(float(a.sum()))


def test_the_panel_cuts_a_window_only_near_the_alarm_and_never_fails_on_one():
    from gpuwatch.ui.render import risk_outlook

    class Src:
        calls = 0

        def window(self, gpu):
            Src.calls += 1
            raise OSError("a window that cannot be cut")

    src = Src()
    assert risk_outlook(src, 0, {"risk": 0.2, "threshold": 0.5}) is None and Src.calls == 0
    assert risk_outlook(src, 0, {"risk": 0.3, "threshold": 0.5}) is None and Src.calls == 1


def test_the_panel_shows_the_range_before_a_real_oom():
    """A capped H200 ramp a second before its first OOM: the window there gives a range, carried by one of
    the estimator's signals; far from the limit none (a classifier's risk alone shows no range)."""
    from gpuwatch.recording.source import ReplaySource
    from gpuwatch.ui.render import risk_outlook

    from conftest import RAMP

    src = ReplaySource(RAMP.parent / "sample-h200-capped-ramp-train")
    g = src.gpus[0].index
    oom = src.events_df.filter(src.events_df["kind"] == "oom")
    t_oom = int(oom["ts"].dt.epoch("us")[0])

    class At:
        t = t_oom - 1_000_000

        def window(self, gpu):
            return src.window_at(gpu, self.t)

    at = At()
    o = risk_outlook(at, g, {"risk": 0.9, "threshold": 0.5})
    assert o is not None and o.signal in T.SIGNALS.values() and o.p >= T.OUTLOOK_MIN_P and o.lo_s <= (o.hi_s or 1e9)
    at.t = int(src.times(g)[50])  # the run's first seconds, far from the cap
    assert risk_outlook(at, g, {"risk": 0.9, "threshold": 0.5}) is None


BLIND_2904 = __import__("pathlib").Path(__file__).resolve().parent.parent / "recordings" / "heldout-h200-2026-12-06-blind-2904"


def _features_at(name: str, offset_s: float) -> dict:
    """The features of a recorded blind-set session `offset_s` after its first sample (no shape library)."""
    from gpuwatch.predict.features import features
    from gpuwatch.recording.source import ReplaySource

    src = ReplaySource(BLIND_2904 / name)
    g = src.gpus[0].index
    return features(src.window_at(g, int(src.times(g)[0]) + int(offset_s * 1e6)))


def test_the_cache_a_long_step_grew_is_not_held_once_that_step_used_it():
    """Blind set 2904's ho-03 (a cache that keeps a tensor per new length, random lengths, no OOM after 7 s):
    15 s in, the reserve was last grown by a 1,024-token step that used it; the last five steps were short.
    Read against those five, 12 % of the limit looked held by fragmentation and the planned step over the
    limit at once (trend_cross_p 1.0, a false alarm); against the steps since the reserve changed, 2 %."""
    f = _features_at("ho-03-loop-cache-b12-s128-1024", 14.9)
    assert f["frag_held_frac"] < 0.03, f["frag_held_frac"]
    assert f["trend_cross_p"] < 0.3 and f["alloc_ttf_s"] > 6.0, (f["trend_cross_p"], f["alloc_ttf_s"])
    # and the rule itself: the reserve unchanged since a step that peaked near it - nothing held
    res = np.array([10.0, 14.0, 14.0, 14.0, 14.0, 14.0, 14.0, 14.0]) * GiB
    peak = np.array([9.0, 13.8, 8.0, 8.0, 8.0, 8.0, 8.0, 8.0]) * GiB
    assert T.held(res, peak) == pytest.approx(0.2 * GiB)
    assert T.held(res[:2], peak[:2]) == pytest.approx(0.2 * GiB) and T.held(res[-1:], peak[-1:]) == pytest.approx(6 * GiB)


def test_growth_before_an_oom_is_not_carried_past_it():
    """Blind set 2904's graph-pool loop (e1): a pool per new shape grew fast in the first 9 s, then an OOM
    and a smaller micro-batch. After it, the trend kept the growth of before (0.33-0.39 GiB/s from same-shape
    pairs across the OOM) and warned for 2 s and more, 18 s before the next OOM; the pool then grew
    ~0.05 GiB/s. Growth is measured in what runs since the last OOM."""
    from gpuwatch.predict.features import _oom_us, _since_last_oom  # noqa: PLC2701 - the rule under test

    for at in (10.0, 11.7):  # before and after the first step since the OOM at 9.5 s
        f = _features_at("ho-04-loop-graphpool-b7-s384-768-e1", at)
        assert not f["trend_cross_p"] >= 0.3, (at, f["trend_cross_p"])  # NaN (no rate yet) or low
    before = _features_at("ho-04-loop-graphpool-b7-s384-768-e1", 8.9)  # before the OOM: the trend does warn
    assert before["trend_cross_p"] > 0.9
    import polars as pl

    ev = pl.DataFrame({"ts": [5_000_000, 9_000_000], "kind": ["oom", "oom"]}).with_columns(
        pl.col("ts").cast(pl.Datetime("us", "UTC")))
    ts = np.array([1, 2, 4, 6, 8, 10], dtype=np.float64) * 1e6
    assert _since_last_oom(_oom_us(ev), ts) == 5 and _since_last_oom(_oom_us(ev.head(0)), ts) == 0
    assert _since_last_oom(_oom_us(ev), ts[:4]) == 4  # an OOM after the last step: no step is of now


def test_a_small_segment_after_the_long_step_keeps_its_peak_in_view():
    """Reserved read with ==: one 2 MiB small-pool segment after the step that grew the reserve restarted the
    steps compared, and its peak dropped out of them (held 6 GiB for 0.2). Within RESERVE_SAME it is the same reserve."""
    res = np.array([10.0, 14.0, 14.0, 14.0, 14.0, 14.0, 14.0, 14.0]) * GiB
    res[4:] += 2 * 2**20
    peak = np.array([9.0, 13.8, 8.0, 8.0, 8.0, 8.0, 8.0, 8.0]) * GiB
    assert T.held(res, peak) == pytest.approx(0.2 * GiB + 2 * 2**20)
    res[-1] += 1 * GiB  # a real rise: the steps since it
    assert T.held(res, peak) == pytest.approx(res[-1] - 8 * GiB)


def test_only_split_blocks_count_as_held_where_the_steps_record_them():
    """Schema v6: of the cache no step used, only the inactive split blocks (free inside segments still in use)
    stay out of reach; whole free segments the allocator releases at the cap. Without the column (NaN: a v5
    session) the rule reads reserve and peaks alone, as before."""
    res = np.full(8, 14.0 * GiB)
    peak = np.full(8, 10.0 * GiB)
    assert T.held(res, peak) == pytest.approx(4 * GiB)
    assert T.held(res, peak, np.full(8, 1.5 * GiB)) == pytest.approx(1.5 * GiB)
    assert T.held(res, peak, np.full(8, 6.0 * GiB)) == pytest.approx(4 * GiB)  # never more than the peak left unused
    assert T.held(res, peak, np.full(8, np.nan)) == pytest.approx(4 * GiB)
    # the trend's room: the same growth reaches the limit later where the held memory is releasable
    t = np.arange(8, dtype=np.float64)
    key = np.ones(8)
    alloc = 6.0 * GiB + t * 0.1 * GiB
    lim = 16.0 * GiB
    a: dict[str, float] = {}
    b: dict[str, float] = {}
    T.trend(a, t, key, alloc, peak, res, lim, 12.0 * GiB)
    T.trend(b, t, key, alloc, peak, res, lim, 12.0 * GiB, np.full(8, 0.25 * GiB))
    assert b["frag_held_frac"] == pytest.approx(0.25 / 16) and a["frag_held_frac"] == pytest.approx(4 / 16)
    assert b["alloc_ttf_s"] > a["alloc_ttf_s"], (a["alloc_ttf_s"], b["alloc_ttf_s"])
