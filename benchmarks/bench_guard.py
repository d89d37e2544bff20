"""The guard against the alternatives, on one GPU: each scenario (ramp to OOM in train and prefill,
a leak under a cap, fragmentation under a cap) run five ways back to back in one process, the model
built once per scenario:

  none        no guard; the schedule's own OOM recovery (the failed step is lost)
  accelerate  reactive: catch the OOM, batch x 0.9, retry the same step
  composer    reactive: halve the micro-batch, re-run the same batch (gradient accumulation)
  fixed       memory > 90 % of the limit halves the batch, < 30 % doubles it
  gpuwatch    the trained risk model + policy (refuse the step up, lower the ceiling, restore)

For each: OOMs, steps lost, retries, tokens/s over the run, the batch held against the largest that
fits (found by search first), and tokens/s in the last quarter against the first (restore after the
danger). Every arm is recorded (a session folder per arm) so the guard's actions can be replayed.

  python benchmarks/bench_guard.py --seconds 20 --out /tmp/guard.json --record /tmp/guard-sessions
  python benchmarks/bench_guard.py --cpu --seconds 6      # the same code on the tiny preset, simulated OOMs
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpuwatch.control.policy import GuardConfig  # noqa: E402
from gpuwatch.runtime import ModelChoice, Session, SessionConfig  # noqa: E402
from gpuwatch.workload.factory import WorkloadSpec  # noqa: E402

GiB = 2**30
CPU_SOURCE = Path(__file__).resolve().parents[1] / "recordings" / "sample-h200-ramp-train"  # real telemetry for --cpu
ARMS = {name: GuardConfig(mode=mode, rule=rule, plan=plan) for name, (mode, rule, plan) in {
    "none": ("off", "model", True), "accelerate": ("on", "accelerate", True), "composer": ("on", "composer", True),
    "fixed": ("on", "fixed", True), "gpuwatch": ("on", "model", True),
    "gpuwatch-thresholds": ("on", "model", False),  # the planner off: the risk threshold and its timer only
}.items()}


@dataclass(frozen=True)
class Scenario:
    name: str
    spec: WorkloadSpec
    search_from: int


def scenarios(cpu: bool) -> list[Scenario]:
    if cpu:  # tiny preset, OOMs simulated above a token count (the CPU has no allocator limit)
        base = WorkloadSpec(preset="tiny", device="cpu", integrity_every=0, seq_len=64)
        return [Scenario("ramp-train", replace(base, mode="train", schedule="ramp", batch=8), 2),
                Scenario("ramp-prefill", replace(base, mode="prefill", schedule="ramp", batch=8), 2)]
    v2 = WorkloadSpec(preset="v2-lite", integrity_every=0)
    return [
        # ramps start at batch/4, a level (6 steps) below the edge the first call found (20 and 12)
        Scenario("ramp-train", replace(v2, mode="train", schedule="ramp", batch=64, seq_len=512,
                                       memory_limit_bytes=100 * GiB), 8),
        Scenario("ramp-prefill", replace(v2, mode="prefill", schedule="ramp", batch=40, seq_len=4096,
                                         memory_limit_bytes=40 * GiB), 4),
        Scenario("leak", replace(v2, preset="small", mode="prefill", batch=8, seq_len=512, leak_mib=512,
                                 memory_limit_bytes=40 * GiB), 8),
        Scenario("fragment", replace(v2, mode="prefill", batch=64, seq_len=2048, fragment=True,
                                     memory_limit_bytes=48 * GiB), 16),
    ]


def _reusing(w, bus, model_box: dict):
    """The same workload (its config), given the scenario's model if one was built (`Workload(model=)`)."""
    from gpuwatch.workload.runner import Workload

    return Workload(bus, w.cfg, model=model_box.get("model"))


def _factory(model_box: dict, cpu_limit: int | None):
    """Workloads that reuse the scenario's model (built on the first arm)."""
    def make(spec, bus, nvml_index):
        from gpuwatch.workload.factory import make_workloads

        ws = make_workloads(spec, bus, nvml_index)
        for w in ws:
            if cpu_limit:
                w.cfg.faults.oom_above_tokens = cpu_limit
                w.cfg.gpu_index = 0  # the CPU workload stands in for the replayed H200's GPU 0
        return [_reusing(w, bus, model_box) for w in ws]
    return make


def largest_fit(scn: Scenario, model_box: dict, cpu_limit: int | None, steps: int = 2) -> int | None:
    """Binary search for the largest steady batch that runs `steps` steps without an OOM."""
    from gpuwatch.telemetry.bus import Bus
    from gpuwatch.workload.factory import make_workloads

    def fits(b: int) -> bool:
        ok = _fits(b)
        _free_cache()  # the trial's workload is collectable only once _fits has returned
        return ok

    def _fits(b: int) -> bool:
        bus = Bus()
        spec = replace(scn.spec, schedule="steady", batch=b, leak_mib=0.0, fragment=False, max_steps=steps)
        w = make_workloads(spec, bus)[0]
        if cpu_limit:
            w.cfg.faults.oom_above_tokens = cpu_limit
        w = _reusing(w, bus, model_box)
        w.run()
        model_box.setdefault("model", w.model)
        ok = w.ooms == 0
        _free(w)
        return ok
    lo, hi = 0, scn.search_from
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > 4096:
            return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo or None


