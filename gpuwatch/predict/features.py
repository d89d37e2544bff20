"""THE feature function: one window of one GPU -> the numbers the risk model reads. Training, live
scoring, replay and `gpuwatch score` all call `features()` (a test checks they share this object).

Every feature is named with its unit and documented in FEATURES (the model card prints that table).
Memory is measured against the *effective* limit: a workload's `--gpu-memory-limit` where one is
set, else the card. NVML's "used" from schema v1 includes the driver-reserved memory and v2's does not,
so both are read as used + reserved (the figure that compares across versions). Missing = NaN (the
model handles it), never a made-up value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from gpuwatch.predict import trend as T
from gpuwatch.predict.peak import (FIRST_STEP_BASE, GROWTH_STEPS, PRECISION_BYTES, USABLE, Failed, INFERENCE,
                                   fit_steps, median, nanmedian, shape_key, usable_of)
from gpuwatch.recording.frames import epoch_us, process_memory
from gpuwatch.recording.recorded import event_detail, recovered_plan
from gpuwatch.recording.window import Window
from gpuwatch.threads import keep_bounded
from gpuwatch.telemetry.reasons import LIMITING

GiB = 2**30
HORIZON_CAP_S = 600.0  # times beyond this read as this (nothing happens within any horizon we use)

# name -> (unit, what it is). Order is the model's column order.
FEATURES: dict[str, tuple[str, str]] = {
    "mem_used_frac": ("fraction", "memory this workload's process holds on the GPU (NVML's per-process figure; the whole GPU's used + reserved where the process is not known) / its effective limit, last sample"),
    "mem_headroom_gib": ("GiB", "effective limit - memory in use, last sample"),
    "mem_max_frac_30s": ("fraction", "highest memory in use over the window / effective limit"),
    "mem_slope_5s": ("GiB/s", "least-squares slope of memory in use over the last 5 s (by sample time)"),
    "mem_slope_30s": ("GiB/s", "the same over the whole window"),
    "mem_accel": ("GiB/s", "mem_slope_5s - mem_slope_30s (memory growth speeding up)"),
    "time_to_full_s": ("s", f"headroom / mem_slope_5s while rising, else {HORIZON_CAP_S:.0f}"),
    "others_mem_frac": ("fraction", "memory of the GPU's other processes / the card, last sample (a shared GPU)"),
    "torch_reserved_gap_frac": ("fraction", "(torch reserved - allocated) / torch's limit, last step: the caching allocator's slack"),
    "torch_reserved_frac": ("fraction", "torch reserved / torch's limit, last step: how full the allocator's segments are (fragmentation fails a new, larger shape first)"),
    "torch_peak_frac": ("fraction", "torch peak allocated during the last step / torch's limit"),
    "torch_peak_max_frac": ("fraction", "highest step peak among the window's steps / torch's limit"),
    "alloc_growth_frac_per_step": ("fraction/step", "median growth of torch allocated per step over the last 10 steps / torch's limit (a leak)"),
    "next_peak_est_frac": ("fraction", "the planned next step's peak, estimated online from the steps that ran (predict/peak.py) / the usable limit for a step's peak"),
    "peak_margin_sigmas": ("sigmas", "(usable limit - estimated next peak) / the estimate's spread, clipped to -10..50"),
    "frag_need_frac": ("fraction", "(estimated next peak - allocated - room left outside the allocator's segments) / its cached memory: the share of the cache the planned step must reuse (> 1: it cannot fit; fragmentation makes high shares fail)"),
    "peak_cross_p": ("probability", "P(a step within the horizon peaks over the usable limit): the planned step, and the growth trend carried on"),
    "ahead_cross_p": ("probability", "P(the largest step the workload plans within the lookahead peaks over the usable limit): predict/ahead.py; the estimate and the outgrown-segments rule (not the failed-shape rule, which speaks for the allocator's state of now); at least peak_cross_p; missing where the workload plans no further than the next step"),
    "plan_vs_max_fit": ("ratio", "planned next-step tokens (batch x seq_len) / the most tokens any step in the window ran"),
    "plan_growth": ("ratio", "planned next-step tokens / the last step's tokens"),
    "step_time_trend": ("ratio", "median step time of the last 3 steps / of the window's steps"),
    "steps_per_s": ("1/s", "steps finished in the last 5 s / 5"),
    "secs_since_oom": ("s", f"since the last OOM in the events window ({HORIZON_CAP_S:.0f} if none)"),
    "ooms_60s": ("count", "OOM events in the last 60 s"),
    "gap_max_ratio": ("ratio", "longest sampler interval in the window / the recording interval (telemetry gaps)"),
    "missing_frac": ("fraction", "share of the window's expected samples that are missing"),
    "temp_margin_c": ("degC", "slowdown temperature - GPU temperature, last sample"),
    "throttled": ("0/1", "a limiting clock-event reason (power cap, thermal, HW slowdown) in the last sample"),
    "util_pct": ("%", "GPU utilization, last sample"),
    "train_mode": ("0/1", "the workload trains (weights' gradients live across the step)"),
    "alloc_rate_same_shape": ("GiB/s", "growth of torch allocated across steps of the same shape: the sum of each step's allocated minus the previous step's of its shape, over the time between them (a leak, a cache or graph pool that grows, memory kept across a ramp's restarts; 0 for a steady run and for shape changes alone)"),
    "frag_held_frac": ("fraction", "torch reserved - the highest step peak since the reserve last changed (read after the window's last OOM, as every trend feature), no more than the last step's inactive split blocks where recorded (schema v6), / torch's limit: cached memory even the peak did not use and the allocator cannot release; the trend takes what of it lies beyond the usable limit's margin off the limit, less the share the steps showed the cache reuses (predict/trend.py reuse)"),
    "reserved_ttf_s": ("s", f"time until torch reserved reaches torch's limit at its slope across the last steps, while rising; else {HORIZON_CAP_S:.0f}"),
    "alloc_ttf_s": ("s", f"time until the planned step's estimated peak reaches the usable limit net of what fragmentation holds (frag_held_frac, less the cache's reuse) at alloc_rate_same_shape, while it grows; 0 where it is there already; else {HORIZON_CAP_S:.0f}"),
    "trend_cross_p": ("probability", "P(the growth the plan does not explain fills the usable limit within the horizon): from alloc_ttf_s (predict/trend.py)"),
    "ahead_peak_est_frac": ("fraction", "the largest step planned within the lookahead: its estimated peak / the usable limit (predict/ahead.py); at least next_peak_est_frac; missing where the workload plans no further than the next step. How far over the limit the lookahead's step goes: the risk ranks its alarms by it (predict/composite.py `over`)"),
}
NAMES = tuple(FEATURES)
# The sample columns the feature function reads (with ts and gpu): a live source keeps only these for
# the scorer's windows (recording/source.py LiveSource); gpu_procs is added there where a GPU's process
# is not known by PID. A test holds live windows of these columns to the features of full ones.
_HEALTH_COLS = ("gpu_temp_c", "gpu_temp_slowdown_c", "gpu_clocks_event_reasons", "gpu_util_pct")  # _health's
SAMPLE_COLUMNS = ("gpu_mem_used_bytes", "gpu_mem_reserved_bytes", "gpu_mem_total_bytes", "sampler_interval_us",
                  *_HEALTH_COLS)
NAN = float("nan")


@dataclass
class Limits:
    """The memory basis of one window: whose memory, against what."""

    used: np.ndarray  # bytes in use per sample (the process's own where known)
    t: np.ndarray  # seconds before the window's end, per sample
    limit: float | None  # what `used` is measured against
    alloc_limit: float | None  # what torch may allocate (the cap, else what the card leaves it)
    others: float  # other processes' memory, last sample (bytes)
    total: float | None
    ts_us: np.ndarray | None = None  # every sample's time (the health features read it too)


def features(w: Window, plan: dict[str, Any] | None = None, prior: Any = None) -> dict[str, float]:
    """The features of one window. `plan` (batch, seq_len, precision) is the workload's plan for its
    next step when it is known live; otherwise the last step row's `next_*` columns say it. `prior`: a
    model's shape library (predict/prior.py) - before the GPU's first step it gives the estimator's
    figures from earlier runs of the same model; training passes none (the library is built from the
    sessions it trains on)."""
    out = dict.fromkeys(NAMES, NAN)
    lim = limits(w)
    _memory(out, lim)
    last = _steps(out, w, lim, plan)
    if last is None and prior is not None:
        _first_step(out, w, lim, plan, prior)
    _events(out, w)
    _health(out, w, lim.ts_us)
    out["train_mode"] = 1.0 if last is not None and last.get("mode") == "train" else 0.0 if last is not None else NAN
    return out


def vector(f: dict[str, float]) -> list[float]:
    return [f[n] for n in NAMES]


def limits(w: Window) -> Limits:
    """Memory in use and the limits it meets: the workload process's own memory where it is known, by the
    one rule of recording/frames.py (process_memory), which the report and the exporter read too."""
    s = w.samples
    cap = float(w.meta.mem_limit_bytes) if w.meta is not None and w.meta.mem_limit_bytes else None
    empty = np.empty(0)
    if not s.height:
        return Limits(empty, empty, cap, cap, 0.0, None)
    wa = w.cols
    ts_us = wa.sample_us() if wa is not None else _us(s["ts"])
    t = (ts_us - w.end_us) / 1e6
    st = w.steps
    last_res = (wa.last_step("torch_reserved_bytes") if wa is not None else st["torch_reserved_bytes"][-1]) if st.height else None
    reserved = float(last_res) if last_res is not None else None
    m = process_memory(s, w.meta.pid if w.meta is not None else None, cap, reserved,
                       w.meta.mem_total_bytes if w.meta is not None else None, w.own,
                       cols=wa.sample if wa is not None else None)
    ok = ~np.isnan(m.used)
    return Limits(m.used[ok], t[ok], m.limit, m.alloc_limit, m.others, m.total, ts_us)


def _memory(out: dict[str, float], lim: Limits) -> None:
    used, t, limit = lim.used, lim.t, lim.limit
    if lim.total:
        out["others_mem_frac"] = lim.others / lim.total
    if not used.size or not limit:
        return
    out["mem_used_frac"] = used[-1] / limit
    out["mem_headroom_gib"] = (limit - used[-1]) / GiB
    out["mem_max_frac_30s"] = used.max() / limit
    s5 = _slope(t[t > -5.0], used[t > -5.0])
    s30 = _slope(t, used)
    out["mem_slope_5s"] = s5 / GiB if s5 is not None else NAN
    out["mem_slope_30s"] = s30 / GiB if s30 is not None else NAN
    if s5 is not None and s30 is not None:
        out["mem_accel"] = (s5 - s30) / GiB
    rising = s5 is not None and s5 > 1e6
    out["time_to_full_s"] = min(HORIZON_CAP_S, max(0.0, limit - used[-1]) / s5) if rising else HORIZON_CAP_S


def _slope(t: np.ndarray, y: np.ndarray) -> float | None:
    """Least squares by the samples' own times (a gap does not shrink time), bytes per second."""
    if t.size < 3 or t[-1] - t[0] < 0.25:
        return None
    tc = t - t.mean()
    den = float((tc * tc).sum())
    return float((tc * (y - y.mean())).sum() / den) if den > 0 else None


