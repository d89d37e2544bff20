"""Issue 19's GPU figures from two recorded sessions (benchmarks/gpu.sh multigpu): v2-lite data-parallel
training scaling (the 2-rank job's tokens/s, summed over ranks, against one GPU's, same batch per GPU;
target >= 1.9x) and the all-reduce bus bandwidth at the largest size of the collective check (target >=
80 % of the interconnect's specified per-direction peak, 450 GB/s for NVLink 4). With `--fsdp SESSION`
(the v3-slice `--dp fsdp` run): its engine, the steps each rank completed, the parameter bytes each rank
held and its peak memory; `fsdp_ok` when every rank completed a step with no unrecovered failure. Prints
one JSON object.

    python benchmarks/multigpu_check.py ONE_GPU_SESSION TWO_RANK_SESSION [--warmup 5] [--fsdp SESSION]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import polars as pl

from gpuwatch.recording.ranks import collectives, rank_stats, straggler
from gpuwatch.recording.reader import open_recording

SCALING_TARGET, BUSBW_TARGET = 1.9, 0.8


def _session(path: Path) -> Path:
    if (path / "meta.json").exists():
        return path
    found = sorted(p for p in path.iterdir() if (p / "meta.json").exists())
    if not found:
        raise SystemExit(f"multigpu_check: no session under {path}")
    return found[-1]


def _tps(steps: pl.DataFrame, warmup: int) -> float | None:
    rows = steps.sort("step").filter(pl.col("step") >= warmup)["tokens_per_s"].drop_nulls().to_list()
    return statistics.median(rows) if rows else None


def _fsdp(path: Path) -> dict:
    """What the FSDP run did, rank by rank."""
    try:
        rec = open_recording(_session(path))
    except (SystemExit, OSError) as e:
        return {"ok": False, "error": str(e)}
    meta = json.loads((rec.path / "meta.json").read_text())
    dist = ((meta.get("config") or {}).get("workloads") or [{}])[0].get("distributed") or {}
    ev = rec.events
    held = {d["rank"]: {"param_bytes_here": d.get("param_bytes_here"), "param_bytes_full": d.get("param_bytes_full")}
            for d in map(json.loads, ev.filter(pl.col("kind") == "dp_engine")["detail"])}
    steps = rec.steps.filter(pl.col("rank").is_not_null())
    ranks = {}
    for (k,), g in steps.group_by("rank"):
        ranks[int(k)] = {"steps": g.height, "peak_bytes_max": g["torch_peak_bytes"].max(),
                         "tokens_per_s_p50": g["tokens_per_s"].median(), "batch_last": g.sort("step")["batch"][-1],
                         **held.get(int(k), {})}
    errors = ev.filter(pl.col("kind").is_in(["workload_error", "oom"]))["message"].to_list()
    return {"engine": dist.get("engine"), "dp": dist.get("dp"), "ranks": ranks, "failures": errors[:5],
            "ok": len(ranks) >= 2 and all(r["steps"] > 0 for r in ranks.values())
            and not ev.filter(pl.col("kind") == "workload_error").height,
            "session": str(rec.path)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("one", type=Path)
    ap.add_argument("two", type=Path)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out at the start of each rank")
    ap.add_argument("--fsdp", type=Path, help="the v3-slice --dp fsdp session (or its output folder)")
    a = ap.parse_args(argv)
    one, two = open_recording(_session(a.one)), open_recording(_session(a.two))
    single = _tps(one.steps, a.warmup)
    per_rank = {int(k): _tps(g, a.warmup) for (k,), g in two.steps.filter(pl.col("rank").is_not_null())
                .group_by("rank")}
    total = sum(v for v in per_rank.values() if v) if per_rank else None
    scaling = total / single if total and single else None
    stats = rank_stats(two.steps.sort("ts").to_dicts(), last=10**9)
    slow = straggler(stats)
    ar = next((c for c in collectives(two.events.to_dicts()) if c["op"] == "all_reduce"), None)
    frac = ar.get("fraction_of_peak") if ar else None
    out = {
        "one_gpu_tokens_per_s": single, "ranks_tokens_per_s": per_rank, "two_gpu_tokens_per_s": total,
        "scaling": scaling, "scaling_target": SCALING_TARGET,
        "scaling_ok": scaling is not None and scaling >= SCALING_TARGET,
        "comm_time_s_p50": {s.rank: s.comm_s for s in stats}, "comm_bytes_per_step": {s.rank: s.comm_bytes for s in stats},
        "straggler": {"rank": slow.rank, "step_s": slow.step_s, "median_s": slow.median_s} if slow else None,
        "allreduce_bytes": ar.get("max_bytes") if ar else None,
        "allreduce_busbw_gbps": ar.get("busbw_at_max_gbps") if ar else None,
        "peak_gbps": ar.get("peak_gbps") if ar else None, "peak_basis": ar.get("peak_basis") if ar else None,
        "busbw_fraction_of_peak": frac, "busbw_target": BUSBW_TARGET,
        "busbw_ok": frac is not None and frac >= BUSBW_TARGET,
        "collectives": {c["op"]: c["rows"] for c in collectives(two.events.to_dicts())},
        "sessions": [str(one.path), str(two.path)],
    }
    if a.fsdp is not None:
        out["fsdp"] = _fsdp(a.fsdp)
    print(json.dumps(out, indent=1, default=str))
    return 0 if out["scaling_ok"] and out["busbw_ok"] and out.get("fsdp", {}).get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
