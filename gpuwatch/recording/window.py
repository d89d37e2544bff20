"""What a source hands the scorer: one GPU's window of telemetry (`Window`) and what is known of the GPU and
its workload (`GpuMeta`) - the same live, in replay, in follow and over a recording in training."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl


@dataclass(frozen=True)
class GpuMeta:
    index: int
    name: str
    mem_total_bytes: int | None = None
    power_limit_w: float | None = None
    temp_slowdown_c: int | None = None
    mem_limit_bytes: int | None = None  # a workload's --gpu-memory-limit on this GPU (NVML does not know it)
    pid: int | None = None  # the process whose workload runs on this GPU: its own memory is in gpu_procs
    # that workload's description (meta.json's config.workloads entry; not part of the GPU's identity)
    workload: dict[str, Any] | None = field(default=None, hash=False, compare=False)

    @property
    def effective_limit_bytes(self) -> int | None:
        """What an OOM is measured against: the workload's cap where one is set, else the card."""
        caps = [v for v in (self.mem_total_bytes, self.mem_limit_bytes) if v]
        return min(caps) if caps else None


@dataclass(frozen=True)
class Window:
    """The last `seconds` of one GPU, identical live, in replay, in follow and over a recording in
    training: samples in the samples schema (this GPU's rows, `ts` as Datetime(us, UTC), time order),
    the GPU's last steps (steps schema) and its recent events (events schema; GPU-less events too)."""

    gpu: int | None
    end_us: int  # the moment the window is taken at (the cursor); rows are at or before it
    interval_s: float  # the sampling interval the session was recorded with
    samples: pl.DataFrame
    steps: pl.DataFrame
    events: pl.DataFrame
    meta: GpuMeta | None = None
    # the workload process's own memory per sample row and whether the row listed processes
    # (frames.own_used), where the source computed it once for the whole recording; else None
    own: tuple[np.ndarray, np.ndarray] | None = None
    # replay, before the GPU's first step row: the step the workload was about to run (recorded.first_plan);
    # live, the workload says it (the scorer's plan)
    first_plan: dict[str, Any] | None = None


WINDOW_S = 30.0  # the default window: the feature function looks back this far
WINDOW_STEPS = 64
WINDOW_EVENTS_S = 600.0
