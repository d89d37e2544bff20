"""The versioned recording schema: every column, its polars type and its unit.

Units are in the names (`_bytes`, `_w`, `_c`, `_mhz`, `_pct`, `_us`, `_s`). Missing is null, never a
sentinel. docs/SCHEMA.md documents the same columns; tests check that the two agree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import polars as pl

if TYPE_CHECKING:
    from polars._typing import PolarsDataType  # a class (pl.UInt8) or an instance (pl.List(...)): both are dtypes

SCHEMA_VERSION = 7
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, 7)  # older sessions read with the newer columns null (see docs/SCHEMA.md)

TS = pl.Datetime("us", "UTC")
# A process on a GPU. pid and used_bytes come with every tick (NVML's compute-apps); the rest is added once a
# second by the sampler (NVML's per-process utilization, psutil's user and command line) and is null in
# sessions recorded before it (they read unchanged: a struct casts by field name).
PROC = pl.List(pl.Struct({"pid": pl.UInt32, "used_bytes": pl.UInt64, "sm_util_pct": pl.UInt8,
                          "mem_util_pct": pl.UInt8, "user": pl.String, "command": pl.String}))

# One row per (tick, GPU); a machine with no GPU writes one row per tick with gpu = null.
SAMPLES: dict[str, PolarsDataType] = {
    "ts": TS,
    "tick": pl.UInt32,
    "gpu": pl.UInt8,
    "gpu_util_pct": pl.UInt8,
    "gpu_mem_util_pct": pl.UInt8,
    "gpu_mem_used_bytes": pl.UInt64,
    "gpu_mem_reserved_bytes": pl.UInt64,
    "gpu_mem_total_bytes": pl.UInt64,
    "gpu_temp_c": pl.Int16,
    "gpu_temp_slowdown_c": pl.Int16,
    "gpu_power_w": pl.Float32,
    "gpu_power_limit_w": pl.Float32,
    "gpu_sm_clock_mhz": pl.UInt16,
    "gpu_mem_clock_mhz": pl.UInt16,
    "gpu_clocks_event_reasons": pl.UInt64,
    "gpu_ecc_corrected": pl.UInt64,
    "gpu_ecc_uncorrected": pl.UInt64,
    "gpu_energy_mj": pl.UInt64,
    "gpu_pcie_tx_bytes_per_s": pl.UInt64,
    "gpu_pcie_rx_bytes_per_s": pl.UInt64,
    "gpu_procs": PROC,
    "host_cpu_pct": pl.Float32,
    "host_cpu_per_core_pct": pl.List(pl.UInt8),
    "host_load1": pl.Float32,
    "host_mem_used_bytes": pl.UInt64,
    "host_mem_total_bytes": pl.UInt64,
    "host_swap_used_bytes": pl.UInt64,
    "proc_rss_bytes": pl.UInt64,
    "proc_cpu_pct": pl.Float32,
    "sampler_interval_us": pl.Int32,
    "sampler_cost_us": pl.Int32,
    "sampler_cpu_us": pl.Int32,
}

# One row per workload step.
STEPS: dict[str, PolarsDataType] = {
    "ts": TS,
    "step": pl.UInt32,
    "gpu": pl.UInt8,
    "mode": pl.String,
    "phase": pl.String,
    "precision": pl.String,
    "batch": pl.UInt32,
    "seq_len": pl.UInt32,
    "step_time_s": pl.Float64,
    "tokens_per_s": pl.Float64,
    "tflops": pl.Float64,
    "mfu": pl.Float64,
    "loss": pl.Float32,
    "max_abs_logit": pl.Float32,
    "torch_allocated_bytes": pl.UInt64,
    "torch_reserved_bytes": pl.UInt64,
    "torch_peak_bytes": pl.UInt64,
    "expert_impl": pl.String,
    "micro_batches": pl.UInt16,
    "next_batch": pl.UInt32,
    "next_seq_len": pl.UInt32,
    "next_precision": pl.String,
    # v3: data-parallel runs (torchrun): which rank ran the step, of how many, and its gradient all-reduce
    "rank": pl.UInt16,
    "world_size": pl.UInt16,
    "comm_time_s": pl.Float64,
    "comm_bytes": pl.UInt64,
    # v4: the largest step the workload plans within the lookahead (predict/ahead.py), steps ahead (1 = next)
    "ahead_batch": pl.UInt32,
    "ahead_seq_len": pl.UInt32,
    "ahead_steps": pl.UInt16,
    # v5: activation (gradient) checkpointing on during the step (null: not known, read as off)
    "checkpointing": pl.Boolean,
    # v6: torch's inactive split blocks after the step: cached memory free inside segments partly in use
    "torch_inactive_split_bytes": pl.UInt64,
    # v7: the allocator's largest free block and largest segment after the step (large pool, default pool;
    # read at most every 0.5 s: null on the steps between)
    "torch_largest_free_bytes": pl.UInt64,
    "torch_largest_segment_bytes": pl.UInt64,
}

# One row per (scoring, GPU): the failure risk that was live at that moment (v2).
RISK: dict[str, PolarsDataType] = {
    "ts": TS,
    "gpu": pl.UInt8,
    "kind": pl.String,
    "risk": pl.Float32,
    "alarm": pl.Boolean,
    "threshold": pl.Float32,
    "model": pl.String,
    "reasons": pl.String,
}

# Events: the labels for training and the markers in replay. `detail` is a JSON object as text.
EVENTS: dict[str, PolarsDataType] = {
    "ts": TS,
    "kind": pl.String,
    "severity": pl.String,
    "gpu": pl.UInt8,
    "message": pl.String,
    "detail": pl.String,
}

TABLES: dict[str, dict[str, PolarsDataType]] = {"samples": SAMPLES, "steps": STEPS, "events": EVENTS, "risk": RISK}
TABLE_RE = "|".join(TABLES)  # for file-name patterns

EVENT_KINDS = (
    "session_start", "session_end", "no_gpu", "gpu_lost", "xid", "oom", "oom_recovered", "nonfinite",
    "integrity_mismatch", "throttle_onset", "throttle_end", "guard_action", "control", "mark",
    "phase", "recorder_error", "workload_error", "workload_start", "workload_stop", "sla_breach",
    "risk_alarm", "risk_clear", "guard_override", "guard_miss", "memory_snapshot", "compile",
    "recorder_resumed", "sampler_error", "session_resumed", "detached", "guard_unable", "guard_remedy",
    "collective", "dp_engine", "control_refused", "deadline", "guard_plan",
)


def empty(table: str) -> pl.DataFrame:
    return pl.DataFrame(schema=TABLES[table])


def conform(df: pl.DataFrame, table: str) -> pl.DataFrame:
    """Cast `df` to the table's schema; missing columns become null (a newer writer adding columns)."""
    schema = TABLES[table]
    cols = []
    for name, dtype in schema.items():
        if name in df.columns:
            cols.append(pl.col(name).cast(dtype, strict=False))
        else:
            cols.append(pl.lit(None, dtype=dtype).alias(name))
    return df.select(cols)


