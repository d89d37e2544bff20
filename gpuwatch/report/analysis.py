"""Everything the report says about a session, as plain data (dicts, lists, numbers, text).

Pure functions of a `Recording` (no I/O, no plotting): the templates only lay this out.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import polars as pl

from gpuwatch.recording.reader import Recording
from gpuwatch.report.health import (
    Row, Thresholds, active_window, effective_limits, gpu_memory, measured_steps, mem_used_expr, step_count,
    throttle_breakdown, throttle_row, workloads,
)
from gpuwatch.recording.recorded import STEPS_FILE
from gpuwatch.units import fmt_bytes

# event kinds that are problems (the anomalies table), in display order
ANOMALY_KINDS = ("gpu_lost", "xid", "workload_error", "recorder_error", "oom", "guard_miss", "nonfinite",
                 "integrity_mismatch", "risk_alarm", "sla_breach", "throttle_onset")
UNRESOLVED = {"gpu_lost", "xid", "workload_error", "guard_miss"}
KIND_NAMES = {"oom": "OOM", "nonfinite": "non-finite output", "xid": "XID error", "gpu_lost": "GPU lost",
              "sla_breach": "SLA breach"}


@dataclass
class Anomaly:
    kind: str
    count: int
    first: str
    last: str
    example: str
    action: str  # what was done about it
    severity: str = "warning"


@dataclass
class Sweep:
    kind: str  # "sweep" or "ramp"
    rows: list[dict[str, Any]] = field(default_factory=list)


def _dt(x: datetime | None) -> str:
    return x.strftime("%Y-%m-%d %H:%M:%S UTC") if x else "-"


def _clock(x: datetime | None) -> str:
    return x.strftime("%H:%M:%S") if x else "-"


def fmt_duration(s: float | None) -> str:
    if s is None:
        return "-"
    s = float(s)
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{int(s // 60)} min {int(s % 60)} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60)} min"


def fmt_num(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    if abs(x) >= 10 ** digits:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def _detail(s: str | None) -> dict[str, Any]:
    if not s:
        return {}
    try:
        d = json.loads(s)
    except ValueError:
        return {}
    return d if isinstance(d, dict) else {}


def session_span(rec: Recording) -> tuple[datetime | None, datetime | None]:
    ts = [f["ts"] for f in (rec.samples, rec.steps, rec.events) if f.height]
    if not ts:
        return None, None
    return min(t.min() for t in ts), max(t.max() for t in ts)


def session_tokens(steps: pl.DataFrame) -> float:
    if steps.is_empty():
        return 0.0
    return float(steps.select((pl.col("tokens_per_s") * pl.col("step_time_s")).sum()).item() or 0.0)


# ---------------------------------------------------------------- environment and method

def environment(rec: Recording) -> list[tuple[str, str]]:
    m = rec.meta
    rows: list[tuple[str, str]] = []
    for g in m.get("gpus") or []:
        if not isinstance(g, dict):
            continue
        bits = [str(g.get("name") or "?")]
        if g.get("mem_total_bytes"):
            bits.append(fmt_bytes(g["mem_total_bytes"]))
        if g.get("power_limit_w"):
            bits.append(f"{g['power_limit_w']:.0f} W limit")
        if g.get("temp_slowdown_c"):
            bits.append(f"slowdown {g['temp_slowdown_c']} °C")
        if g.get("pci_bus_id"):
            bits.append(f"PCI {g['pci_bus_id']}")
        rows.append((f"GPU {g.get('index', '?')}", ", ".join(bits)))
    if not rows:
        rows.append(("GPU", m.get("gpu_note") or "none recorded"))
    v = m.get("versions") or {}
    cuda = v.get("cuda") or v.get("torch.cuda") or m.get("cuda_version")
    rows += [("Driver", str(m.get("driver_version") or "-")),
             ("CUDA", str(cuda) if cuda else "not recorded (torch " + str(v.get("torch", "-")) + ")"),
             ("Host", f"{m.get('host', '-')} ({m.get('cpu_count', '?')} CPUs)"),
             ("Platform", str(m.get("platform") or "-")),
             ("Sampler", f"{m.get('sampler') or '-'}, GPU backend {m.get('gpu_backend') or '-'}")]
    if v:
        rows.append(("Versions", ", ".join(f"{k} {val}" for k, val in v.items())))
    if m.get("argv"):
        rows.append(("Command", " ".join(str(a) for a in m["argv"])))
    return rows


def method(rec: Recording) -> tuple[list[str], list[dict[str, str]]]:
    """(general lines, one dict per workload)."""
    cfg = rec.meta.get("config") or {}
    start, end = session_span(rec)
    lines = []
    if start and end:
        lines.append(f"Recorded {_dt(start)} to {_clock(end)} ({fmt_duration((end - start).total_seconds())})"
                     + ("" if rec.complete else "; the session did not stop cleanly (incomplete)"))
    if cfg.get("interval_s"):
        lines.append(f"Sampling every {cfg['interval_s'] * 1000:.0f} ms; "
                     f"{rec.samples.height:,} samples, {step_count(rec).note}, {rec.events.height:,} events")
    out = []
    for w in workloads(rec):
        faults = w.get("faults") or {}
        fl = []
        if faults.get("leak_mib"):
            fl.append(f"leak {faults['leak_mib']:.0f} MiB/step")
        if faults.get("fragment"):
            fl.append("fragmentation")
        if faults.get("fp16_overflow"):
            fl.append("fp16 overflow")
        if faults.get("memory_limit_bytes"):
            fl.append(f"memory cap {fmt_bytes(faults['memory_limit_bytes'])}")
        if w.get("integrity_every"):
            fl.append(f"integrity check every {w['integrity_every']} steps")
        params = w.get("params")
        out.append({
            "device": str(w.get("device") or "-"),
            "preset": f"{w.get('preset', '-')}" + (f" ({params / 1e9:.3g} B params)" if params else ""),
            "mode": str(w.get("mode") or "-"), "schedule": str(w.get("schedule") or "-"),
            "precision": str(w.get("precision") or "-"),
            "shape": f"batch {w.get('batch', '-')} x {w.get('seq_len', '-')} tokens",
            "faults": ", ".join(fl) or "none",
            "overrides": ", ".join(f"{k}={v}" for k, v in (w.get("overrides") or {}).items()) or "none",
        })
    if not out:
        lines.append("No workload: telemetry only (gpuwatch watch or record)")
    return lines, out


# ---------------------------------------------------------------- sweep

def batch_table(rec: Recording) -> Sweep | None:
    """Per batch of a `sweep b=N` (else `ramp b=N`) schedule: latency, throughput, MFU, memory."""
    st = rec.steps.filter(pl.col("phase").is_not_null())
    if st.is_empty():
        return None
    st = st.with_columns(pl.col("phase").str.extract(r"^(sweep|ramp) b=\d+", 1).alias("_kind"))
    kinds = set(st["_kind"].drop_nulls().to_list())
    if not kinds:
        return None
    kind = "sweep" if "sweep" in kinds else "ramp"
    st = st.filter(pl.col("_kind") == kind)
    ooms = rec.events.filter(pl.col("kind") == "oom")
    oom_batches = Counter(_detail(d).get("batch") for d in ooms["detail"].to_list())
    multi = st["gpu"].n_unique() > 1
    keys = ["gpu", "batch"] if multi else ["batch"]
    warm = pl.col("phase").str.contains("warmup")
    g = (st.group_by(keys).agg(
        pl.len().alias("steps"), warm.sum().alias("warmup"),
        pl.col("step_time_s").filter(~warm).median().alias("lat_p50"),
        pl.col("step_time_s").filter(~warm).quantile(0.9).alias("lat_p90"),
        pl.col("tokens_per_s").filter(~warm).median().alias("tps"),
        pl.col("tflops").filter(~warm).median().alias("tflops"),
        pl.col("mfu").filter(~warm).median().alias("mfu"),
        pl.col("torch_peak_bytes").max().alias("peak"),
        pl.col("seq_len").first().alias("seq_len"), pl.col("precision").first().alias("precision"),
    ).sort(keys))
    rows = []
    for r in g.iter_rows(named=True):
        r["oom"] = oom_batches.get(r["batch"], 0)
        r["label"] = f"GPU {r['gpu']} b={r['batch']}" if multi else f"b={r['batch']}"
        rows.append(r)
    # batches that only ever OOMed still belong in the table
    seen = {r["batch"] for r in rows}
    for b, n in sorted((b, n) for b, n in oom_batches.items() if isinstance(b, int) and b not in seen):
        if kind == "ramp" or b in {int(x) for x in st["phase"].str.extract(r"b=(\d+)", 1).drop_nulls().to_list()}:
            rows.append({"batch": b, "steps": 0, "warmup": 0, "lat_p50": None, "lat_p90": None, "tps": None,
                         "tflops": None, "mfu": None, "peak": None, "seq_len": None, "precision": None,
                         "oom": n, "label": f"b={b}", "gpu": None})
    return Sweep(kind, rows)


# ---------------------------------------------------------------- anomalies

def _gap_rows(rec: Recording, th: Thresholds) -> pl.DataFrame:
    interval = float((rec.meta.get("config") or {}).get("interval_s") or 0.1)
    lim = int(interval * 1e6 * th.gap_factor)
    return rec.samples.filter(pl.col("sampler_interval_us") > lim).unique(["tick"], keep="first").sort("ts")


def anomalies(rec: Recording, th: Thresholds) -> list[Anomaly]:
    ev = rec.events
    out: list[Anomaly] = []
    recov = ev.filter(pl.col("kind") == "oom_recovered")
    guard = ev.filter(pl.col("kind") == "guard_action")
    modes = {str(w.get("mode")) for w in workloads(rec)}
    for kind in ANOMALY_KINDS:
        part = ev.filter(pl.col("kind") == kind)
        if part.is_empty():
            continue
        first, last = part["ts"].min(), part["ts"].max()
        action = _action(kind, part, recov, guard, modes)
        if kind in UNRESOLVED or "not recovered" in action:
            sev = "error"
        elif kind == "oom" or kind == "integrity_mismatch" and "NaN" in action:
            sev = "warning"  # every one recovered / a known false alarm
        else:
            sev = str(part["severity"][0] or "warning")
        out.append(Anomaly(KIND_NAMES.get(kind, kind.replace("_", " ")), part.height, _clock(first), _clock(last),
                           str(part["message"][0] or ""), action, sev))
    # throttling from the samples (there are no throttle_* events yet)
    row, active = throttle_row(rec, th)  # the matrix's own figure (worst GPU, while the workload ran)
    a = active.filter(pl.col("gpu_clocks_event_reasons").is_not_null())
    if a.height and "throttle onset" not in {x.kind for x in out} and row.value:
        frac, per = throttle_breakdown(a, th.throttle_mask)
        frac = row.value
        if frac > 0:
            held = a.filter((pl.col("gpu_clocks_event_reasons") & th.throttle_mask) != 0)
            reasons = ", ".join(f"{k} {v * 100:.0f} %" for k, v in sorted(per.items(), key=lambda kv: -kv[1]))
            thermal = any(k in per for k in ("SW thermal", "HW thermal", "HW slowdown", "HW power brake"))
            out.append(Anomaly(
                "throttling", held.height, _clock(held["ts"].min()), _clock(held["ts"].max()),
                f"clocks held back in {frac * 100:.0f} % of samples ({reasons})",
                "none: the driver limits clocks" + ("; the workload does not react" if rec.steps.height else "") + (
                    " (thermal: check cooling)" if thermal else " (power cap: expected at full load)"),
                "error" if thermal else "info"))
    gaps = _gap_rows(rec, th)
    if gaps.height:
        worst = gaps["sampler_interval_us"].max() / 1e6
        out.append(Anomaly(
            "telemetry gap", gaps.height, _clock(gaps["ts"].min()), _clock(gaps["ts"].max()),
            f"longest tick interval {worst:.2f} s (more than {th.gap_factor:g}x the interval)",
            "none: samples in it are missing; the charts leave it blank", "warning"))
    if rec.meta.get("start") and not rec.complete and not rec.meta.get("single_file"):
        out.append(Anomaly("incomplete session", 1, "-", "-", "meta.json has no clean stop (killed, crashed, or "
                           "still recording)", "none: everything written up to the end was read", "warning"))
    for w in rec.warnings:
        out.append(Anomaly("unreadable file", 1, "-", "-", w, "skipped; the rest of the session was read", "warning"))
    n = step_count(rec)
    if n.table_missing:
        out.append(Anomaly("missing table", 1, "-", "-", f"{STEPS_FILE} is missing from the session folder",
                           (f"the workload ran {n.note}" if n.steps is not None else n.note)
                           + "; nothing per step (throughput, MFU, torch memory, batch table) can be shown", "warning"))
    return out


def _action(kind: str, part: pl.DataFrame, recov: pl.DataFrame, guard: pl.DataFrame, modes: set[str]) -> str:
    if kind == "oom":
        decisions: Counter[str] = Counter()
        back = 0
        missing = 0
        rts = recov["ts"].to_list()
        rgpu = recov["gpu"].to_list()
        rdet = [_detail(d) for d in recov["detail"].to_list()]
        j = 0
        for ts, gpu in zip(part["ts"].to_list(), part["gpu"].to_list()):
            while j < len(rts) and (rts[j] < ts or rgpu[j] != gpu):
                j += 1
            if j < len(rts):
                decisions[str(rdet[j].get("decision") or "recovered")] += 1
                back += bool(rdet[j].get("back_to_pre_step"))
                j += 1
            else:
                missing += 1
        text = "; ".join(f"{d} ({n}x)" if n > 1 else d for d, n in decisions.most_common(4))
        if decisions:
            text = f"recovered {sum(decisions.values())} of {part.height}: {text}"
            if back:
                text += f"; memory back to the pre-step level {back} time{'s' if back > 1 else ''}"
        if missing:
            text = (text + "; " if text else "") + f"{missing} not recovered"
        return text
    if kind == "risk_alarm":
        if guard.is_empty():
            return "no guard action recorded"
        acts = Counter(str(_detail(d).get("action") or m) for d, m in zip(guard["detail"].to_list(),
                                                                          guard["message"].to_list()))
        return "guard: " + "; ".join(f"{a} ({n}x)" for a, n in acts.most_common(4))
    if kind == "nonfinite":
        if "train" in modes:
            fp16 = any("fp16" in str(m) for m in part["message"].to_list())
            return "the update of each non-finite step was skipped" + (" and the fp16 loss scale halved" if fp16 else "")
        return "none: output recorded as non-finite"
    if kind == "integrity_mismatch":
        diffs = [_detail(d).get("max_abs_diff") for d in part["detail"].to_list()]
        if diffs and all(isinstance(x, float) and math.isnan(x) for x in diffs):
            return ("recorded only; every one compared non-finite outputs (difference NaN), which newer gpuwatch "
                    "treats as consistent: see the non-finite outputs instead")
        return "recorded only (the workload went on)"
    if kind in UNRESOLVED:
        return "not recovered"
    return "recorded"


# ---------------------------------------------------------------- energy

def energy(rec: Recording) -> dict[str, Any] | None:
    """Tokens per joule over the workload's active window, from the energy counter where it advanced over
    at least 10 s of that window, else by integrating power over time."""
    s = rec.samples.filter(pl.col("gpu").is_not_null())
    if s.is_empty():
        return None
    win = active_window(rec) if rec.steps.height else None
    if win:
        s = s.filter(pl.col("ts").is_between(*win))
    joules = 0.0
    span = 0.0
    sources = set()
    tokens = 0.0
    steps = rec.steps
    for (gpu,), g in s.sort("ts").group_by(["gpu"], maintain_order=True):
        gsteps = steps.filter(pl.col("gpu") == gpu) if steps.height else steps
        e = g.filter(pl.col("gpu_energy_mj").is_not_null())
        used = False
        if e.height:
            changes = e.filter(pl.col("gpu_energy_mj") != pl.col("gpu_energy_mj").shift(1))
            if changes.height >= 2:
                ta, tb = changes["ts"][0], changes["ts"][-1]
                if (tb - ta).total_seconds() >= 10:
                    joules += (changes["gpu_energy_mj"][-1] - changes["gpu_energy_mj"][0]) / 1000
                    span = max(span, (tb - ta).total_seconds())
                    if gsteps.height:
                        tokens += session_tokens(gsteps.filter((pl.col("ts") > ta) & (pl.col("ts") <= tb)))
                    sources.add("energy counter (between its first and last reading in the window)")
                    used = True
        if not used:
            p = g.filter(pl.col("gpu_power_w").is_not_null())
            if p.height < 2:
                continue
            t = (p["ts"].dt.epoch("us").cast(pl.Float64) / 1e6).to_numpy()
            w = p["gpu_power_w"].cast(pl.Float64).to_numpy()
            joules += float(((w[1:] + w[:-1]) / 2 * (t[1:] - t[:-1])).sum())
            span = max(span, float(t[-1] - t[0]))
            if gsteps.height:
                tokens += session_tokens(gsteps.filter(pl.col("ts").is_between(p["ts"][0], p["ts"][-1])))
            sources.add("power integrated over time")
    if joules <= 0:
        return None
    return {"joules": joules, "seconds": span, "avg_w": joules / span if span else None, "tokens": tokens,
            "tokens_per_j": tokens / joules if tokens else None, "source": " and ".join(sorted(sources)),
            "window": "while the workload ran" if win else "whole session"}


# ---------------------------------------------------------------- recommendations

def _batch_recommendations(rec: Recording, th: Thresholds) -> list[str]:
    """The largest batch that fitted with headroom, per (GPU, mode, seq_len, precision) that OOMed or ran."""
    out: list[str] = []
    st = rec.steps
    limits = effective_limits(rec)
    ooms = rec.events.filter(pl.col("kind") == "oom")
    if st.height:
        groups = st.group_by("gpu", "mode", "seq_len", "precision").agg(pl.len())
        for gpu, mode, seq, prec, _ in groups.iter_rows():
            part = st.filter(pl.col("gpu").eq_missing(gpu) & pl.col("mode").eq_missing(mode)
                             & pl.col("seq_len").eq_missing(seq) & pl.col("precision").eq_missing(prec))
            per = part.group_by("batch").agg(pl.col("torch_peak_bytes").max().alias("peak"),
                                             pl.col("tokens_per_s").median().alias("tps")).sort("batch")
            limit = limits.get(int(gpu), (None, None, ""))[0] if gpu is not None else None
            oomb = sorted({d.get("batch") for d in map(_detail, ooms.filter(pl.col("gpu").eq_missing(gpu))["detail"].to_list())
                if d.get("seq_len") == seq and d.get("precision") == prec and isinstance(d.get("batch"), int)})
            largest = int(per["batch"].max())
            fit = None
            if limit:
                ok = per.filter(pl.col("peak").is_not_null() & (pl.col("peak") <= (1 - th.headroom_frac) * limit))
                fit = ok.row(-1, named=True) if ok.height else None
            what = f"{mode} {seq} tokens {prec}" + (f" on GPU {gpu}" if len(limits) > 1 else "")
            completed = set(per["batch"].to_list())
            if oomb and oomb[0] in completed:
                grew = [b for b in oomb if b in completed]
                leak = any((w.get("faults") or {}).get("leak_mib") for w in workloads(rec))
                out.append(f"{what}: OOMs at batch {', '.join(map(str, grew))}, which also completed: memory grew over "
                           "the run (a leak or fragmentation), so a smaller batch only delays the next OOM"
                           + ("; the leak fault was on" if leak else "; look for tensors kept across steps") + ".")
            elif oomb:
                smallest_oom = oomb[0]
                msg = f"{what}: batch {smallest_oom} ran out of memory; the largest batch that completed was {largest}"
                if fit:
                    msg += (f"; batch {fit['batch']} peaked at {fmt_bytes(fit['peak'])} of {fmt_bytes(limit)}, "
                            f"leaving at least {th.headroom_frac * 100:.0f} % headroom: use batch {fit['batch']} or less")
                else:
                    msg += f"; no batch left {th.headroom_frac * 100:.0f} % headroom below the limit"
                out.append(msg + ".")
            elif fit and fit["batch"] == largest and per.height > 1:
                out.append(f"{what}: every batch up to {largest} fitted with {th.headroom_frac * 100:.0f} % headroom "
                           f"(peak {fmt_bytes(fit['peak'])} of {fmt_bytes(limit)}); larger batches may too.")
    return out


def recommendations(rec: Recording, matrix: list[Row], th: Thresholds, sweep: Sweep | None,
                    anomalies_: list[Anomaly] | None = None) -> list[str]:
    """What to change, in sentences: per batch shape, throughput, precision, integrity, the health rows,
    telemetry gaps; where none applies, one line that says what the matrix and the anomalies say (never
    "every check passed" of checks that could not be judged or that failed)."""
    st = rec.steps
    ev = rec.events
    out = _batch_recommendations(rec, th)
    if sweep and sweep.rows and not set(st["mode"].drop_nulls().to_list()) <= {"train"}:
        meas = [r for r in sweep.rows if r.get("tps")]
        if len(meas) >= 2:
            best = max(meas, key=lambda r: r["tps"])
            knee = next(r for r in meas if r["tps"] >= 0.95 * best["tps"])
            if knee is not best and knee["lat_p50"] and best["lat_p50"]:
                out.append(f"Throughput saturates: batch {knee['batch']} reaches {knee['tps'] / best['tps'] * 100:.0f} % "
                           f"of the best tokens/s (batch {best['batch']}) at {knee['lat_p50'] / best['lat_p50'] * 100:.0f} % "
                           f"of its step latency; prefer batch {knee['batch']} where latency matters.")
    nonfin = ev.filter(pl.col("kind") == "nonfinite")
    if nonfin.height:
        precs = Counter(st["precision"].drop_nulls().to_list()) if st.height else Counter()
        n = st.height or nonfin.height
        line = f"{nonfin.height} of {n} steps gave non-finite outputs"
        if precs.get("fp16"):
            line += ("; fp16's range overflowed: use bf16 (same speed on Ampere and later, fp32's exponent range) "
                     "or fp32/tf32 for this model.")
        else:
            line += "; check the learning rate and inputs, or run in fp32 to see whether precision is the cause."
        out.append(line)
    mism = ev.filter(pl.col("kind") == "integrity_mismatch")
    if mism.height and not all(isinstance(x := _detail(d).get("max_abs_diff"), float) and math.isnan(x)
                               for d in mism["detail"].to_list()):
        out.append("Integrity mismatches: the same input gave different outputs. If they persist where outputs are "
                   "finite, suspect the hardware (run the card's diagnostics).")
    rows = {r.name: r for r in matrix}
    util, mfu, temp, thr = (rows.get("GPU utilization"), rows.get("Compute (TFLOP/s vs peak)"),
                            rows.get("Temperature"), rows.get("Throttling"))
    if util and util.passed is False and st.height:
        out.append(f"GPU utilization averaged {util.value_text} while the workload ran: the GPU waited on the host "
                   "or on small kernels; a larger batch or sequence keeps it busier.")
    if mfu and mfu.passed is False:
        out.append(f"Achieved compute is {mfu.value_text} of the dense peak (target {mfu.threshold_text}): "
                   "MoE routing and small per-expert matmuls cost efficiency; larger batches and bf16 raise it.")
    if temp and temp.passed is False:
        out.append(f"The GPU reached {temp.value_text}, within {th.temp_margin_c:g} °C of its slowdown threshold: "
                   "check airflow and fan settings before longer runs.")
    if thr and thr.passed is False and "power cap" in thr.detail and st.height:
        out.append("Clocks were held by the power cap for much of the run: the workload is power-bound, so tokens "
                   "per joule (below) is the figure to compare across settings.")
    gaps = _gap_rows(rec, th)
    if gaps.height:
        out.append(f"{gaps.height} telemetry gap{'s' if gaps.height > 1 else ''} (up to "
                   f"{gaps['sampler_interval_us'].max() / 1e6:.1f} s): the sampler stalled; if it recurs outside "
                   "start-up, keep the sampler in its own process (the default) and check host load.")
    if not out:
        out.append(nothing_to_change(matrix, anomalies_))
    return out


def nothing_to_change(matrix: list[Row], anomalies_: list[Anomaly] | None) -> str:
    """The line where no recommendation applies, as the verdict sees the same rows and anomalies."""
    judged = [r for r in matrix if r.passed is not None]
    failed = [r.name for r in judged if not r.passed]
    seen = ("no anomaly was recorded" if not anomalies_
            else "see the anomalies above" if anomalies_ is not None else "")
    tail = f"; {seen}." if seen else "."
    if failed:
        return f"No change to suggest for the failed checks ({', '.join(failed)}): see the health matrix{tail}"
    if not judged:
        return f"Nothing to recommend: none of the {len(matrix)} health checks could be judged (no data){tail}"
    if len(judged) < len(matrix):
        return (f"Nothing to change: the {len(judged)} checks with data passed "
                f"({len(matrix) - len(judged)} had no data){tail}")
    return f"Nothing to change: every check passed{tail}"


# ---------------------------------------------------------------- verdict and summary

def verdict(matrix: list[Row], anomalies_: list[Anomaly]) -> tuple[str, str]:
    """('PASS' | 'WARN' | 'FAIL', one sentence)."""
    failed = [r.name for r in matrix if r.passed is False]
    bad = [a for a in anomalies_ if a.severity == "error"]
    warn = [a for a in anomalies_ if a.severity == "warning"]
    checked = [r for r in matrix if r.passed is not None]
    parts = [f"{len(checked) - len(failed)} of {len(checked)} health checks passed"]
    if failed:
        parts.append("failed: " + ", ".join(failed))
    if bad:
        parts.append("errors: " + ", ".join(f"{a.count} {a.kind}" for a in bad))
    if warn:
        parts.append("warnings: " + ", ".join(f"{a.count} {a.kind}" for a in warn))
    word = "FAIL" if failed or bad else ("WARN" if warn else "PASS")
    if not checked and not failed and not bad:  # nothing could be judged: never a green PASS
        parts[0] = (f"no data: none of the {len(matrix)} health checks could be judged "
                    f"({'; '.join(sorted({r.detail for r in matrix if r.detail}))})")
        word = "NO DATA"
    return word, "; ".join(parts) + "."


def summary(rec: Recording, en: dict[str, Any] | None) -> list[tuple[str, str]]:
    start, end = session_span(rec)
    rows = [("Session", rec.path.name), ("Duration", fmt_duration((end - start).total_seconds()) if start else "-")]
    ws = workloads(rec)
    if ws:
        rows.append(("Workload", "; ".join(f"{w.get('preset')} {w.get('mode')} {w.get('precision')}, "
                                           f"{w.get('schedule')} schedule" for w in ws)))
    st = measured_steps(rec.steps)
    if rec.steps.height:
        rows.append(("Steps", f"{rec.steps.height:,} ({session_tokens(rec.steps):,.0f} tokens)"))
    elif (n := step_count(rec)).table_missing or n.steps:
        rows.append(("Steps", n.note))
    if st.height:
        tps, tf = st["tokens_per_s"].median(), st["tflops"].median()  # None where no step recorded it
        rows.append(("Throughput", ", ".join(x for x in (
            f"median {tps:,.0f} tokens/s" if tps is not None else "", f"{tf:.0f} TFLOP/s" if tf is not None else "")
            if x) or "not recorded"))
    s = rec.samples.filter(pl.col("gpu").is_not_null() & pl.col("gpu_mem_used_bytes").is_not_null())
    if s.height:
        peak = s.select(mem_used_expr()).max().item()
        own = [m for m in gpu_memory(rec).values() if m.own and m.workload and m.limit]
        shared = any(m.whole_peak > m.peak * 1.05 + 2**30 for m in own)
        rows.append(("Peak GPU memory", fmt_bytes(peak) + (" (the whole GPU: every process on it)" if shared else "")))
        if own:  # the rule of the health row and the risk features (recording/frames.py process_memory)
            rows.append(("Workload process memory", "; ".join(
                f"{f'GPU {m.gpu}: ' if len(own) > 1 else ''}peak {fmt_bytes(m.peak)} of its limit {fmt_bytes(m.limit)}"
                for m in own)))
        if s["gpu_power_w"].drop_nulls().len():
            rows.append(("Power", f"mean {s['gpu_power_w'].mean():.0f} W, max {s['gpu_power_w'].max():.0f} W"))
    if en:
        t = f"{en['tokens_per_j']:.1f} tokens/J" if en.get("tokens_per_j") else "no tokens"
        rows.append(("Energy", f"{en['joules'] / 1000:,.1f} kJ over {fmt_duration(en['seconds'])} ({t})"))
    counts = Counter(rec.events["kind"].to_list())
    if counts.get("oom"):
        rows.append(("OOMs", f"{counts['oom']} ({counts.get('oom_recovered', 0)} recovered)"))
    return rows

