"""THE feature function: one window of one GPU -> the numbers the risk model reads. Training, live
scoring, replay and `gpuwatch score` all call `features()` (a test checks they share this object).

Every feature is named with its unit and documented in FEATURES (the model card prints that table).
Memory is measured against the *effective* limit: a workload's `--gpu-memory-limit` where one is
set, else the card. NVML's "used" from schema v1 includes the driver-reserved memory and v2's does not,
so both are read as used + reserved (the figure that compares across versions). Missing = NaN (the
model handles it), never a made-up value.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl

from gpuwatch.recording.source import Window
from gpuwatch.telemetry.reasons import LIMITING

GiB = 2**30
HORIZON_CAP_S = 600.0  # times beyond this read as this (nothing happens within any horizon we use)
PRECISION_BYTES = {"fp32": 4.0, "tf32": 4.0, "bf16": 2.0, "fp16": 2.0}

# name -> (unit, what it is). Order is the model's column order.
FEATURES: dict[str, tuple[str, str]] = {
    "mem_used_frac": ("fraction", "GPU memory in use (NVML used + reserved) / effective limit, last sample"),
    "mem_headroom_gib": ("GiB", "effective limit - memory in use, last sample"),
    "mem_max_frac_30s": ("fraction", "highest memory in use over the window / effective limit"),
    "mem_slope_5s": ("GiB/s", "least-squares slope of memory in use over the last 5 s (by sample time)"),
    "mem_slope_30s": ("GiB/s", "the same over the whole window"),
    "mem_accel": ("GiB/s", "mem_slope_5s - mem_slope_30s (memory growth speeding up)"),
    "time_to_full_s": ("s", f"headroom / mem_slope_5s while rising, else {HORIZON_CAP_S:.0f}"),
    "torch_reserved_gap_frac": ("fraction", "(torch reserved - allocated) / effective limit, last step: the caching allocator's slack"),
    "torch_peak_frac": ("fraction", "torch peak allocated during the last step / effective limit"),
    "torch_peak_max_frac": ("fraction", "highest step peak among the window's steps / effective limit"),
    "alloc_growth_frac_per_step": ("fraction/step", "mean growth of torch allocated per step over the last 10 steps / effective limit (a leak)"),
    "next_peak_est_frac": ("fraction", "estimated peak of the planned next step / effective limit: allocated + (last peak - allocated) x planned/last tokens x precision bytes ratio + one step of allocated growth"),
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
}
NAMES = tuple(FEATURES)
NAN = float("nan")


def features(w: Window, plan: dict[str, Any] | None = None) -> dict[str, float]:
    """The features of one window. `plan` (batch, seq_len, precision) is the workload's plan for its
    next step when it is known live; otherwise the last step row's `next_*` columns say it."""
    out = dict.fromkeys(NAMES, NAN)
    limit = _limit(w)
    _memory(out, w, limit)
    last = _steps(out, w, limit, plan)
    _events(out, w)
    _health(out, w)
    out["train_mode"] = 1.0 if last is not None and last.get("mode") == "train" else 0.0 if last is not None else NAN
    return out


def vector(f: dict[str, float]) -> list[float]:
    return [f[n] for n in NAMES]


def _limit(w: Window) -> float | None:
    if w.meta is not None and w.meta.effective_limit_bytes:
        return float(w.meta.effective_limit_bytes)
    if w.samples.height:
        tot = w.samples["gpu_mem_total_bytes"].drop_nulls()
        return float(tot[-1]) if tot.len() else None
    return None


def _memory(out: dict[str, float], w: Window, limit: float | None) -> None:
    s = w.samples
    if not s.height or not limit:
        return
    used = (s["gpu_mem_used_bytes"].cast(pl.Float64) + s["gpu_mem_reserved_bytes"].cast(pl.Float64).fill_null(0.0)).to_numpy()
    t = (s["ts"].dt.epoch("us").to_numpy() - w.end_us) / 1e6
    ok = ~np.isnan(used)
    used, t = used[ok], t[ok]
    if not used.size:
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


def _col(df: pl.DataFrame, name: str) -> np.ndarray:
    return df[name].cast(pl.Float64).to_numpy()


