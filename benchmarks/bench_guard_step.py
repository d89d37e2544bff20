"""What the guard's decision before a step costs on the CPU, with the real estimator over a real H200 window.

    python3 benchmarks/bench_guard_step.py [--session recordings/sample-h200-sweep-prefill] [--steps 400] [--rounds 3]

`Guard.before_step` for a workload far from its limit (the window of a healthy H200 session at its end: a
prefill sweep whose peak is ~30 % of the card; the planned step is its last step's shape), its view and plan re-made every step as a workload's
are, the estimate asked as `LiveScorer.estimate` asks it (the window built again, then `predict/plans.py`).
Two arms, interleaved round by round: the planner weighing every step (`PLAN_EVERY = 1`), and as shipped
(its keep reused for up to `PLAN_EVERY` steps while the coming steps are far from the limit). Prints ms per
decision (median of the rounds, and the range) and how many decisions weighed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # gpuwatch, and the guard's stub workload in tests/support

from gpuwatch.contract import Config, StepPlan, WorkloadView  # noqa: E402
from gpuwatch.control import guard as G  # noqa: E402
from gpuwatch.control.policy import GuardConfig  # noqa: E402
from gpuwatch.predict.plans import estimate as plans_estimate  # noqa: E402
from gpuwatch.recording.source import ReplaySource  # noqa: E402
from gpuwatch.telemetry.bus import Bus  # noqa: E402
from support.guard_stub import StubWorkload  # noqa: E402


class Workload(StubWorkload):
    """A workload as the guard sees it: the window's last step shape, planned again every step."""

    def __init__(self, batch: int, seq: int, precision: str, step_s: float):
        super().__init__()
        self.batch, self.seq, self.precision, self.step_s, self.steps = batch, seq, precision, step_s, 0

    def next_plan(self) -> StepPlan:
        return StepPlan(batch=self.batch, seq_len=self.seq, precision=self.precision, mode="train", micro_batches=1,
                        effective_batch=self.batch, wanted_batch=self.batch, checkpointing=False)

    def guard_view(self) -> WorkloadView:
        return WorkloadView(gpu=0, ceiling=None, last_ok_batch=self.batch, floor=1, lower_precisions=(),
                            checkpointing=False, restart_cost_s=None, last_step_time_s=self.step_s,
                            last_tokens=self.batch * self.seq, last_seq_len=self.seq, steps=self.steps,
                            last_checkpointing=False, largest=None)


def arm(src: ReplaySource, gpu: int, at_us: int, every: int, steps: int) -> tuple[float, int]:
    w0 = src.window_at(gpu, at_us)
    last = w0.steps.row(w0.steps.height - 1, named=True)
    wl = Workload(int(last["batch"]), int(last["seq_len"]), str(last["precision"]), float(last["step_time_s"] or 0.1))
    weighed = [0]

    def est(g, asks):
        weighed[0] += 1
        return plans_estimate(src.window_at(gpu, at_us), asks)  # as LiveScorer.estimate: the window, then the fit

    g = G.Guard(Bus(), GuardConfig(), {0: wl}, threshold=0.5, estimate=est)
    plan = wl.next_plan()
    (frac, _sigma), = plans_estimate(w0, [(Config(plan.batch, False, plan.precision), plan.seq_len)])
    g.on_risk(0, 0.02, [], {"next_peak_est_frac": frac}, plan.scored(), False)
    old = G.PLAN_EVERY
    G.PLAN_EVERY = every
    try:
        t0 = time.perf_counter()
        for i in range(steps):
            wl.steps = 10 + i
            g.before_step(wl)
        dt = (time.perf_counter() - t0) / steps
    finally:
        G.PLAN_EVERY = old
    assert not wl.applied, wl.applied  # far from the limit: nothing to do in either arm
    return dt, weighed[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--session", type=Path, default=ROOT / "recordings" / "sample-h200-sweep-prefill")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    src = ReplaySource(a.session)
    gpu = src.gpus[0].index
    ts = src.times(gpu)
    at = int(ts[-1])
    res: dict[str, list] = {"every step": [], "as shipped": []}
    counts: dict[str, int] = {}
    for _ in range(a.rounds):
        for name, every in (("every step", 1), ("as shipped", G.PLAN_EVERY)):
            dt, n = arm(src, gpu, at, every, a.steps)
            res[name].append(dt * 1e3)
            counts[name] = n
    out = {"session": a.session.name, "steps": a.steps, "rounds": a.rounds}
    for name, v in res.items():
        out[name] = {"ms_per_decision_median": round(statistics.median(v), 3),
                     "range": [round(min(v), 3), round(max(v), 3)], "decisions_weighed": counts[name]}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
