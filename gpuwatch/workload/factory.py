"""`gpuwatch stress` and the workload half of the live dashboard: from parsed flags to Workloads."""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

from gpuwatch.errors import UsageError
from gpuwatch.workload.presets import choose_preset, parse_overrides


def make_workloads(args, bus) -> list:
    """One Workload per requested GPU (or one on the CPU) from the shared workload flags."""
    import torch

    from gpuwatch.workload.model import resolve_device
    from gpuwatch.workload.runner import Faults, Workload, WorkloadConfig

    overrides = parse_overrides(args.set)
    if args.gpus:
        if not torch.cuda.is_available():
            raise UsageError("--gpus: no CUDA GPU is available to torch here")
        n = torch.cuda.device_count()
        try:
            idx = list(range(n)) if args.gpus == "all" else [int(x) for x in args.gpus.split(",")]
        except ValueError:
            raise UsageError(f"bad --gpus {args.gpus!r}: use all or a list like 0,1") from None
        if any(not 0 <= i < n for i in idx):
            raise UsageError(f"--gpus {args.gpus}: this machine has {n} GPU(s)")
        devices = [torch.device(f"cuda:{i}") for i in idx]
    else:
        devices = [resolve_device(args.device)]
    out = []
    for dev in devices:
        mem = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else None
        preset = args.preset or choose_preset(mem, overrides)
        precision = args.precision or ("bf16" if dev.type == "cuda" else "fp32")
        if args.max_batch and args.batch and args.max_batch < args.batch:
            raise UsageError("--max-batch must be >= --batch")
        cfg = WorkloadConfig(
            preset=preset, mode=args.mode, schedule=args.schedule, precision=precision, batch=args.batch,
            seq_len=args.seq_len, max_batch=args.max_batch, device=str(dev),
            gpu_index=dev.index if dev.type == "cuda" else None, overrides=overrides,
            faults=Faults(args.leak_mib, args.fragment, args.fp16_overflow, args.gpu_memory_limit),
            integrity_every=args.integrity_every, seed=args.seed, max_steps=getattr(args, "steps", None))
        try:
            out.append(Workload(bus, cfg))
        except TypeError as e:
            raise UsageError(f"bad model config: {e}") from None
    return out


def summarize(w, bus) -> dict[str, Any]:
    rows = [r for r in bus.steps.latest(len(bus.steps)) if r["gpu"] == w.cfg.gpu_index]
    tps = [r["tokens_per_s"] for r in rows]
    return {"preset": w.cfg.preset, "mode": w.cfg.mode, "device": w.device_name, "state": w.state,
            "steps": len(rows), "median_tokens_per_s": statistics.median(tps) if tps else None,
            "ooms": w.ooms, "recovered": w.recovered, "nonfinite": w.nonfinite,
            "integrity_failures": w.integrity_failures, "unrecovered": w.unrecovered,
            "ramp_edges": w.schedule.edges, "sweep": sweep_table(rows) if w.cfg.schedule == "sweep" else None,
            "sweep_oom": w.schedule.oom_levels}


def sweep_table(rows: list[dict]) -> list[dict[str, Any]]:
    """Per batch: median latency, tokens/s, TFLOP/s, MFU and peak memory over the measured steps."""
    table = []
    for b in sorted({r["batch"] for r in rows}):
        m = [r for r in rows if r["batch"] == b and "warmup" not in r["phase"]] or [r for r in rows if r["batch"] == b]
        med = lambda k: statistics.median([r[k] for r in m if r[k] is not None]) if any(r[k] is not None for r in m) else None  # noqa: E731
        table.append({"batch": b, "seq_len": m[0]["seq_len"], "latency_s": med("step_time_s"),
                      "tokens_per_s": med("tokens_per_s"), "tflops": med("tflops"), "mfu": med("mfu"),
                      "peak_bytes": max((r["torch_peak_bytes"] or 0) for r in m) or None, "steps": len(m)})
    return table


def run_stress(args) -> int:
    from gpuwatch.runtime import Session

    session = Session(interval=args.interval, record_dir=args.output if args.record else None,
                      source=args.source, sampler=args.sampler)
    for w in make_workloads(args, session.bus):
        session.attach_workload(w)
    print(f"gpuwatch: {session.gpu_note}", file=sys.stderr)
    session.start()
    if session.recorder:
        print(f"recording to {session.recorder.dir}", file=sys.stderr)
    from gpuwatch.cli import _wait_until

    deadline = time.monotonic() + args.duration if args.duration else None
    _wait_until(deadline, done=lambda: all(w.state in ("finished", "failed") for w in session.workloads))
    session.stop()
    code = 0
    for w in session.workloads:
        s = summarize(w, session.bus)
        print(_format_summary(s))
        code |= 1 if s["unrecovered"] else 0
    if session.recorder:
        r = session.recorder
        print(f"recording: {r.dir} ({r.rows} rows, {r.bytes} bytes, {r.dropped} dropped)"
              + (f"; ERROR {r.error}" if r.error else ""))
    return code


def _format_summary(s: dict[str, Any]) -> str:
    tps = f"{s['median_tokens_per_s']:.0f}" if s["median_tokens_per_s"] else "-"
    lines = [f"{s['preset']} {s['mode']} on {s['device']}: {s['state']}, {s['steps']} steps, "
             f"median {tps} tokens/s, {s['ooms']} OOM ({s['recovered']} recovered), "
             f"{s['nonfinite']} non-finite, {s['integrity_failures']} integrity failures"]
    if s["unrecovered"]:
        lines.append(f"  UNRECOVERED: {s['unrecovered']}")
    if s["ramp_edges"]:
        lines.append(f"  ramp OOM edges (last batch that fit): {s['ramp_edges']}")
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
