"""What live risk scoring costs: a live source fed a real H200 recording tick by tick, scored after
every tick as the session's scorer does (window + features + prediction + reasons near the alarm).

  python benchmarks/bench_scorer.py [--rounds 400] [--session recordings/sample-h200-ramp-train] [--steps]
Prints CPU ms per round and per part (window, features, prediction), thread CPU time, medians; the parts
are measured as on a round that brought a new step (no forecast kept from the round before).
`--steps` feeds the recording's step rows too, as the workload appends them, and scores with the plan
the workload shows (its last row's next step and lookahead): the forecasts' share of a live round.
Another tree: `PYTHONPATH=TREE python benchmarks/bench_scorer.py` (this tree is only a fallback).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))

from gpuwatch.predict.features import features, vector  # noqa: E402
from gpuwatch.predict.model import load_model  # noqa: E402
from gpuwatch.predict.scorer import LiveScorer  # noqa: E402
from gpuwatch.recording.source import LiveSource, ReplaySource  # noqa: E402
from gpuwatch.telemetry.bus import Bus, Tick  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--session", default=str(Path(__file__).resolve().parents[1] / "recordings" / "sample-h200-ramp-train"))
    ap.add_argument("--steps", action="store_true", help="feed the step rows and score the workload's plan")
    a = ap.parse_args()
    rec = ReplaySource(a.session)
    g = rec.gpus[0].index
    rows = rec.samples(g).to_dicts()
    for r in rows:
        r["ts"] = int(r["ts"].timestamp() * 1e6)
    steps = rec.steps_df.filter(rec.steps_df["gpu"] == g).to_dicts() if a.steps else []
    for s in steps:
        s["ts"] = int(s["ts"].timestamp() * 1e6)
    bus = Bus()
    cols = getattr(sys.modules["gpuwatch.predict.features"], "SAMPLE_COLUMNS", None)  # as the session's source
    src = LiveSource(bus, rec.gpus, interval_s=rec.interval_s, **({"sample_columns": cols} if cols else {}))
    model = load_model()
    shown: dict = {}

    def plan(_g):  # what the stress workload's plan_info gives the scorer: the next step and the lookahead
        s = shown.get("last")
        if s is None:
            return None
        if s.get("next_batch") is None and "next_batch" in s:  # the run's last step: nothing planned (runtime._plan)
            return {"batch": None, "seq_len": None}
        out = {"batch": s.get("next_batch") or s["batch"], "seq_len": s.get("next_seq_len") or s["seq_len"],
               "precision": s.get("next_precision") or s["precision"], "mode": s["mode"]}
        if s.get("ahead_batch"):
            out.update(ahead_batch=s["ahead_batch"], ahead_seq_len=s["ahead_seq_len"], ahead_steps=s["ahead_steps"])
        return out

    ls = LiveScorer(src, model, bus, plan)
    fed = [0]

    def feed(r) -> None:
        bus.ticks.append(Tick(r["tick"], r["ts"], [r]))
        while fed[0] < len(steps) and steps[fed[0]]["ts"] <= r["ts"]:
            bus.steps.append(steps[fed[0]])
            shown["last"] = steps[fed[0]]
            fed[0] += 1

    warm = min(300, len(rows) // 2)
    for r in rows[:warm]:
        feed(r)
    ls.score_once()
    parts = {"round": [], "window": [], "features": [], "predict": []}
    for r in rows[warm:warm + a.rounds]:
        feed(r)
        t0 = time.thread_time_ns()
        ls.score_once()
        parts["round"].append(time.thread_time_ns() - t0)
        getattr(sys.modules["gpuwatch.predict.features"], "_FORECASTS", {}).clear()  # parts: as on a round with a new step
        t0 = time.thread_time_ns()
        w = src.window(g)
        t1 = time.thread_time_ns()
        x = vector(features(w, plan(g)))
        t2 = time.thread_time_ns()
        ls.scorer.score_vector(x)
        t3 = time.thread_time_ns()
        parts["window"].append(t1 - t0)
        parts["features"].append(t2 - t1)
        parts["predict"].append(t3 - t2)
    out = {k: round(statistics.median(v) / 1e6, 3) for k, v in parts.items()}
    out.update(rounds=len(parts["round"]), model=model.label, session=Path(a.session).name, steps_fed=fed[0],
               tree=str(Path(sys.modules["gpuwatch"].__file__).resolve().parents[1]))
    print(json.dumps({"cpu_ms_median": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