# The column that says which table a file holds (a file named for one table but holding another is refused).
KEY_COLUMN = {"samples": "tick", "steps": "step", "events": "kind", "risk": "risk"}


def check_schema(schema: pl.Schema | dict, table: str) -> list[str]:
    """Problems with a file's schema against `table`: missing columns or incompatible types."""
    want = TABLES[table]
    problems = []
    for name in ("ts", KEY_COLUMN[table]):
        if name not in schema:
            problems.append(f"missing column {name!r}")
    for name, dtype in schema.items():
        if name in want and not _compatible(dtype, want[name]):
            if name == "ts" and isinstance(dtype, pl.Datetime):
                continue
            problems.append(f"column {name!r} is {dtype}, expected {want[name]}")
    return problems


def _compatible(have: PolarsDataType, want: PolarsDataType) -> bool:
    """Whether `conform` can read a column of type `have` as `want`: the same type, numbers as numbers,
    lists of compatible items, and structs whose fields are ours (fewer fields: an older session's)."""
    if have == want or (have.is_numeric() and want.is_numeric()):
        return True
    if isinstance(have, pl.List) and isinstance(want, pl.List):
        return _compatible(have.inner, want.inner)
    if isinstance(have, pl.Struct) and isinstance(want, pl.Struct):
        fields = {f.name: f.dtype for f in want.fields}
        return all(f.name in fields and _compatible(f.dtype, fields[f.name]) for f in have.fields)
    return False
