"""What a finished workload did, for the headless summary and the CI outputs. No torch here."""

from __future__ import annotations

import statistics
from typing import Any


def summarize(w, bus) -> dict[str, Any]:
    """A data-parallel job's rank 0 (`rank_counts`): `ooms`, `recovered`, `nonfinite` and
    `integrity_failures` are totals over every rank, `ranks` has each rank's own; steps and tokens/s are rank
    0's (each rank runs the same steps)."""
    rank = getattr(w, "rank", None)
    every = [r for r in bus.steps.latest(len(bus.steps)) if r["gpu"] == w.cfg.gpu_index]
    rows = [r for r in every if r.get("rank") in (None, rank)]
    tps = [r["tokens_per_s"] for r in rows]
    out = {"preset": w.cfg.preset, "mode": w.cfg.mode, "device": w.device_name, "state": w.state,
           "gpu": w.cfg.gpu_index, "steps": len(rows), "median_tokens_per_s": statistics.median(tps) if tps else None,
           "ooms": w.ooms, "recovered": w.recovered, "nonfinite": w.nonfinite,
           "integrity_failures": w.integrity_failures, "unrecovered": w.unrecovered,
           "ramp_edges": w.schedule.edges, "sweep": sweep_table(rows) if w.cfg.schedule == "sweep" else None,
           "sweep_oom": w.schedule.oom_levels, "stopped_by_guard": getattr(w, "stopped_by", None),
           "remedies": list(getattr(w, "remedies", []) or [])}
    counts = getattr(w, "rank_counts", None)
    if callable(counts):
        ranks = counts()
        for k in ("ooms", "recovered", "nonfinite", "integrity_failures"):
            out[k] = sum(int(c.get(k) or 0) for c in ranks)
        out["unrecovered"] = out["unrecovered"] or next((f"rank {c['rank']}: {c['unrecovered']}" for c in ranks
                                                         if c.get("unrecovered")), None)
        out["ranks"] = ranks
    return out


def sweep_table(rows: list[dict]) -> list[dict[str, Any]]:
    """Per batch: median latency, tokens/s, TFLOP/s, MFU and peak memory over the measured steps."""
    table = []
    for b in sorted({r["batch"] for r in rows}):
        m = [r for r in rows if r["batch"] == b and "warmup" not in r["phase"]] or [r for r in rows if r["batch"] == b]
        table.append({"batch": b, "seq_len": m[0]["seq_len"], "latency_s": _median(m, "step_time_s"),
                      "tokens_per_s": _median(m, "tokens_per_s"), "tflops": _median(m, "tflops"),
                      "mfu": _median(m, "mfu"),
                      "peak_bytes": max((r["torch_peak_bytes"] or 0) for r in m) or None, "steps": len(m)})
    return table


def _median(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def format_summary(s: dict[str, Any]) -> str:
    tps = f"{s['median_tokens_per_s']:.0f}" if s["median_tokens_per_s"] else "-"
    lines = [f"{s['preset']} {s['mode']} on {s['device']}: {s['state']}, {s['steps']} steps, "
             f"median {tps} tokens/s, {s['ooms']} OOM ({s['recovered']} recovered), "
             f"{s['nonfinite']} non-finite, {s['integrity_failures']} integrity failures"]
    if s.get("ranks"):
        n = len(s["ranks"])
        lines.append(f"  {n} rank{'s' if n > 1 else ''} (the OOM counts above are their total): " + "; ".join(
            f"rank {c['rank']} {c['state']}, {c['steps']} steps, {c['ooms']} OOM ({c['recovered']} recovered), "
            f"{c['lost_steps']} skipped" for c in s["ranks"]))
    if s["unrecovered"]:
        lines.append(f"  UNRECOVERED: {s['unrecovered']}")
    if s.get("stopped_by_guard"):
        lines.append(f"  STOPPED CLEANLY BY THE GUARD before an OOM: {s['stopped_by_guard']}")
    if s.get("remedies"):
        lines.append(f"  allocator remedies: {'; '.join(s['remedies'])}")
    if s["ramp_edges"]:
        e = s["ramp_edges"]
        shown = f"{e}" if len(e) <= 12 else f"{e[:6]} ... {e[-6:]} ({len(e)} OOMs)"
        lines.append(f"  ramp OOM edges (last batch that fit): {shown}")
    if s["sweep"]:
        lines.append("  batch  seq  latency_s  tokens/s  TFLOP/s   MFU  peak_GiB")
        for r in s["sweep"]:
            mfu = f"{r['mfu']:.3f}" if r["mfu"] is not None else "   -"
            peak = f"{r['peak_bytes'] / 2**30:.1f}" if r["peak_bytes"] else "-"
            lines.append(f"  {r['batch']:5d} {r['seq_len']:4d} {r['latency_s']:10.4f} {r['tokens_per_s']:9.0f} "
                         f"{r['tflops']:8.1f} {mfu:>5} {peak:>8}")
        if s["sweep_oom"]:
            lines.append(f"  out of memory at batch {s['sweep_oom']}")
    return "\n".join(lines)
