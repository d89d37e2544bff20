"""From a typed `WorkloadSpec` (what the flags say) to running `Workload`s, one per GPU or one on the
CPU. The front ends build the spec; `runtime.Session` calls `make_workloads`. Imports torch lazily."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpuwatch.errors import UsageError


# Decode: a step is the prompt's prefill and then this many generated tokens. On a GPU 128, so the
# compute-bound prefill of the prompt is a small part of a step (v2-lite, batch 32 x 512 on the H200:
# ~0.3 s of prefill against 16 tokens' ~0.2 s, or 128 tokens' ~1.5 s); on a CPU 16 keeps a step short.
GPU_NEW_TOKENS, CPU_NEW_TOKENS = 128, 16


@dataclass(frozen=True)
class WorkloadSpec:
    """The workload flags of `gpuwatch`/`live`/`stress`, typed. None = the preset's or device's default."""

    preset: str | None = None
    mode: str = "prefill"
    schedule: str = "steady"
    precision: str | None = None
    batch: int | None = None
    seq_len: int | None = None
    max_batch: int | None = None
    device: str = "auto"
    gpus: str | None = None  # "all" or "0,1": one workload per GPU (CUDA ordinals)
    memory_limit_bytes: int | None = None
    leak_mib: float = 0.0
    fragment: bool = False
    fp16_overflow: bool = False
    integrity_every: int = 50
    overrides: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    max_steps: int | None = None
    graphs: str = "auto"
    new_tokens: int | None = None  # decode: tokens generated per step (None: 128 on a GPU, 16 on a CPU)
    tuning: tuple[str, ...] = ()  # speed switches, KEY=VALUE (workload/tuning.py)


def parse_tuning(items) -> dict[str, str]:
    """`("attention=sdpa-flash", "lean=on")` -> checked switches (workload/tuning.py); UsageError naming a bad one."""
    from gpuwatch.workload import tuning

    out = {}
    for item in items:
        k, sep, v = str(item).partition("=")
        if not sep:
            raise UsageError(f"bad --tune {item!r}: use KEY=VALUE, e.g. attention=sdpa-flash")
        out[k.strip()] = v.strip()
    try:
        return tuning.check(out)
    except ValueError as e:
        raise UsageError(f"--tune: {e}") from None


def _devices(spec: WorkloadSpec) -> list:
    import torch

    from gpuwatch.workload.model import resolve_device

    if not spec.gpus:
        return [resolve_device(spec.device)]
    if not torch.cuda.is_available():
        raise UsageError("--gpus: no CUDA GPU is available to torch here")
    n = torch.cuda.device_count()
    try:
        idx = list(range(n)) if spec.gpus == "all" else [int(x) for x in spec.gpus.split(",")]
    except ValueError:
        raise UsageError(f"bad --gpus {spec.gpus!r}: use all or a list like 0,1") from None
    if any(not 0 <= i < n for i in idx):
        raise UsageError(f"--gpus {spec.gpus}: this machine has {n} GPU(s)")
    return [torch.device(f"cuda:{i}") for i in idx]


def cuda_identity(dev) -> dict[str, Any]:
    """The CUDA device's UUID and PCI bus id, to match it to its NVML GPU (CUDA ordinals differ from
    NVML indices under CUDA_VISIBLE_DEVICES and CUDA's default fastest-first order)."""
    import torch

    if dev.type != "cuda":
        return {}
    p = torch.cuda.get_device_properties(dev)
    uuid = str(getattr(p, "uuid", "") or "")
    bus = None
    if all(hasattr(p, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        bus = f"{p.pci_domain_id:08X}:{p.pci_bus_id:02X}:{p.pci_device_id:02X}.0"
    return {"uuid": ("GPU-" + uuid) if uuid and not uuid.startswith("GPU-") else uuid or None, "pci_bus_id": bus}


def _check_memory(cfg, fields: dict[str, Any], dev) -> None:
    """Refuse a workload that cannot take one step on `dev` (workload/sizing.py): its weights, a train
    step's gradients and the first step's activations against the host's available RAM (a CPU: running
    out there may be the kernel's OOM killer, not an exception) or, on a GPU, the weights and gradients
    and batch 1's activations against its usable memory (a larger batch that runs out is a CUDA OOM the
    workload recovers from: the point of a stress run, so it is not refused)."""
    from gpuwatch.workload import sizing
    from gpuwatch.workload.presets import defaults
    from gpuwatch.workload.schedule import Schedule

    b, s = defaults(cfg.preset)
    first = Schedule(cfg.schedule, cfg.batch or b, cfg.seq_len or s, cfg.max_batch, long_seq=cfg.long_seq).plan()
    batch, seq = (first[0], first[1]) if first else (cfg.batch or b, cfg.seq_len or s)
    if dev.type == "cuda":
        batch = 1
    est = sizing.estimate(fields, cfg.mode, cfg.precision, batch, seq, cfg.decode_tokens if cfg.mode == "decode" else 0)
    sizing.check_fits(est, sizing.available_bytes(dev, cfg.faults.memory_limit_bytes), cfg.preset, cfg.mode,
                      cfg.precision, str(dev))


def make_workloads(spec: WorkloadSpec, bus, nvml_index=None) -> list:
    """One Workload per requested device. `nvml_index(identity) -> int | None` maps a CUDA device
    (its uuid / pci_bus_id) to the NVML index its telemetry rows carry; without it, the CUDA ordinal."""
    import torch

    from gpuwatch.workload import presets
    from gpuwatch.workload.runner import Faults, Workload, WorkloadConfig

    validate = getattr(presets, "validate_overrides", dict)
    overrides = validate(dict(spec.overrides))
    tuned = parse_tuning(spec.tuning)
    choose_preset = presets.choose_preset
    if spec.max_batch and spec.batch and spec.max_batch < spec.batch:
        raise UsageError("--max-batch must be >= --batch")
    out = []
    for dev in _devices(spec):
        mem = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else None
        lim = spec.memory_limit_bytes
        if lim and dev.type != "cuda":  # was accepted silently, and did nothing
            raise UsageError(f"--gpu-memory-limit caps a CUDA GPU's memory; this workload runs on {dev} "
                             "(drop the flag, or run on a GPU)")
        if lim and mem and lim > mem:
            raise UsageError(f"--gpu-memory-limit {lim / 2**30:.1f} GiB is more than {dev}'s "
                             f"{mem / 2**30:.1f} GiB: it would limit nothing")
        ident = cuda_identity(dev)
        index = nvml_index(ident) if nvml_index and dev.type == "cuda" else None
        if index is None and dev.type == "cuda":
            index = dev.index
        cfg = WorkloadConfig(
            preset=spec.preset or choose_preset(mem, overrides), mode=spec.mode, schedule=spec.schedule,
            precision=spec.precision or ("bf16" if dev.type == "cuda" else "fp32"), batch=spec.batch,
            seq_len=spec.seq_len, max_batch=spec.max_batch, device=str(dev), gpu_index=index,
            overrides=overrides, faults=Faults(spec.leak_mib, spec.fragment, spec.fp16_overflow, spec.memory_limit_bytes),
            integrity_every=spec.integrity_every, seed=spec.seed, max_steps=spec.max_steps,
            gpu_uuid=ident.get("uuid"), gpu_pci_bus_id=ident.get("pci_bus_id"), graphs=spec.graphs,
            decode_tokens=spec.new_tokens or (GPU_NEW_TOKENS if dev.type == "cuda" else CPU_NEW_TOKENS), tuning=tuned)
        fields = presets.config_fields(cfg.preset, overrides)
        presets.check_config(fields, overrides, cfg.preset)  # before building: torch's errors come late
        _check_memory(cfg, fields, dev)
        if cfg.mode == "decode":
            from gpuwatch.workload.presets import config_fields, defaults

            longest = (cfg.seq_len or defaults(cfg.preset)[1]) + cfg.decode_tokens
            limit = config_fields(cfg.preset, overrides).get("max_position_embeddings")
            if limit and longest > limit:
                raise UsageError(f"prompt + new tokens = {longest} is longer than {cfg.preset}'s "
                                 f"max_position_embeddings ({limit}); lower --seq-len or --new-tokens")
        try:
            out.append(Workload(bus, cfg))
        except (TypeError, ValueError) as e:
            raise UsageError(f"bad model config: {e}") from None
    return out
