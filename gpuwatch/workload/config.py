"""What a workload runs: its preset, mode, schedule, precision and shape, and the faults it injects
(the stress command's flags, recorded in meta.json by `Workload.describe`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Faults:
    leak_mib: float = 0.0  # keep this much device memory per step
    fragment: bool = False  # random sequence lengths (1/4..1 of the set length)
    fp16_overflow: bool = False  # scale embeddings so fp16 overflows
    memory_limit_bytes: int | None = None  # behave like a smaller card
    oom_above_tokens: int | None = None  # tests/CPU dry runs: a (micro-)batch over this many tokens raises OOM


@dataclass
class WorkloadConfig:
    preset: str = "tiny"
    mode: str = "prefill"
    schedule: str = "steady"
    precision: str = "fp32"
    batch: int | None = None
    seq_len: int | None = None
    max_batch: int | None = None
    device: str = "cpu"
    gpu_index: int | None = None  # the NVML index this workload runs on (for step rows)
    overrides: dict[str, Any] = field(default_factory=dict)
    faults: Faults = field(default_factory=Faults)
    integrity_every: int = 50
    decode_tokens: int = 16
    long_seq: int = 8192  # the sequence length of the `long` schedule
    seed: int = 0
    max_steps: int | None = None
    gpu_uuid: str | None = None  # how this workload was matched to its NVML GPU
    gpu_pci_bus_id: str | None = None
    accumulate: bool = True  # train: a ceiling below the schedule's batch -> gradient accumulation
    graphs: str = "auto"  # static KV cache + CUDA graphs: auto = decode only, on = decode and prefill, off
    tuning: dict[str, str] = field(default_factory=dict)  # speed switches (workload/tuning.py), e.g. {"attention": "sdpa-flash"}