def _f64(col: pl.Series) -> np.ndarray:
    """A numeric column as float64 with NaN for nulls, without a polars expression (each costs a
    query plan: ten per window were most of a window's cost)."""
    return np.asarray(col.to_numpy(), dtype=np.float64)


_us = epoch_us  # a Datetime(us) column as int64 microseconds, without a polars query


SPLIT = "torch_inactive_split_bytes"  # (schema v6) what of the cache is free inside segments still in use


def _col(df: pl.DataFrame, name: str) -> np.ndarray:
    return _f64(df[name])


def _steps(out: dict[str, float], w: Window, lim: Limits, plan: dict[str, Any] | None) -> dict | None:
    """The step features. In replay (a window cut from a recording's converted columns) without a live
    plan they are kept by the rows they read - the window's steps and events, by place in the source's
    columns - and the limit: every feature here but steps_per_s is computed from those alone, and most
    windows of a recording (10 samples a second, a step every 0.2-2 s) share them with the one before."""
    st = w.steps
    if not st.height:
        return None
    wa = w.cols  # replay: views of columns converted once for the recording (window.Columns)
    ts = wa.step_us() if wa is not None else _us(st["ts"])
    steps_per_s = float(((ts > w.end_us - 5e6) & (ts <= w.end_us)).sum()) / 5.0
    key = None
    if wa is not None and not plan:
        key = (wa.steps.serial, wa.t_lo, wa.t_hi, wa.events.serial, wa.e_lo, wa.e_hi, lim.alloc_limit)
        got = _STEPS.get(key)
        if got is not None:
            out.update(got[1])
            out["steps_per_s"] = steps_per_s
            return got[0]
        before = dict(out)
    last = _steps_of(out, w, st, wa, ts, lim, plan)
    out["steps_per_s"] = steps_per_s
    if key is not None:
        keep_bounded(_STEPS, key, (last, {k: v for k, v in out.items() if k not in before or v is not before[k]}),
                     _FORECASTS_KEPT)
    return last