def _steps(out: dict[str, float], w: Window, limit: float | None, plan: dict[str, Any] | None) -> dict | None:
    st = w.steps
    if not st.height:
        return None
    last = st.row(st.height - 1, named=True)
    tokens = _col(st, "batch") * _col(st, "seq_len")
    times = _col(st, "step_time_s")
    ts = st["ts"].dt.epoch("us").to_numpy()
    out["steps_per_s"] = float(((ts > w.end_us - 5e6) & (ts <= w.end_us)).sum()) / 5.0
    if np.isfinite(times).sum() >= 3:
        out["step_time_trend"] = float(np.nanmedian(times[-3:]) / max(np.nanmedian(times), 1e-9))
    nb, ns, npr = _plan_of(last, plan)
    last_tok = float(last["batch"] or 0) * float(last["seq_len"] or 0)
    if nb and ns and last_tok:
        planned = float(nb) * float(ns)
        out["plan_growth"] = planned / last_tok
        out["plan_vs_max_fit"] = planned / max(float(np.nanmax(tokens)), 1.0)
    if not limit:
        return last
    alloc, peak, res = _col(st, "torch_allocated_bytes"), _col(st, "torch_peak_bytes"), _col(st, "torch_reserved_bytes")
    if np.isfinite(alloc[-1]) and np.isfinite(res[-1]):
        out["torch_reserved_gap_frac"] = (res[-1] - alloc[-1]) / limit
    if np.isfinite(peak[-1]):
        out["torch_peak_frac"] = peak[-1] / limit
        out["torch_peak_max_frac"] = float(np.nanmax(peak)) / limit
    a = alloc[-11:]
    a = a[np.isfinite(a)]
    growth = float(np.diff(a).mean()) if a.size >= 2 else 0.0
    out["alloc_growth_frac_per_step"] = growth / limit if a.size >= 2 else NAN
    if np.isfinite(alloc[-1]) and np.isfinite(peak[-1]) and nb and ns and last_tok:
        ratio = float(nb) * float(ns) / last_tok
        prec = PRECISION_BYTES.get(str(npr), 2.0) / PRECISION_BYTES.get(str(last.get("precision")), 2.0)
        act = max(0.0, peak[-1] - alloc[-1])
        out["next_peak_est_frac"] = (alloc[-1] + act * ratio * prec + max(0.0, growth)) / limit
    return last


def _plan_of(last: dict[str, Any], plan: dict[str, Any] | None) -> tuple[Any, Any, Any]:
    if plan:
        return plan.get("batch"), plan.get("seq_len"), plan.get("precision")
    return last.get("next_batch"), last.get("next_seq_len"), last.get("next_precision") or last.get("precision")


def _events(out: dict[str, float], w: Window) -> None:
    ev = w.events
    oom = ev.filter(pl.col("kind") == "oom") if ev.height else ev
    if not oom.height:
        out["secs_since_oom"], out["ooms_60s"] = HORIZON_CAP_S, 0.0
        return
    ts = oom["ts"].dt.epoch("us").to_numpy()
    out["secs_since_oom"] = min(HORIZON_CAP_S, (w.end_us - float(ts[-1])) / 1e6)
    out["ooms_60s"] = float((ts > w.end_us - 60e6).sum())


def _health(out: dict[str, float], w: Window) -> None:
    s = w.samples
    if not s.height:
        out["missing_frac"] = 1.0
        return
    iv = s["sampler_interval_us"].drop_nulls()
    out["gap_max_ratio"] = float(iv.max()) / (w.interval_s * 1e6) if iv.len() else NAN
    ts = s["ts"].dt.epoch("us")
    span = max(w.interval_s, (w.end_us - float(ts[0])) / 1e6 + w.interval_s)
    out["missing_frac"] = max(0.0, 1.0 - s.height / (span / w.interval_s))
    last = s.row(s.height - 1, named=True)
    temp, slow = last.get("gpu_temp_c"), last.get("gpu_temp_slowdown_c") or (w.meta.temp_slowdown_c if w.meta else None)
    if temp is not None and slow:
        out["temp_margin_c"] = float(slow - temp)
    mask = last.get("gpu_clocks_event_reasons")
    out["throttled"] = NAN if mask is None else float(bool(mask & LIMITING))
    util = last.get("gpu_util_pct")
    out["util_pct"] = NAN if util is None else float(util)
