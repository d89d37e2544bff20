"""The health matrix of a DeepSeek stress test: one pass/fail row per criterion.

`health_matrix(rec, thresholds)` is a pure function of a `Recording`: the HTML/Markdown report and a CI
`--junit` output both call it. A row whose data the session does not have (no steps in a `watch`
session, no temperature threshold, ...) has `passed=None` ("n/a"), never a guess.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import polars as pl

from gpuwatch.recording.frames import own_peak
from gpuwatch.recording.reader import Recording
from gpuwatch.recording.recorded import STEPS_FILE, StepCount, recorded_caps, recorded_pid, recorded_steps, sorted_by_time
from gpuwatch.telemetry.reasons import LIMITING, REASONS


@dataclass(frozen=True)
class Thresholds:
    min_util_pct: float = 85.0  # mean GPU utilization while the workload ran must exceed this
    min_mfu: float = 0.60  # median achieved TFLOP/s as a fraction of the dense peak (steps.mfu)
    max_mem_frac: float = 0.95  # peak memory used / the effective limit (card total, or the workload's cap)
    temp_margin_c: float = 5.0  # the hottest sample must stay this far below the slowdown threshold
    max_throttle_frac: float = 0.05  # fraction of active samples with a limiting clock-event reason
    throttle_mask: int = LIMITING  # which clocks_event_reasons bits count (telemetry/reasons.py)
    gap_factor: float = 2.0  # a tick interval above this many times the configured interval is a gap
    headroom_frac: float = 0.10  # recommendations: a batch "fits" when its peak leaves this much free


@dataclass(frozen=True)
class Row:
    name: str
    value: float | None
    threshold: float | None
    passed: bool | None  # None: the session has no data for this row
    detail: str
    unit: str = ""  # "%" (value and threshold are fractions 0..1 shown as percent), "°C", or ""
    op: str = ">="  # how value compares with threshold to pass

    @property
    def status(self) -> str:
        return "n/a" if self.passed is None else ("pass" if self.passed else "fail")

    def fmt(self, x: float | None) -> str:
        if x is None:
            return "-"
        if self.unit == "%":
            return f"{x * 100:.1f} %"
        if self.unit:
            return f"{x:.0f} {self.unit}"
        return f"{x:.3g}"

    @property
    def value_text(self) -> str:
        return self.fmt(self.value)

    @property
    def threshold_text(self) -> str:
        return "-" if self.threshold is None else f"{self.op} {self.fmt(self.threshold)}"


@dataclass
class _Ctx:
    """What several rows (and the report) derive from a recording, computed once."""

    samples: pl.DataFrame  # GPU rows only
    active: pl.DataFrame  # GPU rows inside the workload's active window
    window: tuple[datetime, datetime] | None
    limits: dict[int, tuple[int | None, int | None, str]] = field(default_factory=dict)


def workloads(rec: Recording) -> list[dict[str, Any]]:
    cfg = rec.meta.get("config") or {}
    return [w for w in cfg.get("workloads") or [] if isinstance(w, dict)]


def device_index(device: Any) -> int | None:
    """`cuda:1` -> 1; `cuda` -> 0; anything else (cpu) -> None."""
    text = str(device or "")
    if not text.startswith("cuda"):
        return None
    _, _, idx = text.partition(":")
    return int(idx) if idx.isdigit() else 0


def effective_limits(rec: Recording) -> dict[int, tuple[int | None, int | None, str]]:
    """Per GPU: (effective limit bytes, card total bytes, what the limit is)."""
    totals: dict[int, int | None] = {}
    for g in rec.meta.get("gpus") or []:
        if isinstance(g, dict) and g.get("index") is not None:
            totals[int(g["index"])] = g.get("mem_total_bytes")
    s = rec.samples.filter(pl.col("gpu").is_not_null())
    if s.height:
        for gpu, tot in s.group_by("gpu").agg(pl.col("gpu_mem_total_bytes").max()).iter_rows():
            if tot is not None:
                totals[int(gpu)] = int(tot)
    caps: dict[int, int] = {}
    for w in workloads(rec):
        cap = (w.get("faults") or {}).get("memory_limit_bytes")
        idx = device_index(w.get("device"))
        if cap and idx is not None:
            caps[idx] = min(int(cap), caps.get(idx, int(cap)))
    out = {}
    for gpu in sorted(set(totals) | set(caps)):
        total, cap = totals.get(gpu), caps.get(gpu)
        if cap is not None and (total is None or cap < total):
            out[gpu] = (cap, total, "workload memory cap")
        else:
            out[gpu] = (total, total, "card total")
    return out


def step_count(rec: Recording) -> StepCount:
    """How many steps the session ran and where that is known from (recording/recorded.py): its steps
    table, else its workload_stop events where steps.parquet is missing."""
    return recorded_steps(rec.path, rec.meta, rec.steps, rec.events)


def active_window(rec: Recording) -> tuple[datetime, datetime] | None:
    """While the workload ran (first to last step end), else the whole session."""
    if rec.steps.height >= 2:
        return rec.steps["ts"].min(), rec.steps["ts"].max()
    if rec.samples.height:
        return rec.samples["ts"].min(), rec.samples["ts"].max()
    return None


def mem_used_expr() -> pl.Expr:
    """Used memory comparable across schema versions (v1 "used" includes the driver's reserved part)."""
    return (pl.col("gpu_mem_used_bytes").cast(pl.Int64)
            + pl.col("gpu_mem_reserved_bytes").cast(pl.Int64).fill_null(0)).alias("mem_used")


def measured_steps(steps: pl.DataFrame) -> pl.DataFrame:
    """Steps that measure steady behaviour: not a warmup phase, not a workload's first step."""
    if steps.is_empty():
        return steps
    first = pl.col("step") == pl.col("step").min().over("gpu")
    return steps.filter(~pl.col("phase").fill_null("").str.contains("warmup") & ~first)


def _context(rec: Recording) -> _Ctx:
    s = rec.samples.filter(pl.col("gpu").is_not_null())
    win = active_window(rec)
    active = s.filter(pl.col("ts").is_between(*win)) if win and s.height else s
    if active.is_empty():
        active = s
    return _Ctx(samples=s, active=active, window=win, limits=effective_limits(rec))


def _gpu_note(gpu: int, n_gpus: int) -> str:
    return f"GPU {gpu}: " if n_gpus > 1 else ""


def _util_row(ctx: _Ctx, th: Thresholds) -> Row:
    name = "GPU utilization"
    per = (ctx.active.filter(pl.col("gpu_util_pct").is_not_null())
           .group_by("gpu").agg(pl.col("gpu_util_pct").cast(pl.Float64).mean().alias("mean"), pl.len()).sort("gpu"))
    thr = th.min_util_pct / 100
    if per.is_empty():
        return Row(name, None, thr, None, "no utilization samples", "%", ">")
    gpu, mean, n = min(per.iter_rows(), key=lambda r: r[1])
    where = "while the workload ran" if ctx.window and ctx.active.height < ctx.samples.height else "over the session"
    return Row(name, mean / 100, thr, mean > th.min_util_pct,
               f"{_gpu_note(gpu, per.height)}mean of {n} samples {where}", "%", ">")


def _mfu_row(rec: Recording, th: Thresholds) -> Row:
    name = "Compute (TFLOP/s vs peak)"
    st = measured_steps(rec.steps).filter(pl.col("mfu").is_not_null() & pl.col("mfu").is_finite()
                                          & pl.col("tflops").is_not_null())
    if st.is_empty():
        why = step_count(rec).note if rec.steps.is_empty() else "no MFU recorded (peak unknown, e.g. CPU)"
        if rec.steps.is_empty() and step_count(rec).table_missing:
            why += ": no step to judge"
        return Row(name, None, th.min_mfu, None, why, "%")
    med = float(st["mfu"].median())
    tfl = float(st["tflops"].median())
    peak = tfl / med if med > 0 else None
    best = (st.group_by("phase").agg(pl.col("mfu").median()).sort("mfu", descending=True).row(0))
    detail = f"median of {st.height} steps: {tfl:.0f} TFLOP/s"
    if peak:
        detail += f" of a {peak:.0f} TFLOP/s dense peak"
    if st["phase"].n_unique() > 1:
        detail += f"; best phase {best[0]}: {best[1] * 100:.1f} %"
    return Row(name, med, th.min_mfu, med >= th.min_mfu, detail, "%")


@dataclass(frozen=True)
class GpuMemory:
    """One GPU's memory over a session by the one rule (recording/frames.py process_memory): the peak of
    the workload process's own memory where NVML listed it, else of the whole GPU, and its limit then."""

    gpu: int
    peak: float  # bytes
    limit: float | None  # bytes: what the peak is measured against
    own: bool  # peak is the workload process's own memory (else the whole GPU's used + reserved)
    cap: float | None  # the workload's memory cap (--gpu-memory-limit), if one was set
    others: float  # other processes' memory at the peak (bytes)
    whole_peak: float  # the whole GPU's highest used + reserved (bytes), whoever held it
    workload: bool = True  # the process is known as the session's workload (its PID in meta.json), not only the one listed

    @property
    def frac(self) -> float | None:
        return self.peak / self.limit if self.limit else None

    @property
    def what(self) -> str:
        """What the peak and the limit are, in words."""
        who = "the workload process's own memory" if self.workload else "the memory of the GPU's one process"
        if self.own and self.cap:
            extra = (self.limit or 0) - self.cap
            return f"{who} vs its memory cap {_gib(self.cap)}" + (f" + {_gib(extra)} outside torch" if extra > 2**20 else "")
        if self.own:
            return f"{who} vs what the card leaves it" + (
                f"; other processes held {_gib(self.others)}" if self.others > 2**30 else "")
        return "workload memory cap" if self.cap and self.limit == self.cap else "card total"


def gpu_memory(rec: Recording) -> dict[int, GpuMemory]:
    """Per GPU of `rec`: its memory peak and limit by the process's-own-memory rule (the health row, the
    report's summary; the risk features read the same rule per window)."""
    s = rec.samples.filter(pl.col("gpu").is_not_null() & pl.col("gpu_mem_used_bytes").is_not_null())
    if s.is_empty():
        return {}
    s = sorted_by_time(s)
    caps = recorded_caps(rec.meta)
    totals = {int(g["index"]): g.get("mem_total_bytes") for g in rec.meta.get("gpus") or []
              if isinstance(g, dict) and g.get("index") is not None}
    out = {}
    for (gpu,), part in s.group_by(["gpu"], maintain_order=True):
        g = int(gpu)
        steps = rec.steps.filter(pl.col("gpu") == g) if rec.steps.height else rec.steps
        cap = caps.get(g)
        pid = recorded_pid(rec.meta, g)
        got = own_peak(part, sorted_by_time(steps) if steps.height else steps, pid, float(cap) if cap else None,
                       totals.get(g))
        if got is None:
            continue
        peak, basis = got
        whole = float(part.select(mem_used_expr()).max().item())
        out[g] = GpuMemory(g, peak, basis.limit, basis.own, float(cap) if cap else None, basis.others, whole,
                           workload=pid is not None)
    return dict(sorted(out.items()))


def _mem_row(rec: Recording, ctx: _Ctx, th: Thresholds) -> Row:
    name = "Memory (peak vs limit)"
    mem = gpu_memory(rec)
    if not mem:
        return Row(name, None, th.max_mem_frac, None, "no memory samples", "%", "<=")
    judged = [m for m in mem.values() if m.frac is not None]
    if not judged:
        return Row(name, None, th.max_mem_frac, None, "card memory size unknown", "%", "<=")
    m = max(judged, key=lambda x: x.frac)
    ooms = rec.events.filter(pl.col("kind") == "oom").height
    detail = f"{_gpu_note(m.gpu, len(mem))}peak {_gib(m.peak)} of {_gib(m.limit)} ({m.what})"
    if m.own and m.cap and m.limit == m.cap and step_count(rec).table_missing:
        detail += f"; its memory outside torch is not known without {STEPS_FILE} (torch's reserved bytes)"
    if m.own and m.whole_peak > m.peak * 1.05 + 2**30:
        detail += f"; the whole GPU peaked at {_gib(m.whole_peak)}, shared with other processes"
    if ooms:
        detail += f"; {ooms} OOM{'s' if ooms > 1 else ''}"
    return Row(name, m.frac, th.max_mem_frac, m.frac <= th.max_mem_frac, detail, "%", "<=")


def slowdown_temps(rec: Recording) -> dict[int, int]:
    out: dict[int, int] = {}
    for g in rec.meta.get("gpus") or []:
        if isinstance(g, dict) and g.get("index") is not None and g.get("temp_slowdown_c"):
            out[int(g["index"])] = int(g["temp_slowdown_c"])
    s = rec.samples.filter(pl.col("gpu").is_not_null() & pl.col("gpu_temp_slowdown_c").is_not_null())
    for gpu, t in s.group_by("gpu").agg(pl.col("gpu_temp_slowdown_c").min()).iter_rows():
        out[int(gpu)] = int(t)
    return out


def _temp_row(rec: Recording, ctx: _Ctx, th: Thresholds) -> Row:
    name = "Temperature"
    s = ctx.samples.filter(pl.col("gpu_temp_c").is_not_null())
    if s.is_empty():
        return Row(name, None, None, None, "no temperature samples", "°C", "<")
    slow = slowdown_temps(rec)
    maxes = s.group_by("gpu").agg(pl.col("gpu_temp_c").max()).sort("gpu")
    worst = None
    for gpu, t in maxes.iter_rows():
        if int(gpu) not in slow:
            continue
        margin = slow[int(gpu)] - t
        if worst is None or margin < worst[3]:
            worst = (gpu, t, slow[int(gpu)], margin)
    if worst is None:
        return Row(name, float(maxes["gpu_temp_c"].max()), None, None, "slowdown threshold unknown", "°C", "<")
    gpu, t, sd, _ = worst
    limit = sd - th.temp_margin_c
    return Row(name, float(t), float(limit), t < limit,
               f"{_gpu_note(gpu, maxes.height)}max {t} °C; slowdown at {sd} °C (margin {th.temp_margin_c:g} °C)",
               "°C", "<")


def throttle_breakdown(frame: pl.DataFrame, mask: int) -> tuple[float, dict[str, float]]:
    """Fraction of rows with any `mask` bit set, and per reason name the fraction with that bit."""
    r = frame["gpu_clocks_event_reasons"].drop_nulls()
    if r.is_empty():
        return 0.0, {}
    n = r.len()
    anyf = float(((r & mask) != 0).sum()) / n
    per = {name: float(((r & bit) != 0).sum()) / n for bit, name in REASONS.items() if bit & mask}
    return anyf, {k: v for k, v in per.items() if v > 0}


def throttle_row(rec: Recording, th: Thresholds) -> tuple[Row, pl.DataFrame]:
    """The health matrix's throttling row and the samples it judged (while the workload ran): the
    report's anomaly list quotes the same figure, not a second one over the whole session."""
    ctx = _context(rec)
    return _throttle_row(ctx, th), ctx.active


def _throttle_row(ctx: _Ctx, th: Thresholds) -> Row:
    name = "Throttling"
    a = ctx.active.filter(pl.col("gpu_clocks_event_reasons").is_not_null())
    if a.is_empty():
        return Row(name, None, th.max_throttle_frac, None, "no clock-event reasons recorded", "%", "<=")
    worst = None
    for (gpu,), part in a.group_by(["gpu"], maintain_order=True):
        frac, per = throttle_breakdown(part, th.throttle_mask)
        if worst is None or frac > worst[1]:
            worst = (gpu, frac, per)
    gpu, frac, per = worst
    reasons = ", ".join(f"{k} {v * 100:.0f} %" for k, v in sorted(per.items(), key=lambda kv: -kv[1])) or "none"
    detail = f"{_gpu_note(gpu, a['gpu'].n_unique())}share of samples held back: {reasons}"
    return Row(name, frac, th.max_throttle_frac, frac <= th.max_throttle_frac, detail, "%", "<=")


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def health_matrix(rec: Recording, thresholds: Thresholds | None = None) -> list[Row]:
    """The five rows (utilization, compute, memory, temperature, throttling) for `rec`."""
    th = thresholds or Thresholds()
    ctx = _context(rec)
    return [_util_row(ctx, th), _mfu_row(rec, th), _mem_row(rec, ctx, th), _temp_row(rec, ctx, th),
            _throttle_row(ctx, th)]