_STEPS: dict[tuple, tuple] = {}  # replay: the last few windows' step features, by the rows they read (_steps)


def _steps_of(out: dict[str, float], w: Window, st: pl.DataFrame, wa: Any, ts: np.ndarray, lim: Limits,
              plan: dict[str, Any] | None) -> dict:
    last = st.row(st.height - 1, named=True)
    col = wa.step if wa is not None else (lambda name: _col(st, name))
    batch, seq = col("batch"), col("seq_len")
    tokens = batch * seq
    times = col("step_time_s")
    oom_us = _window_oom_us(w)
    if np.isfinite(times).sum() >= 3:
        out["step_time_trend"] = nanmedian(times[-3:]) / max(nanmedian(times), 1e-9)
    if not plan and oom_us.size:  # replay: the last row's plan, unless an OOM came after that row (the recovery changed it)
        plan = _plan_after_oom(w.events, float(ts[-1]))
    nb, ns, npr = _plan_of(last, plan)
    last_tok = float(last["batch"] or 0) * float(last["seq_len"] or 0)
    if nb and ns and last_tok:
        planned = float(nb) * float(ns)
        out["plan_growth"] = planned / last_tok
        out["plan_vs_max_fit"] = planned / max(float(np.fmax.reduce(tokens)), 1.0)
    limit = lim.alloc_limit
    if not limit:
        return last
    alloc, peak, res = col("torch_allocated_bytes"), col("torch_peak_bytes"), col("torch_reserved_bytes")
    if np.isfinite(alloc[-1]) and np.isfinite(res[-1]):
        out["torch_reserved_gap_frac"] = (res[-1] - alloc[-1]) / limit
    if np.isfinite(res[-1]):
        out["torch_reserved_frac"] = res[-1] / limit
    if np.isfinite(peak[-1]):
        out["torch_peak_frac"] = peak[-1] / limit
        out["torch_peak_max_frac"] = float(np.fmax.reduce(peak)) / limit  # nanmax, a tenth of its cost
    a = alloc[-(GROWTH_STEPS + 1):]
    a = a[np.isfinite(a)]
    if a.size >= 2:
        out["alloc_growth_frac_per_step"] = median(np.diff(a)) / limit
    usable = usable_of(limit, peak)  # what `_forecasts` weighs the plan against
    out[USABLE] = usable
    planned_peak: float | None = None  # bytes: the estimator's mean for the planned step, for the trend
    if nb and ns:
        # the outgrown-segments rule for inference steps only (peak.py says why)
        reserved = float(res[-1]) if np.isfinite(res[-1]) and last.get("mode") != "train" else None
        ab, asq = _ahead_of(last, plan)
        ev = w.events
        micro = col("micro_batches") if "micro_batches" in st.columns else np.ones(st.height)
        prec = tuple(wa.step_values("precision") if wa is not None else st["precision"].to_list())
        ev_us = (wa.event_us() if wa is not None else _us(ev["ts"])) if ev.height else None
        kept = last.get("mode") in INFERENCE
        key = (ts.tobytes(), seq.tobytes(), tokens.tobytes(), micro.tobytes(), prec, peak.tobytes(), alloc.tobytes(), times.tobytes(),
               nb, ns, npr, ab, asq, limit, reserved, ev_us.tobytes() if ev_us is not None else b"", ev.height, kept)
        fc, ahead_p, ahead_frac = _FORECASTS.get(key) or _forecasts(batch, seq, micro, list(prec), alloc, peak, times, nb,
                                                                    ns, npr, ab, asq, usable, reserved, ev, key, kept)
        if ahead_p is not None:
            out["ahead_cross_p"] = ahead_p
            out["ahead_peak_est_frac"] = ahead_frac
        if fc is not None:
            _estimate(out, fc)
            planned_peak = fc.mean
            if np.isfinite(alloc[-1]) and np.isfinite(res[-1]):
                cache = max(res[-1] - alloc[-1], 0.01 * limit)
                out["frag_need_frac"] = _clip(float(fc.mean - alloc[-1] - (limit - res[-1])) / float(cache), -5.0, 5.0)
    cut = _since_last_oom(oom_us, ts)  # the growth measured in the configuration that runs now
    T.trend(out, ts[cut:] / 1e6, shape_key(tokens, seq)[cut:], alloc[cut:], peak[cut:], res[cut:], limit, planned_peak,
            col(SPLIT)[cut:] if SPLIT in st.columns else None, usable)
    return last


