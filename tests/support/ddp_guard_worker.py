"""Run under torchrun with 2 ranks (tests/test_distributed.py): rank 0's guard lowers the batch ceiling
and changes the precision before step 2; every rank must apply both at the same step. Rank 0 prints the
step rows of every rank (they reach it over the control plane) as one JSON line.

`--worst-rank`: rank 0 runs gpuwatch's real Guard instead (mode on, threshold 0.5), with no risk of its
own; rank 1 reports a risk of 0.9 before step 2 (GPUWATCH_SIM_RISK=1:2:0.9, set by the test): the guard
must decide on rank 1's risk and both ranks apply the lower ceiling at the same step.
`--fsdp`: the model sharded with FSDP (`--dp fsdp`): the ceiling is applied (gradient accumulation without
sync), the precision change refused on every rank."""

from __future__ import annotations

import json
import sys

from gpuwatch.contract import Action
from gpuwatch.telemetry.bus import Bus
from gpuwatch.workload import dist_init
from gpuwatch.workload import distributed as D
from gpuwatch.workload.factory import WorkloadSpec


class ScriptedGuard:
    """Decides once, on rank 0, at a fixed step (what the real guard does on a risk)."""

    acting = True

    def before_step(self, w, worst=None) -> None:
        if w._step == 2 and not getattr(self, "done", False):
            self.done = True
            w.apply(Action("lower_ceiling", 2, "test: risk"))
            w.apply(Action("precision", "bf16", "test: risk"))

    def after_oom(self, w, batch, micro):
        return None


def main() -> int:
    ctx = dist_init.init_from_env("cpu")
    spec = WorkloadSpec(preset="tiny", mode="train", batch=4, seq_len=32, max_steps=4, device="cpu",
                        overrides={"num_hidden_layers": 1})
    bus = Bus()
    (w,) = D.make_rank_workloads(ctx, dp="fsdp" if "--fsdp" in sys.argv else None)(spec, bus)
    worst = "--worst-rank" in sys.argv
    if ctx.leader:
        if worst:
            from gpuwatch.control.guard import Guard, GuardConfig

            w.guard = Guard(bus, GuardConfig(mode="on"), {w.gpu_index: w}, 0.5)
        else:
            w.guard = ScriptedGuard()
    w.run()
    if ctx.leader:
        rows = [{k: r[k] for k in ("rank", "step", "batch", "micro_batches", "precision", "comm_bytes")}
                for r in bus.steps.latest(100)]
        events = [{"kind": e.kind, "rank": e.detail.get("rank"), "at_step": e.detail.get("at_step"),
                   "decided_on_rank": e.detail.get("decided_on_rank"), "value": e.detail.get("value")}
                  for e in bus.events.latest(100)]
        print(json.dumps({"state": w.state, "rows": rows, "events": events}), flush=True)
    D.shutdown(ctx)
    return 0 if w.state == "finished" else 1


if __name__ == "__main__":
    sys.exit(main())
