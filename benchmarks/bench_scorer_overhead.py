"""Does live risk scoring cost the watched workload anything? One session, one workload, the scorer
switched off and on in alternating windows (ABBA order), tokens/s compared window by window.

  python benchmarks/bench_scorer_overhead.py --preset v2-lite --batch 8 --pairs 6 --window 6   (GPU)
  python benchmarks/bench_scorer_overhead.py --preset tiny --device cpu --pairs 2 --window 3    (dry run)
Prints the on/off tokens/s ratio per pair, the median, and the scorer's CPU per round on this machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpuwatch.control.policy import GuardConfig  # noqa: E402
from gpuwatch.runtime import Session, SessionConfig  # noqa: E402
from gpuwatch.workload.factory import WorkloadSpec  # noqa: E402


def tokens_per_s(bus, t0_us: int, t1_us: int) -> float | None:
    rows = [r for r in bus.steps.latest(len(bus.steps)) if t0_us <= r["ts"] <= t1_us]
    busy = sum(r["step_time_s"] for r in rows)
    return sum(r["tokens_per_s"] * r["step_time_s"] for r in rows) / busy if busy else None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="v2-lite")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--window", type=float, default=6.0)
    ap.add_argument("--source", default=None, help="a recording replayed as the GPU (CPU dry run)")
    a = ap.parse_args()
    spec = WorkloadSpec(preset=a.preset, device=a.device, batch=a.batch, seq_len=a.seq_len, integrity_every=0)
    cfg = SessionConfig(workload=spec, guard=GuardConfig(mode="observe"), source=a.source)
    ratios, out = [], {}
    with Session(cfg) as s:
        if s.scorer is None:
            print(json.dumps({"error": f"no scorer: {s.model_note}"}))
            return 1
        time.sleep(10)  # build and warm-up
        for i in range(a.pairs):
            tps = {}
            for on in ((True, False) if i % 2 == 0 else (False, True)):
                s.scorer.paused = not on
                time.sleep(0.5)
                t0 = time.time_ns() // 1000
                time.sleep(a.window)
                tps[on] = tokens_per_s(s.bus, t0, time.time_ns() // 1000)
            if tps[True] and tps[False]:
                ratios.append(tps[True] / tps[False])
            print(f"pair {i}: scoring on {tps[True]} off {tps[False]} tok/s", file=sys.stderr, flush=True)
        cost = sorted(s.scorer.cost_us)
        out = {"preset": a.preset, "batch": a.batch, "pairs": len(ratios), "ratios_on_over_off": [round(r, 4) for r in ratios],
               "median_ratio": round(statistics.median(ratios), 4) if ratios else None,
               "scorer_round_cpu_us_p50": cost[len(cost) // 2] if cost else None,
               "scorer_round_cpu_us_p99": cost[int(0.99 * (len(cost) - 1))] if cost else None,
               "scorer_hz": round(1 / s.scorer.period, 2), "model": s.model_note}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
