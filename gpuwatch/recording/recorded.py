"""What a recorded session's meta.json and tables say, read the same way by every reader above the
recording layer (replay, the live demo's feed, the scorer, counterfactual caps, the UI): its sampling
interval, its workloads' memory caps, the plan of each step (filled in for schema v1 sessions), an
event's detail, and rows in time order."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import polars as pl

from gpuwatch.recording import schema

__all__ = ["StepCount", "event_detail", "fill_plans", "recorded_caps", "recorded_interval", "recorded_steps",
           "sorted_by_time"]


def recorded_interval(meta: dict[str, Any]) -> float:
    """The sampling interval a session was recorded with (meta's config), 0.1 s if it does not say."""
    v = (meta.get("config") or {}).get("interval_s") if isinstance(meta.get("config"), dict) else None
    return float(v) if isinstance(v, (int, float)) and v > 0 else 0.1


def recorded_caps(meta: dict[str, Any]) -> dict[int | None, int]:
    """Each GPU's workload memory cap (--gpu-memory-limit) as the session's meta.json records it."""
    cfg = c if isinstance(c := meta.get("config"), dict) else {}
    out: dict[int | None, int] = {}
    for w in cfg.get("workloads") or []:
        if not isinstance(w, dict):
            continue
        cap = (w.get("faults") or {}).get("memory_limit_bytes") if isinstance(w.get("faults"), dict) else None
        if cap:
            out[workload_gpu(w)] = int(cap)
    return out


def workload_gpu(w: dict[str, Any]) -> int | None:
    """The GPU a meta.json workload entry ran on: its `gpu_index`, else (older sessions) its device's."""
    dev = str(w.get("device") or "")
    return w.get("gpu_index", int(dev.split(":")[1]) if dev.startswith("cuda:") else 0 if dev == "cuda" else None)


def recorded_workload(meta: dict[str, Any], gpu: int | None) -> dict[str, Any] | None:
    """The meta.json description of the workload that ran on `gpu`, if one did."""
    loads = (meta.get("config") or {}).get("workloads") if isinstance(meta.get("config"), dict) else None
    return next((w for w in loads or [] if isinstance(w, dict) and workload_gpu(w) == gpu), None)


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


def recovered_plan(detail: dict[str, Any]) -> dict[str, Any] | None:
    """The next step an `oom_recovered` event's detail recorded (batch, seq_len, precision), or None where
    it recorded none or a corrupt one."""
    nb, ns = detail.get("next_batch"), detail.get("next_seq_len")
    if isinstance(nb, (int, float)) and isinstance(ns, (int, float)) and nb > 0 and ns > 0:
        return {"batch": nb, "seq_len": ns, "precision": detail.get("next_precision")}
    return None


def first_plan(steps: pl.DataFrame, events: pl.DataFrame, end_us: int) -> dict[str, Any] | None:
    """Before a GPU's first step row, the step its workload was about to run at `end_us` (a replay has no
    live plan to ask): after an OOM of a first step, the plan its `oom_recovered` event recorded (None
    between the two); before any OOM, the first shape attempted - an OOM event's, else the first row's
    micro-batch. None once a step row exists at `end_us`, where nothing was attempted, and before the
    session started (its `session_start` or `workload_start` event: live, the scorer asks the workload for
    its plan from then on; the sampler's first seconds before it are no moment anyone could act in).
    `steps` and `events`: the whole session's, of this GPU (and its GPU-less events)."""
    first_us = int(steps["ts"].dt.epoch("us")[0]) if steps.height else None
    if first_us is not None and first_us <= end_us or not events.height:
        return None
    started = events.filter(pl.col("kind").is_in(["session_start", "workload_start"]))["ts"].dt.epoch("us")
    if not started.len() or int(cast(int, started.min())) > end_us:
        return None
    ev = events.filter(pl.col("kind").is_in(["oom", "oom_recovered"]))
    rows = [(int(t), k, event_detail({"detail": d})) for t, k, d in
            zip(ev["ts"].dt.epoch("us").to_list(), ev["kind"].to_list(), ev["detail"].to_list())] if ev.height else []
    rows = [r for r in rows if first_us is None or r[0] < first_us]
    ooms = [r for r in rows if r[1] == "oom"]
    before = [r for r in ooms if r[0] <= end_us]
    if before:
        rec = [r for r in rows if r[1] == "oom_recovered" and before[-1][0] <= r[0] <= end_us]
        plan = recovered_plan(rec[0][2]) if rec else None
        if plan is not None:
            plan["precision"] = plan["precision"] or before[-1][2].get("precision")
        return plan
    if ooms:
        d = ooms[0][2]
        if isinstance(d.get("batch"), (int, float)) and isinstance(d.get("seq_len"), (int, float)):
            return {"batch": d["batch"], "seq_len": d["seq_len"], "precision": d.get("precision")}
        return None
    if first_us is None:
        return None
    r = steps.row(0, named=True)
    micro = max(1, int(r.get("micro_batches") or 1))
    if not r.get("batch") or not r.get("seq_len"):
        return None
    return {"batch": -(-int(r["batch"]) // micro), "seq_len": r["seq_len"], "precision": r.get("precision")}


def sorted_by_time(df: pl.DataFrame) -> pl.DataFrame:
    """Sort by time unless it already is (a compacted or appended recording usually is: O(n) check)."""
    return df if df["ts"].is_sorted() else df.sort("ts", maintain_order=True)


def event_detail(row: dict[str, Any]) -> dict[str, Any]:
    try:
        return json.loads(row.get("detail") or "{}")
    except ValueError:
        return {}


def recorded_pid(meta: dict[str, Any], gpu: int) -> int | None:
    """The recording process's PID where a workload of that process ran on `gpu` (meta.json `pid`)."""
    pid = meta.get("pid")
    loads = (meta.get("config") or {}).get("workloads") or []
    if not isinstance(pid, int) or not any(isinstance(w, dict) and w.get("gpu_index") == gpu for w in loads):
        return None
    return pid


@dataclass(frozen=True)
class StepCount:
    """How many workload steps a session ran, and where that is known from: its steps table, else the
    workloads' `workload_stop` events ("workload finished after 2768 steps"). The report, `stress
    --resume`'s summaries and the replay's status line say the same with it."""

    steps: int | None  # steps the session's workloads ran; None where nothing recorded says
    rows: int  # step rows read from the steps table
    source: str  # "steps table", "workload_stop events" or "none"
    table_missing: bool  # a session with a workload whose folder holds no steps table file at all

    @property
    def note(self) -> str:
        """One line: '2,768 steps', '2,768 steps (from the workload_stop events: steps.parquet is missing)',
        'no workload steps in this session', ..."""
        if self.source == "steps table":
            return f"{self.rows:,} steps"
        if self.table_missing:
            if self.steps is not None:
                return f"{self.steps:,} steps (from the workload_stop events: {STEPS_FILE} is missing)"
            return f"{STEPS_FILE} is missing, and no workload_stop event says how many steps ran"
        if self.steps:
            return f"{self.steps:,} steps (from the workload_stop events: the steps table has no rows)"
        return "no workload steps in this session"

    @property
    def status(self) -> str:
        """The replay's status word for the workload: 'recorded' where steps can be replayed, else why not."""
        if self.source == "steps table":
            return "recorded"
        return f"steps not recorded: {self.note}" if self.table_missing or self.steps else "no workload"


STEPS_FILE = "steps.parquet"
_AFTER = re.compile(r"after (\d+) steps?\b")
_RANK = re.compile(r"^rank (\d+):")


def stop_counts(events: pl.DataFrame) -> dict[tuple[Any, Any], int]:
    """Per (GPU, rank): the step count of its last `workload_stop` event (a resumed session's count goes
    on from the earlier parts, so the last one is the whole session's)."""
    if events.is_empty():
        return {}
    out: dict[tuple[Any, Any], int] = {}
    stops = events.filter(pl.col("kind") == "workload_stop").sort("ts", maintain_order=True)
    for gpu, msg, detail in zip(stops["gpu"].to_list(), stops["message"].to_list(), stops["detail"].to_list()):
        m = _AFTER.search(str(msg or ""))
        if not m:
            continue
        rank = event_detail({"detail": detail}).get("rank")
        if rank is None and (r := _RANK.match(str(msg or ""))):
            rank = int(r.group(1))
        out[(gpu, rank)] = int(m.group(1))
    return out


def recorded_steps(folder: Path | str | None, meta: dict[str, Any], steps: pl.DataFrame,
                   events: pl.DataFrame) -> StepCount:
    """How many steps the session at `folder` ran (its meta.json, steps and events tables as read). The
    public seam for anything that says so: the report, and replay's status (SessionReader: its path and
    meta; ReplaySource: steps_df, events_df)."""
    from gpuwatch.recording.layout import table_files

    counts = stop_counts(events)
    from_events = sum(counts.values()) if counts else None
    ran_workload = bool((meta.get("config") or {}).get("workloads")) if isinstance(meta.get("config"), dict) else False
    ran_workload = ran_workload or (not events.is_empty() and events.filter(
        pl.col("kind").is_in(["workload_start", "workload_stop"])).height > 0)
    missing = False
    if folder is not None and Path(folder).is_dir() and ran_workload:
        try:
            missing = not table_files(folder, "steps")
        except OSError:
            missing = False
    if steps.height:
        return StepCount(steps.height, steps.height, "steps table", missing)
    if from_events is not None:
        return StepCount(from_events, 0, "workload_stop events", missing)
    return StepCount(None if missing else 0, 0, "none", missing)
