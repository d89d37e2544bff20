"""What live risk scoring costs: a live source fed a real H200 recording tick by tick, scored after
every tick as the session's scorer does (window + features + prediction + reasons near the alarm).

  python benchmarks/bench_scorer.py [--rounds 400] [--session recordings/sample-h200-ramp-train]
Prints CPU ms per round and per part (window, features, prediction), thread CPU time, medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpuwatch.predict.features import features, vector  # noqa: E402
from gpuwatch.predict.model import load_model  # noqa: E402
from gpuwatch.predict.scorer import LiveScorer  # noqa: E402
from gpuwatch.recording.source import LiveSource, ReplaySource  # noqa: E402
from gpuwatch.telemetry.bus import Bus, Tick  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--session", default=str(Path(__file__).resolve().parents[1] / "recordings" / "sample-h200-ramp-train"))
    a = ap.parse_args()
    rec = ReplaySource(a.session)
    g = rec.gpus[0].index
    rows = rec._by_gpu[g].to_dicts()
    for r in rows:
        r["ts"] = int(r["ts"].timestamp() * 1e6)
    bus = Bus()
    src = LiveSource(bus, rec.gpus, interval_s=rec.interval_s)
    model = load_model()
    ls = LiveScorer(src, model, bus, lambda _g: None)
    warm = min(300, len(rows) // 2)
    for r in rows[:warm]:
        bus.ticks.append(Tick(r["tick"], r["ts"], [r]))
    ls.score_once()
    parts = {"round": [], "window": [], "features": [], "predict": []}
    for r in rows[warm:warm + a.rounds]:
        bus.ticks.append(Tick(r["tick"], r["ts"], [r]))
        t0 = time.thread_time_ns()
        ls.score_once()
        parts["round"].append(time.thread_time_ns() - t0)
        t0 = time.thread_time_ns()
        w = src.window(g)
        t1 = time.thread_time_ns()
        x = vector(features(w))
        t2 = time.thread_time_ns()
        ls.scorer.score_vector(x)
        t3 = time.thread_time_ns()
        parts["window"].append(t1 - t0)
        parts["features"].append(t2 - t1)
        parts["predict"].append(t3 - t2)
    out = {k: round(statistics.median(v) / 1e6, 3) for k, v in parts.items()}
    out.update(rounds=len(parts["round"]), model=model.label, session=Path(a.session).name)
    print(json.dumps({"cpu_ms_median": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