def _first_step(out: dict[str, float], w: Window, lim: Limits, plan: dict[str, Any] | None, prior: Any) -> None:
    """No step has run on this GPU: the estimator's figures for the first one, from the shape library
    (earlier runs of the same model at that shape; predict/prior.py)."""
    wl = w.meta.workload if w.meta is not None else None
    p = plan or w.first_plan
    if not wl or not p or not lim.alloc_limit:
        return
    from gpuwatch.predict.prior import identity

    fc = prior.first_step(identity(wl), wl.get("mode"), p.get("precision") or wl.get("precision"), p.get("batch"),
                          p.get("seq_len"), lim.alloc_limit, failed_shapes(w.events))
    if fc is None:
        return
    _estimate(out, fc)
    out[FIRST_STEP_BASE] = fc.base / fc.limit  # not a model input: the guard sizes the first step with it


def _estimate(out: dict[str, float], fc: Any) -> None:
    """The estimator's figures of a forecast (peak.Forecast), after steps or before the first."""
    out["next_peak_est_frac"] = fc.mean / fc.limit
    out["peak_margin_sigmas"] = _clip((fc.limit - fc.mean) / fc.sigma, -10.0, 50.0)
    out["peak_cross_p"] = fc.p_horizon


_FORECASTS: dict[tuple, tuple] = {}  # the last few windows' forecasts, by what they were computed from
_FORECASTS_KEPT = 16


