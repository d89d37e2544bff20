"""The planner's decisions over a range of a recorded session's steps, replayed now (issue 28, session 49): at each
step, the planner that has observed the steps before it decides with the estimator on the window the session had
then, (a) as a framework that decides before fetching the batch (the last step's length, nothing known ahead: the
longest recent length may come next) and (b) with the step's own batch in hand (`GuardedLoop.step`, Lightning's
`gw.step`). The micro-batch each decision chose is carried to the next step; the session's recorded steps stand in
for the steps' times and lengths (what ran is what was recorded, whatever the replay chose). Prints the changes.

    python3 benchmarks/replay_decisions.py SESSION FROM TO
    (s47's Lightning arm: tar xzf benchmarks/results/s47/b/lightning-sessions.tgz -C /tmp/s47l,
     then /tmp/s47l/sessions/lightning-planner 50 72 - its second epoch's first steps)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpuwatch.contract import StepPlan, WorkloadView  # noqa: E402
from gpuwatch.control.planner import Estimate, Planner  # noqa: E402
from gpuwatch.errors import RecordingError, UsageError  # noqa: E402
from gpuwatch.predict.plans import estimate  # noqa: E402
from gpuwatch.recording.frames import epoch_us  # noqa: E402
from gpuwatch.recording.source import ReplaySource  # noqa: E402


def replay(path: str, lo: int, hi: int, in_hand: bool) -> list[tuple[int, int, int, str]]:
    src = ReplaySource(path)
    g = src.gpus[0].index
    st = src.steps_df.sort("step")
    rows, us = st.to_dicts(), list(epoch_us(st["ts"]))
    p, out, cur = Planner(), [], None
    for i in range(1, min(hi, len(rows))):
        r = rows[i - 1]  # the last step run before step i is decided
        n = int(r["batch"])
        v = WorkloadView(gpu=g, ceiling=None, last_ok_batch=n // max(1, int(r["micro_batches"] or 1)), floor=1,
                         lower_precisions=(), checkpointing=False, restart_cost_s=None,
                         last_step_time_s=r["step_time_s"], last_tokens=n * r["seq_len"], last_seq_len=r["seq_len"],
                         steps=i, last_checkpointing=bool(r.get("checkpointing")))
        if i < lo:
            p.observe(v, r["precision"] or "bf16")
            continue
        nxt = rows[i]
        cur = cur or int(nxt["batch"]) // max(1, int(nxt["micro_batches"] or 1))
        s = int(nxt["seq_len"]) if in_hand else int(r["seq_len"])
        plan = StepPlan(batch=cur, seq_len=s, precision=r["precision"] or "bf16", mode="train",
                        micro_batches=-(-n // cur), effective_batch=n, wanted_batch=n, checkpointing=False,
                        in_hand=in_hand)
        w = src.window_at(g, int(us[i - 1]) + 1000)

        def est(asks, w=w):
            return [None if e is None else Estimate(e[0], e[1]) for e in estimate(w, list(asks))]

        d = p.decide(plan, v, est, risk=0.0, threshold=0.5)
        if d is not None and d.change:
            cur = d.chosen.config.micro_batch
            out.append((int(nxt["step"]), int(nxt["seq_len"]), cur, d.why))
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        for in_hand in (False, True):
            print("with the batch in hand:" if in_hand else "deciding before the batch is fetched:")
            for step, seq, micro, why in replay(argv[0], int(argv[1]), int(argv[2]), in_hand):
                print(f"  step {step} (seq {seq}): micro-batch {micro} - {why}")
    except (RecordingError, UsageError, OSError, KeyError, ValueError) as e:
        print(f"replay_decisions: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
