"""What the planner's estimates and step-time model say now at each plan a recorded session made (issue 28,
session 47): for every `guard_action` plan event, the peak estimate (mean +- sigma, shares of the usable limit) of
each micro-batch of the effective batch at the plan's coming length, from the window the session had then
(`predict/plans.estimate`, checkpointing off), beside what the event logged; and the per-micro-batch cost the pace
model (`control/pace.py`) measures from the session's steps up to that plan. Run it at two commits to see what a
change to the estimator or the pace model would have decided differently on a real run.

    python3 benchmarks/replay_plans.py SESSION [SESSION ...]
    (the s47 calls' sessions: tar xzf benchmarks/results/s47/b/hf-sessions.tgz -C /tmp/s47b, then /tmp/s47b/sessions/planner)
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpuwatch.contract import Config  # noqa: E402
from gpuwatch.control.pace import StepTimes  # noqa: E402
from gpuwatch.errors import RecordingError, UsageError  # noqa: E402
from gpuwatch.predict.plans import estimate  # noqa: E402
from gpuwatch.recording.frames import epoch_us  # noqa: E402
from gpuwatch.recording.source import ReplaySource  # noqa: E402


def replay(path: str) -> None:
    src = ReplaySource(path)
    g = src.gpus[0].index
    st = src.steps_df.sort("step")
    step_us = epoch_us(st["ts"])
    print(f"== {path}")
    for r in src.events_df.filter(pl.col("kind") == "guard_action").iter_rows(named=True):
        d = json.loads(r["detail"] or "{}")
        if d.get("action") != "plan":
            continue
        ch, n = d["chosen"], int(d.get("planned_batch") or d["chosen"]["micro_batch"])
        t = int(epoch_us(pl.Series([r["ts"]]))[0]) - 1000
        w = src.window_at(g, t)
        out = []
        for mb in sorted({n, 8, 6, 4, 3, 2, ch["micro_batch"]}, reverse=True):
            if mb > n:
                continue
            e = estimate(w, [(Config(mb, False, ch.get("precision") or "bf16", math.ceil(n / mb)), ch["seq_len"])])[0]
            out.append(f"{mb}:{e[0]:.2f}+-{e[1]:.2f}" if e else f"{mb}:-")
        times = StepTimes()
        for i, s in enumerate(st.iter_rows(named=True)):
            if step_us[i] >= t:
                break
            if i:  # the first step is the warm-up, as the planner leaves it out
                times.add(bool(s.get("checkpointing")), s["precision"], int(s.get("micro_batches") or 1),
                          s["batch"] * s["seq_len"], s["seq_len"], s["step_time_s"])
        pm = times.per_micro_s()
        print(f"seq {ch['seq_len']}: logged {ch['micro_batch']}{' + ckpt' if ch.get('checkpointing') else ''} "
              f"({ch['peak_frac']:.2f}+-{ch['peak_sigma']:.2f}); now {' '.join(out)}; per micro-batch "
              + (f"{pm * 1e3:.1f} ms" if pm is not None else "-"))


def main() -> int:
    if len(sys.argv) < 2:
        print("usage: python3 benchmarks/replay_plans.py SESSION [SESSION ...]", file=sys.stderr)
        return 2
    try:
        for p in sys.argv[1:]:
            replay(p)
    except (RecordingError, UsageError, OSError, KeyError, ValueError) as e:
        print(f"replay_plans: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