def _forecasts(batch, seq, micro, prec, alloc, peak, times, nb, ns, npr, ab, asq, lim: float,
               reserved: float | None, events: pl.DataFrame, key: tuple, kept: bool = False) -> tuple:
    """The next step's forecast and the lookahead's probability. Kept by `key` - all they are computed
    from: the window's steps (times, lengths, tokens, micro-batches, precisions, peaks, allocations and
    step times, byte for byte), the plan, the lookahead, the limit, the reserved bytes and the events (by
    their times) - so a live round that brought a sample but no step (most of them: 10 samples a second,
    a step every 0.2-2 s) reuses them: two forecasts were 0.7 ms of a 2.7 ms round (cProfile of the live
    round, dev machine)."""
    fit = fit_steps(batch, seq, micro, prec, alloc, peak, times, npr, kept=kept)  # once for both plans
    fc = fit.at(float(nb), float(ns), lim, failed=failed_shapes(events), reserved=reserved) if fit is not None else None
    ahead_p = ahead_frac = None
    if fit is not None and fc is not None and ab and asq:  # the largest step planned within the lookahead (ahead.py):
        # its estimate and the outgrown-segments rule, not the failed-shape rule - a shape that failed
        # under the allocator's state of now may fit after the steps on the way reshaped the cache (call
        # 24's decode ramp failed at batch 77, then ran it on the next climb: 3 near-limit false alarms)
        fa = fc if float(ab) * float(asq) <= float(nb) * float(ns) else fit.at(float(ab), float(asq), lim,
                                                                                reserved=reserved)
        ahead_p = max(fc.p_horizon, fa.p_horizon) if fa is not None else fc.p_horizon
        ahead_frac = max(fc.mean, fa.mean) / fc.limit if fa is not None else fc.mean / fc.limit
    keep_bounded(_FORECASTS, key, (fc, ahead_p, ahead_frac), _FORECASTS_KEPT)
    return fc, ahead_p, ahead_frac


