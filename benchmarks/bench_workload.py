"""The DeepSeek workload on a real GPU (issue 3's figures). Each stage prints and saves one JSON object.

  python benchmarks/bench_workload.py sweep    --preset v2-lite   prefill 512 tokens, batch 1..128, bf16
  python benchmarks/bench_workload.py overhead --preset v2-lite   tokens/s bare vs with gpuwatch's
                                                                   sampler+recorder, paired windows
  python benchmarks/bench_workload.py oom      --preset v2-lite   10 injected OOMs in train mode
  python benchmarks/bench_workload.py ramp     --preset v2-lite   train-mode ramp to the OOM edge
--record DIR keeps the recorded sessions (samples, steps, events) there.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Heavy imports (torch, transformers) stay inside the functions: the sampler's child process is
# spawned, and spawn re-imports this script as __mp_main__; module-level torch imports made every
# Session start take seconds (the overhead stage ran past its limit on the H200 because of it).
from gpuwatch.runtime import ModelChoice, Session, SessionConfig  # noqa: E402
from gpuwatch.telemetry.bus import Bus  # noqa: E402


def _workload(bus, **kw):
    from gpuwatch.workload.runner import Workload, WorkloadConfig

    return Workload(bus, WorkloadConfig(**kw))


def summarize(w, bus):
    from gpuwatch.workload.summary import summarize as s

    return s(w, bus)


def _session(record: Path | None, name: str, **workload) -> Session:
    """A recorded session; with `workload` (WorkloadConfig's fields), running that one workload, built on
    the session's bus (`Session(workloads=...)`) and recorded in its meta.json; no model, no guard."""
    from gpuwatch.control.policy import GuardConfig

    make = (lambda bus, _nvml_index: [_workload(bus, **workload)]) if workload else None
    return Session(SessionConfig(interval_s=0.1, record_dir=record or Path(tempfile.mkdtemp()), name=name,
                                 model=ModelChoice(enabled=False), guard=GuardConfig(mode="off")), workloads=make)


def _power(session: Session) -> dict:
    from gpuwatch.recording.reader import open_recording

    rec = open_recording(session.recorder.dir)
    s = rec.samples.filter(rec.samples["gpu"] == 0)
    if s.is_empty():
        return {}
    swcap = (s["gpu_clocks_event_reasons"].fill_null(0) & 0x4) > 0
    return {"max_power_w": float(s["gpu_power_w"].max()), "power_limit_w": float(s["gpu_power_limit_w"].max()),
            "samples_with_sw_power_cap": int(swcap.sum()), "max_temp_c": int(s["gpu_temp_c"].max()),
            "max_mem_used_gib": round(float(s["gpu_mem_used_bytes"].max()) / 2**30, 2), "session": rec.path.name}


def sweep(a) -> dict:
    s = _session(a.record, f"sweep-{a.preset}-prefill", preset=a.preset, mode="prefill", schedule="sweep",
                 precision="bf16", seq_len=512, device=a.device, gpu_index=0 if a.device != "cpu" else None,
                 integrity_every=0)
    w = s.workload
    s.start()
    w.join()
    s.stop()
    return {"stage": "sweep", **summarize(w, s.bus), **_power(s)}


def overhead(a) -> dict:
    """ABBA-ordered windows of the same running workload: bare, then with a Session sampling+recording."""
    bus = Bus()
    w = _workload(bus, **dict(preset=a.preset, mode="prefill", precision="bf16", batch=a.batch,
                                     seq_len=512, device=a.device, gpu_index=0 if a.device != "cpu" else None, integrity_every=0))
    w.start()
    while len(bus.steps) < 10:
        time.sleep(0.2)
    res: dict[str, list[float]] = {"bare": [], "watched": []}
    order = ["bare", "watched", "watched", "bare"] * (a.pairs // 2)
    for kind in order:
        s = None
        if kind == "watched":
            s = Session(SessionConfig(interval_s=0.1, record_dir=Path(tempfile.mkdtemp()), model=ModelChoice(enabled=False)))
            s.start()
        time.sleep(2.0)  # the sampler child has started and settled
        start = bus.steps.next_seq
        time.sleep(a.window)
        rows, _, _ = bus.steps.since(start)
        res[kind].append(sum(r["batch"] * r["seq_len"] for r in rows) / sum(r["step_time_s"] for r in rows))
        if s:
            s.stop()
    w.stop()
    ratio = [wt / b for wt, b in zip(res["watched"], res["bare"])]
    return {"stage": "overhead", "preset": a.preset, "batch": a.batch, "window_s": a.window,
            "tokens_per_s": res, "watched_over_bare_median": statistics.median(ratio),
            "watched_over_bare_each": ratio}


def oom(a) -> dict:
    """Train steps at a batch that fits, with 10 steps at a batch that cannot fit injected in between."""
    import torch

    s = _session(a.record, f"oom-inject-{a.preset}-train")
    w = _workload(s.bus, **dict(preset=a.preset, mode="train", precision="bf16", batch=a.batch,
                                       seq_len=1024, device=a.device, gpu_index=0 if a.device != "cpu" else None, integrity_every=0))
    s.start()
    w.build()
    out = []
    for i in range(10):
        w.run_step(a.batch, 1024, "steady")
        pre = torch.cuda.memory_allocated()
        w.run_step(a.big_batch, 1024, "inject")
        ev = [e for e in s.bus.events.latest(20) if e.kind == "oom_recovered"]
        after = torch.cuda.memory_allocated()
        w.schedule.set_batch(a.batch)
        w.run_step(a.batch, 1024, "steady")  # and the next normal step runs
        out.append({"pre_step_allocated": pre, "after_recovery_allocated": after, "back": after <= pre,
                    "event_back_to_pre_step": ev[-1].detail.get("back_to_pre_step") if ev else None})
    s.stop()
    return {"stage": "oom", "preset": a.preset, "batch": a.batch, "injected_batch": a.big_batch,
            "ooms": w.ooms, "recovered": w.recovered, "back_to_pre_step": sum(o["back"] for o in out),
            "normal_steps_after": len([r for r in s.bus.steps.latest(100) if r["phase"] == "steady"]),
            "detail": out, **_power(s)}


def ramp(a) -> dict:
    s = _session(a.record, f"ramp-{a.preset}-train", preset=a.preset, mode="train", schedule="ramp",
                 precision="bf16", batch=a.batch, seq_len=1024, device=a.device,
                 gpu_index=0 if a.device != "cpu" else None, integrity_every=25)
    w = s.workload
    w.schedule.per_level = 3
    s.start()
    deadline = time.monotonic() + a.seconds
    while time.monotonic() < deadline and w.state not in ("failed", "finished"):
        time.sleep(0.5)
    s.stop()
    return {"stage": "ramp", **summarize(w, s.bus), **_power(s)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("stage", choices=["sweep", "overhead", "oom", "ramp"])
    ap.add_argument("--preset", default="v2-lite")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--big-batch", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--window", type=float, default=8.0)
    ap.add_argument("--seconds", type=float, default=90.0)
    ap.add_argument("--record", type=Path)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    res = {"sweep": sweep, "overhead": overhead, "oom": oom, "ramp": ramp}[a.stage](a)
    gc.collect()
    text = json.dumps(res, indent=1, default=str)
    print(text)
    if a.out:
        a.out.write_text(text)


if __name__ == "__main__":
    main()
