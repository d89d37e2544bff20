"""Does live risk scoring cost the watched workload anything? Sessions with a scorer and sessions without
one (`ModelChoice(enabled=False)`, the CLI's --no-model), in ABBA order, every one running the same model
(built once, handed to each session's workload: `Workload(model=)`), tokens/s compared pair by pair.

  python benchmarks/bench_scorer_overhead.py --preset v2-lite --batch 8 --pairs 6 --window 6   (GPU)
  python benchmarks/bench_scorer_overhead.py --preset tiny --device cpu --pairs 2 --window 3    (dry run)
Prints the on/off tokens/s ratio per pair, the median, and the scorer's CPU per round on this machine.
Each session first runs --warmup seconds unmeasured (the sampler child and the scorer start, the first
steps); a pair's two sessions run back to back, so drift within a pair is what ABBA cancels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpuwatch.control.policy import GuardConfig  # noqa: E402
from gpuwatch.runtime import ModelChoice, Session, SessionConfig  # noqa: E402
from gpuwatch.workload.factory import WorkloadSpec  # noqa: E402


def tokens_per_s(bus, t0_us: int, t1_us: int) -> float | None:
    rows = [r for r in bus.steps.latest(len(bus.steps)) if t0_us <= r["ts"] <= t1_us]
    busy = sum(r["step_time_s"] for r in rows)
    return sum(r["tokens_per_s"] * r["step_time_s"] for r in rows) / busy if busy else None


def one_model(model_box: dict):
    """A workload factory: the spec's workload, running the one model built by the first session."""
    def make(spec, bus, nvml_index):
        import torch

        from gpuwatch.workload import model as M
        from gpuwatch.workload.factory import make_workloads
        from gpuwatch.workload.runner import Workload

        (w,) = make_workloads(spec, bus, nvml_index)
        if "model" not in model_box:
            model_box["model"], model_box["build_s"] = M.build_model(w.fields, torch.device(w.cfg.device),
                                                                     w.cfg.precision, w.cfg.seed)
        return [Workload(bus, w.cfg, model=model_box["model"])]
    return make


def arm(cfg: SessionConfig, factory, warmup: float, window: float) -> dict:
    """One session: tokens/s over `window` after `warmup`; with a scorer, its CPU per round, rate and model."""
    with Session(cfg, workload_factory=factory) as s:
        if cfg.model.enabled and s.scorer is None:
            raise SystemExit(json.dumps({"error": f"no scorer: {s.model_note}"}))
        time.sleep(warmup)
        t0 = time.time_ns() // 1000
        time.sleep(window)
        out = {"tps": tokens_per_s(s.bus, t0, time.time_ns() // 1000)}
        if s.scorer is not None:
            out.update(cost_us=list(s.scorer.cost_us), hz=round(1 / s.scorer.period, 2), model=s.model_note)
        return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="v2-lite")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--window", type=float, default=6.0)
    ap.add_argument("--warmup", type=float, default=4.0, help="seconds of each session before its window")
    ap.add_argument("--source", default=None, help="a recording replayed as the GPU (CPU dry run)")
    a = ap.parse_args()
    spec = WorkloadSpec(preset=a.preset, device=a.device, batch=a.batch, seq_len=a.seq_len, integrity_every=0)
    base = SessionConfig(workload=spec, guard=GuardConfig(mode="observe"), source=a.source)
    model_box: dict = {}
    factory = one_model(model_box)
    ratios, cost, scored = [], [], {}
    for i in range(a.pairs):
        tps = {}
        for on in ((True, False) if i % 2 == 0 else (False, True)):
            r = arm(replace(base, model=ModelChoice(enabled=on)), factory, a.warmup, a.window)
            tps[on] = r["tps"]
            if on:
                cost += r["cost_us"]
                scored = r
        if tps[True] and tps[False]:
            ratios.append(tps[True] / tps[False])
        print(f"pair {i}: scoring on {tps[True]} off {tps[False]} tok/s", file=sys.stderr, flush=True)
    cost.sort()
    out = {"preset": a.preset, "batch": a.batch, "pairs": len(ratios), "ratios_on_over_off": [round(r, 4) for r in ratios],
           "median_ratio": round(statistics.median(ratios), 4) if ratios else None,
           "scorer_round_cpu_us_p50": cost[len(cost) // 2] if cost else None,
           "scorer_round_cpu_us_p99": cost[int(0.99 * (len(cost) - 1))] if cost else None,
           "scorer_hz": scored.get("hz"), "model": scored.get("model"),
           "model_build_s": round(model_box.get("build_s", 0.0), 2)}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