def failed_shapes(events: pl.DataFrame) -> list[Failed]:
    """The shapes that ran out of memory in the events window (their OOM events' detail)."""
    if not events.height or "detail" not in events.columns:
        return []
    oom = [i for i, k in enumerate(events["kind"].to_list()) if k == "oom"]  # not a polars query per window
    if not oom:
        return []
    details = events["detail"].to_list()
    out = []
    for i in oom:
        x = event_detail({"detail": details[i]})
        try:
            b, q = float(x["batch"]), float(x["seq_len"])
        except (ValueError, KeyError, TypeError):
            continue
        ab = x.get("allocated_before")
        out.append(Failed(b * q, q, PRECISION_BYTES.get(str(x.get("precision")), 2.0),
                          float(ab) if isinstance(ab, (int, float)) else float("nan")))
    return out


def _oom_us(events: pl.DataFrame) -> np.ndarray:
    """The times (us) of the events window's OOMs, in order."""
    return _ooms_of(events["kind"].to_list() if events.height else [], lambda: _us(events["ts"]))


_NO_TIMES = np.empty(0)


def _ooms_of(kinds: list, times_us) -> np.ndarray:
    """The times (`times_us()`, us) of the `kinds` that are OOMs. Nearly always none: found by a list's
    membership first, not a string column's array (~3 vs ~11 us a window), and the times not read then."""
    if "oom" not in kinds:
        return _NO_TIMES
    return times_us()[np.array([k == "oom" for k in kinds])]


def _window_oom_us(w: Window) -> np.ndarray:
    """`_oom_us` of the window's events, from the source's converted columns where it has them."""
    wa = w.cols
    return _oom_us(w.events) if wa is None else _ooms_of(wa.event_kinds(), wa.event_us)


def _since_last_oom(oom_us: np.ndarray, ts: np.ndarray) -> int:
    """The index of the window's first step after its last OOM (`oom_us`: `_oom_us`; 0 where none came since
    its first step; past the last step where the OOM came after it): an OOM's recovery changes what runs (a
    smaller micro-batch, the cache emptied), so growth measured across it is not the growth of now - after
    set 2904's graph-pool OOMs the trend kept the fast growth of the shapes before it for ~30 steps and
    warned 10-18 s before the next OOM."""
    if not ts.size:
        return 0
    oom = oom_us[oom_us >= ts[0]]  # one after the last step too: none of the steps is of now
    return int(np.searchsorted(ts, oom.max(), side="right")) if oom.size else 0


