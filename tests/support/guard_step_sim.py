"""The Hugging Face callback's guard, step by step and deterministic, on the CPU: what the guard decided, said and
recorded over a curriculum that makes the planner split the step - so that a change meant to cut the guard's
own time per step (benchmarks/guard_step_cost.py) can be shown to change none of it (tests/test_guard_step_sim.py
against a run recorded before, tests/data/guard_step_sim.json).

The live path's real parts run: `GpuwatchCallback.on_step_begin` / `on_step_end` (record + decide, the in-step
split), `GuardedLoop`, `Guard`, the planner, `LiveSource` windows over the bus, and the shipped risk model's
`LiveScorer` (its `rescore` and `estimate` for the guard, and a scoring round of its own twice a step, as its
thread would run them). Only the device is simulated (s47's shape: a 34 GiB cap, a per-device batch of 16, the
length 256 -> 4,032), and time is a fake clock, so every figure repeats exactly.
"""

from __future__ import annotations

import contextlib
import json
import math
from types import SimpleNamespace
from typing import Any

GiB = 1 << 30
CAP = 34 * GiB
TOTAL = 80 * GiB
WEIGHTS = 5 * GiB
HELD = GiB // 2  # the gradients held over a split step's micro-batches
PER_TOKEN = int(1.55 * (1 << 20))
BATCH = 16
T0_US = 1_796_000_000_000_000  # the fake clock's epoch (2026-11-30)


class FakeTime:
    """What the guard's modules read of `time`, from one clock the simulation advances."""

    def __init__(self) -> None:
        self.t = 1000.0

    def perf_counter(self) -> float:
        return self.t

    monotonic = perf_counter

    def time(self) -> float:
        return T0_US / 1e6 + self.t

    def time_ns(self) -> int:
        return T0_US * 1000 + round(self.t * 1e9)

    def thread_time_ns(self) -> int:
        return 0

    def sleep(self, s: float) -> None:
        self.t += s


MODULES = ("gpuwatch.integrations.hf", "gpuwatch.integrations.loop", "gpuwatch.integrations.steps",
           "gpuwatch.telemetry.bus", "gpuwatch.predict.scorer", "gpuwatch.recording.source")


@contextlib.contextmanager
def fake_time(clock: FakeTime):
    import importlib

    mods = [importlib.import_module(m) for m in MODULES]
    saved = [m.time for m in mods]
    try:
        for m in mods:
            m.time = clock
        yield clock
    finally:
        for m, t in zip(mods, saved):
            m.time = t


def seq_at(i: int) -> int:
    return 256 + 64 * (i // 2)


def run(steps: int = 120) -> dict[str, Any]:
    """The simulated run: per step the guard's decision (its figures) and the micro-batch; every event, steps row
    and risk row (times left out: the fake clock's)."""
    from gpuwatch.control.guard import Guard
    from gpuwatch.control.policy import GuardConfig
    from gpuwatch.integrations.hf import GpuwatchCallback
    from gpuwatch.integrations.loop import GuardedLoop
    from gpuwatch.predict.model import load_model
    from gpuwatch.predict.scorer import LiveScorer
    from gpuwatch.recording.source import LiveSource
    from gpuwatch.recording.window import GpuMeta
    from gpuwatch.telemetry.bus import Bus, Tick

    clock = FakeTime()
    with fake_time(clock):
        bus = Bus()
        mem = {"peak": WEIGHTS, "reserved": WEIGHTS}

        class Loop(GuardedLoop):
            def _mem(self):
                return {"torch_allocated_bytes": WEIGHTS, "torch_reserved_bytes": mem["reserved"],
                        "torch_peak_bytes": mem["peak"], "torch_inactive_split_bytes": 0}

        loop = Loop(None, None, record_dir=None, device="cpu", gpu_index=0, memory_limit=CAP, precision="bf16",
                    allow_bf16=False, label="Hugging Face Trainer")
        loop.session, loop.bus = object(), bus  # decide() needs a session; nothing is sampled
        loop.largest, loop.restart_cost_s = BATCH, None
        src = LiveSource(bus, [GpuMeta(0, "sim", TOTAL, mem_limit_bytes=CAP)], interval_s=0.1)

        def plan_of(g):
            p = loop.next_plan()
            return None if p is None else p.scored()

        scorer = LiveScorer(src, load_model(), bus, plan_of, hz=5.0)
        guard = Guard(bus, GuardConfig(), {0: loop}, scorer.model.threshold, rescore=scorer.rescore,
                      limits={0: CAP}, estimate=scorer.estimate, clock=clock.monotonic)
        scorer.on_risk = guard.on_risk
        loop.guard = guard
        cb = GpuwatchCallback(record_dir=None)
        cb.loop, cb.splitting, cb.base_batch = loop, True, BATCH
        args = SimpleNamespace(per_device_train_batch_size=BATCH, gradient_accumulation_steps=1, world_size=1)
        state = SimpleNamespace(global_step=0, max_steps=steps, num_input_tokens_seen=0, log_history=[])
        control = SimpleNamespace(should_save=False, should_training_stop=False)
        tick = [0]

        def sample() -> None:  # one sampler tick: the GPU's memory as torch's cache holds it
            tick[0] += 1
            used = mem["reserved"] + GiB // 2
            bus.ticks.append(Tick(tick[0], clock.time_ns() // 1000, [
                {"ts": clock.time_ns() // 1000, "gpu": 0, "gpu_mem_used_bytes": used, "gpu_mem_total_bytes": TOTAL,
                 "gpu_mem_reserved_bytes": 0, "gpu_util_pct": 100.0}]))

        sample()
        decisions: list[dict] = []
        cb._decide(args, state, control)  # on_train_begin's decision for the first step
        for i in range(steps):
            cb.on_step_begin(args, state, control)
            s = seq_at(i)
            m = cb.micro or BATCH
            k = math.ceil(BATCH / m)
            dt = 0.02 + 0.004 * k + 2.5e-6 * BATCH * s
            for _ in range(2):  # the step runs; the sampler ticks and the scorer scores the plan shown meanwhile
                clock.t += dt / 2
                sample()
                scorer.score_once()
            mem["peak"] = WEIGHTS + (HELD if k > 1 else 0) + PER_TOKEN * m * s
            mem["reserved"] = max(mem["reserved"], int(mem["peak"] * 1.03))
            state.global_step += 1
            state.num_input_tokens_seen += BATCH * s
            cb.on_step_end(args, state, control)
            decisions.append({"step": i, "micro": cb.micro, **(guard.last_decision.get(0) or {})})
            clock.t += 0.001
    return {"decisions": _plain(decisions), "events": _plain([{k: v for k, v in e.row().items() if k != "ts"}
                                                              for e in bus.events.latest(10_000)]),
            "steps": _plain([{k: v for k, v in r.items() if k != "ts"} for r in bus.steps.latest(10_000)]),
            "risk": _plain([{k: v for k, v in r.items() if k != "ts"} for r in bus.risk.latest(10_000)])}


def _plain(x: Any) -> Any:
    """JSON's view (what the recorded run is kept as), floats to 12 significant digits."""
    def fix(v):
        if isinstance(v, float):
            return v if not math.isfinite(v) else float(f"{v:.12g}")
        if isinstance(v, dict):
            return {str(k): fix(u) for k, u in v.items()}
        if isinstance(v, (list, tuple)):
            return [fix(u) for u in v]
        return v
    return fix(json.loads(json.dumps(x, default=str)))
