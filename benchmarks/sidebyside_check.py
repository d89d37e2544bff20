"""Does a workload recorded beside others on one GPU record the same memory as when it runs alone?

    python3 benchmarks/sidebyside_check.py SHARED_SESSION ALONE_SESSION

Compares, per (batch, sequence length) shape, the per-step torch figures (peak, allocated, reserved)
and, per sample, the memory the feature function measures (the process's own, against its cap) of two
sessions of the same command: one recorded side by side with other capped workloads, one alone.
Prints one JSON object."""

from __future__ import annotations

import json
import sys

import numpy as np
import polars as pl

from gpuwatch.predict.features import features
from gpuwatch.recording.source import ReplaySource


def summary(path: str) -> dict:
    src = ReplaySource(path)
    g = src.gpus[0].index
    st = src.steps_df.filter(pl.col("gpu") == g)
    shapes = st.group_by(["batch", "seq_len"]).agg(
        pl.len().alias("steps"), pl.col("torch_peak_bytes").median().alias("peak"),
        pl.col("torch_allocated_bytes").median().alias("allocated"),
        pl.col("torch_reserved_bytes").median().alias("reserved")).sort("batch")
    ts = src.times(g)
    fr = np.array([features(src.window_at(g, int(t)))["mem_used_frac"] for t in ts[len(ts) // 4::25]])
    procs = pl.read_parquet(f"{path}/samples.parquet", columns=["gpu_procs"])["gpu_procs"].drop_nulls()
    others = max((len(p) for p in procs.to_list()), default=0)
    return {"session": path, "cap_bytes": src.gpus[0].mem_limit_bytes, "pid_known": src.gpus[0].pid is not None,
            "max_processes_on_gpu": others, "shapes": shapes.to_dicts(),
            "mem_used_frac_median": float(np.nanmedian(fr)), "mem_used_frac_p95": float(np.nanpercentile(fr, 95))}


def main() -> int:
    shared, alone = summary(sys.argv[1]), summary(sys.argv[2])
    common = {(r["batch"], r["seq_len"]): r for r in alone["shapes"]}
    diffs = []
    for r in shared["shapes"]:
        a = common.get((r["batch"], r["seq_len"]))
        if a:
            diffs.append({"batch": r["batch"], "seq_len": r["seq_len"],
                          **{k: (r[k] - a[k]) / a[k] if a[k] else None for k in ("peak", "allocated", "reserved")}})
    print(json.dumps({"shared": shared, "alone": alone, "relative_difference_by_shape": diffs}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