def _plan_after_oom(events: pl.DataFrame, last_step_us: float) -> dict[str, Any] | None:
    """Where an OOM came after the last step row, the plan that row recorded is not the next step any
    more (the recovery halved the batch, restarted a ramp): the plan the `oom_recovered` event recorded
    (its next_batch / next_seq_len), else an unknown plan (no forecast) - not the stale one (a replayed
    ramp restarting at 16 after failing at 72 would be scored for 72 again: H200 held-out sessions, one
    false alarm after every OOM). None where no OOM came after the row."""
    if not events.height:
        return None
    kind = events["kind"].to_numpy()
    ets = _us(events["ts"])
    oom = np.flatnonzero((kind == "oom") & (ets > last_step_us))
    if not oom.size:
        return None
    rec = np.flatnonzero((kind == "oom_recovered") & (ets >= ets[oom[-1]]))
    plan = recovered_plan(event_detail({"detail": events["detail"][int(rec[0])]})) if rec.size else None
    return plan or {"batch": None, "seq_len": None}  # none recorded, or a corrupt detail: no plan


def _plan_of(last: dict[str, Any], plan: dict[str, Any] | None) -> tuple[Any, Any, Any]:
    if plan:
        return plan.get("batch"), plan.get("seq_len"), plan.get("precision")
    return last.get("next_batch"), last.get("next_seq_len"), last.get("next_precision") or last.get("precision")


def _ahead_of(last: dict[str, Any], plan: dict[str, Any] | None) -> tuple[Any, Any]:
    """The largest step planned within the lookahead: the live plan's, else the last step row's (null in
    sessions recorded before schema v4 and for a workload that knows only its next step)."""
    src = plan if plan else last
    return src.get("ahead_batch"), src.get("ahead_seq_len")


def _events(out: dict[str, float], w: Window) -> None:
    ts = _window_oom_us(w)
    if not ts.size:
        out["secs_since_oom"], out["ooms_60s"] = HORIZON_CAP_S, 0.0
        return
    out["secs_since_oom"] = min(HORIZON_CAP_S, (w.end_us - float(ts[-1])) / 1e6)
    out["ooms_60s"] = float((ts > w.end_us - 60e6).sum())


def _clip(v: float, lo: float, hi: float) -> float:
    """float(np.clip(v, lo, hi)) for a scalar (NaN stays NaN), without numpy's ~25 us a call."""
    return v if v != v else min(max(float(v), lo), hi)


def _health(out: dict[str, float], w: Window, ts: np.ndarray | None = None) -> None:
    s = w.samples
    if not s.height:
        out["missing_frac"] = 1.0
        return
    wa = w.cols
    iv = wa.sample("sampler_interval_us") if wa is not None else _f64(s["sampler_interval_us"])
    out["gap_max_ratio"] = float(np.fmax.reduce(iv)) / (w.interval_s * 1e6) if np.isfinite(iv).any() else NAN
    ts = _us(s["ts"]) if ts is None else ts
    span = max(w.interval_s, (w.end_us - float(ts[0])) / 1e6 + w.interval_s)
    out["missing_frac"] = max(0.0, 1.0 - s.height / (span / w.interval_s))
    cols = s.columns
    last = ({c: wa.last_sample(c) for c in _HEALTH_COLS if c in cols} if wa is not None  # not s.row(): 32 columns, lists too
            else {c: s.get_column(c)[-1] for c in _HEALTH_COLS if c in cols})
    temp, slow = last.get("gpu_temp_c"), last.get("gpu_temp_slowdown_c") or (w.meta.temp_slowdown_c if w.meta else None)
    if temp is not None and slow:
        out["temp_margin_c"] = float(slow - temp)
    mask = last.get("gpu_clocks_event_reasons")
    out["throttled"] = NAN if mask is None else float(bool(mask & LIMITING))
    util = last.get("gpu_util_pct")
    out["util_pct"] = NAN if util is None else float(util)