def _free(w) -> None:
    """What the workload holds beyond its model; its memory goes with `_free_cache()` once the caller's frame
    (the workload, in reference cycles with its Session) is gone."""
    w.release_fault_memory()
    w.optimizer = None


def _free_cache() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            # an arm whose guard switched the allocator to expandable segments must not hand that to the
            # next arm (session 38, call b: every arm after the first ramp-train guard ran with them)
            from gpuwatch.workload.allocator import set_expandable_segments

            set_expandable_segments(False)
    except ImportError:
        pass


def run_arm(scn: Scenario, arm: str, seconds: float, model_box: dict, cpu_limit: int | None,
            model_path: Path | None, record: Path | None) -> dict:
    cfg = SessionConfig(record_dir=record, name=f"guard-{scn.name}-{arm}", workload=scn.spec,
                        guard=ARMS[arm], model=ModelChoice(model_path, True, False),
                        source=str(CPU_SOURCE) if cpu_limit else None)
    t0 = time.monotonic()
    with Session(cfg, workload_factory=_factory(model_box, cpu_limit)) as s:
        s.wait(seconds, until_done=True)
    elapsed = time.monotonic() - t0
    w = s.workloads[0]
    steps = [r for r in s.bus.steps.latest(len(s.bus.steps)) if r["gpu"] == w.cfg.gpu_index]
    tokens = [r["tokens_per_s"] * r["step_time_s"] for r in steps]
    q = max(1, len(steps) // 4)
    tps = lambda rows: sum(r["tokens_per_s"] * r["step_time_s"] for r in rows) / max(1e-9, sum(r["step_time_s"] for r in rows))  # noqa: E731
    acts = [e for e in s.bus.events.latest(len(s.bus.events)) if e.kind == "guard_action"]
    out = {
        "scenario": scn.name, "arm": arm, "seconds": round(elapsed, 1), "steps": len(steps),
        "ooms": w.ooms, "lost_steps": w.lost_steps, "retries": w.retries,
        "tokens_per_s": round(sum(tokens) / elapsed, 1) if elapsed else None,
        "tokens_per_s_stepping": round(tps(steps), 1) if steps else None,
        # from the first step's end to the last's: the guard, recoveries and restarts between steps counted, the
        # build and the first step's warm-up not - which the first arm of a process pays alone (call s39d: the
        # planner arm first, 33 s for 15 steps against the next arm's 17 s for 21: arms compare on this figure)
        "tokens_per_s_after_first": (round(sum(tokens[1:]) / ((steps[-1]["ts"] - steps[0]["ts"]) / 1e6), 1)
                                     if len(steps) > 1 and steps[-1]["ts"] > steps[0]["ts"] else None),
        "batch_median": statistics.median([r["batch"] / (r.get("micro_batches") or 1) for r in steps]) if steps else None,
        "batch_last": (steps[-1]["batch"] / (steps[-1].get("micro_batches") or 1)) if steps else None,
        "effective_batch_last": steps[-1]["batch"] if steps else None,
        "first_quarter_tps": round(tps(steps[:q]), 1) if steps else None,
        "last_quarter_tps": round(tps(steps[-q:]), 1) if steps else None,
        "guard_actions": len(acts), "actions": [e.message for e in acts][:12],
        "guard_misses": s.guard.misses if s.guard else None, "model": s.model_note,
        "session": str(s.recorder.dir) if s.recorder else None, "state": w.state, "unrecovered": w.unrecovered,
    }
    _free(w)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--scenarios", default=None)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--record", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--known-fit", default="", help="skip the search: ramp-train=20,leak=1071 (from an earlier call)")
    a = ap.parse_args()
    cpu_limit = 8 * 64 if a.cpu else None  # tiny: batch 8 x 64 tokens fits, more does not
    results = []
    for scn in scenarios(a.cpu):
        if a.scenarios and scn.name not in a.scenarios.split(","):
            continue
        box: dict = {}
        t0 = time.monotonic()
        known = dict(kv.split("=") for kv in a.known_fit.split(",") if "=" in kv)
        fit = int(known[scn.name]) if scn.name in known else largest_fit(scn, box, cpu_limit)
        print(f"== {scn.name}: largest batch that fits {fit} (search {time.monotonic() - t0:.1f} s)", flush=True)
        for arm in a.arms.split(","):
            r = run_arm(scn, arm, a.seconds, box, cpu_limit, a.model, a.record)
            _free_cache()  # now that run_arm's frame (its Session and workload, in reference cycles) is gone
            r["largest_fit"] = fit
            r["held_vs_fit"] = round(r["batch_last"] / fit, 3) if fit and r["batch_last"] else None
            results.append(r)
            print(f"   {arm:10s} OOMs {r['ooms']:3d} lost {r['lost_steps']:3d} retries {r['retries']:3d} "
                  f"tok/s {r['tokens_per_s']:>10} (after the first step {r['tokens_per_s_after_first']}) "
                  f"batch last {r['batch_last']} (fit {fit}) "
                  f"restore {r['last_quarter_tps']}/{r['first_quarter_tps']} actions {r['guard_actions']}", flush=True)
            if a.out:
                a.out.write_text(json.dumps(results, indent=1))
        box.clear()
        _free_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
