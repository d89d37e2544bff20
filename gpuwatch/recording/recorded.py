"""What a recorded session's meta.json and tables say, read the same way by every reader above the
recording layer (replay, the live demo's feed, the scorer, counterfactual caps, the UI): its sampling
interval, its workloads' memory caps, the plan of each step (filled in for schema v1 sessions), an
event's detail, and rows in time order."""

from __future__ import annotations

import json
from typing import Any

import polars as pl

from gpuwatch.recording import schema

__all__ = ["event_detail", "fill_plans", "recorded_caps", "recorded_interval", "sorted_by_time"]


def recorded_interval(meta: dict[str, Any]) -> float:
    """The sampling interval a session was recorded with (meta's config), 0.1 s if it does not say."""
    v = (meta.get("config") or {}).get("interval_s") if isinstance(meta.get("config"), dict) else None
    return float(v) if isinstance(v, (int, float)) and v > 0 else 0.1


def recorded_caps(meta: dict[str, Any]) -> dict[int | None, int]:
    """Each GPU's workload memory cap (--gpu-memory-limit) as the session's meta.json records it."""
    cfg = meta.get("config") if isinstance(meta.get("config"), dict) else {}
    out: dict[int | None, int] = {}
    for w in cfg.get("workloads") or []:
        if not isinstance(w, dict):
            continue
        cap = (w.get("faults") or {}).get("memory_limit_bytes") if isinstance(w.get("faults"), dict) else None
        dev = str(w.get("device") or "")
        gpu = w.get("gpu_index", int(dev.split(":")[1]) if dev.startswith("cuda:") else 0 if dev == "cuda" else None)
        if cap:
            out[gpu] = int(cap)
    return out


def fill_plans(steps: pl.DataFrame, events: pl.DataFrame) -> pl.DataFrame:
    """Sessions recorded before the plan columns existed (schema v1): each step's plan for its next
    step is what ran next on that GPU - the next step row, or the OOM event's batch/seq_len/precision
    when an OOM came first. Rows that already carry a plan are left as they are."""
    if steps.is_empty() or steps["next_batch"].null_count() == 0:
        return steps
    ooms = events.filter(pl.col("kind") == "oom")
    nxt = []
    if not ooms.is_empty():
        d = [event_detail(r) for r in ooms.select("detail").to_dicts()]
        nxt.append(pl.DataFrame({"ts": ooms["ts"], "gpu": ooms["gpu"],
                                 "batch": [x.get("batch") for x in d], "seq_len": [x.get("seq_len") for x in d],
                                 "precision": [x.get("precision") for x in d]},
                                schema={"ts": schema.TS, "gpu": pl.UInt8, "batch": pl.UInt32, "seq_len": pl.UInt32,
                                        "precision": pl.String}))
    attempts = pl.concat([steps.select("ts", "gpu", "batch", "seq_len", "precision"), *nxt], how="vertical_relaxed")
    attempts = attempts.sort("ts").with_columns(
        pl.col("batch").shift(-1).over("gpu").alias("_nb"), pl.col("seq_len").shift(-1).over("gpu").alias("_ns"),
        pl.col("precision").shift(-1).over("gpu").alias("_np"))
    joined = steps.join(attempts.select("ts", "gpu", "_nb", "_ns", "_np"), on=["ts", "gpu"], how="left",
                        nulls_equal=True, maintain_order="left")
    return joined.with_columns(
        pl.coalesce("next_batch", "_nb").cast(pl.UInt32).alias("next_batch"),
        pl.coalesce("next_seq_len", "_ns").cast(pl.UInt32).alias("next_seq_len"),
        pl.coalesce("next_precision", "_np").alias("next_precision")).drop("_nb", "_ns", "_np")


def sorted_by_time(df: pl.DataFrame) -> pl.DataFrame:
    """Sort by time unless it already is (a compacted or appended recording usually is: O(n) check)."""
    return df if df["ts"].is_sorted() else df.sort("ts", maintain_order=True)


def event_detail(row: dict[str, Any]) -> dict[str, Any]:
    try:
        return json.loads(row.get("detail") or "{}")
    except ValueError:
        return {}
