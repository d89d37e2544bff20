"""The guard library benchmark's scenarios on a CPU, with simulated device memory: which step OOMs under
the guard, and why the guard did not split it. No GPU, no model, seconds. The tests pin its findings
(tests/test_guard_oom_causes.py, test_guard_fragment.py); `benchmarks/guard_sim.py` prints them:

    python3 benchmarks/guard_sim.py [--scenario ramp-loop|ramp-hf|fragment|all] [--json OUT] [-v]

The real `GuardedLoop` (its decide / apply / OOM recovery), the real `Guard` and `Policy`, and the real
peak estimator (`gpuwatch.predict.peak.forecast`, what the live scorer's `peak_cross_p` and
`next_peak_est_frac` come from) run; only the memory is simulated, with the H200 calibration of call 23
(benchmarks/results/guard-library-call23.json): weights + AdamW state stay allocated, a step's peak is
that + the gradients + bytes-per-token x the micro-batch's tokens, torch's caching allocator keeps what
a step reserved, a step fails when its peak (plus, in `fragment`, the holes the odd-sized buffers leave)
exceeds the cap. The risk is the shipped composite's estimator part (p x 0.5 / 0.6; the classifier,
which never alarms alone, is left out). The scorer thread is modelled as one scoring round after each
step, of the plan the loop shows then (the step that just ran), as `GuardedLoop.next_plan` does live.

Prints, for every OOM, the decision the guard took before that step and its figures.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from gpuwatch.control.guard import Guard
from gpuwatch.control.policy import GuardConfig
from gpuwatch.integrations.hf import next_seq_estimate
from gpuwatch.integrations.loop import GuardedLoop
from gpuwatch.predict.peak import forecast, usable_limit
from gpuwatch.telemetry.bus import Bus

# call 23 (H200, the 168M-parameter Llama of benchmarks/guard_library.py)
PARAMS = 168_313_856
WEIGHTS = 4 * PARAMS
ADAM = 2 * WEIGHTS
GRADS = WEIGHTS
PER_TOKEN = 646_920
CAP = 25_723_368_960
FIT_TOKENS = 32 * 1024
T_EST = 0.6  # the estimator's operating point when the ramps were diagnosed (call 23's manifest)
# call 25 (the calibration since: a step's peak = intercept + bytes-per-token x tokens, the cap so that 32k
# tokens peak at 90 %; benchmarks/results/guard-library-call25.json) and today's manifest: p >= 0.8
CAP25 = 31_511_293_155
PER_TOKEN25 = 781_709
T_EST25 = 0.8


class SimLoop(GuardedLoop):
    """`GuardedLoop` with its device memory simulated (no session: the test drives the scorer)."""

    def __init__(self, frag: float = 0.0, seed: int = 0, cap: int = CAP, per_token: int = PER_TOKEN,
                 held=None, tps: float | None = None, **kw):
        """`held(i)`: bytes the loop keeps alive for three steps from step i on (the fragment scenario's
        odd-sized buffers); `tps`: tokens/s, the steps' recorded time (else the wall time of the simulation)."""
        super().__init__(None, None, record_dir=None, device="cpu", gpu_index=0, **kw)
        self.cap, self.per_token, self.held, self.tps = cap, per_token, held, tps
        self.t_est = T_EST if cap == CAP else T_EST25
        self.live: list[int] = []
        self.before_run = None  # called before a step runs (a scoring round during the step)
        self.session = object()  # decide() needs one; nothing is sampled
        self.bus = Bus()
        self.alloc = WEIGHTS  # AdamW's state comes with the first step
        self.reserved = WEIGHTS
        self.peak = WEIGHTS
        self.frag = frag
        self.excess = 0.0  # reserved that no step can use (holes between odd-sized blocks)
        self.expandable = False
        self.rng = random.Random(seed)
        self.peek: int | None = None  # Hugging Face: the guard is told the last step's length, not this one's
        self.fail_log: list[dict] = []
        self._attempt_step = -1

    def next_plan(self):
        p = super().next_plan()
        if p is not None and self.peek is not None:
            from dataclasses import replace

            p = replace(p, seq_len=self.peek)
        return p

    def accepts(self):
        return super().accepts() | {"release_cache", "name_leak"}

    def _apply_pending(self):
        with self._lock:
            rel = [a for a, _ in self._pending if a.kind == "release_cache"]
        if rel:
            self.reserved, self.excess = self.alloc, 0.0  # empty_cache
            self.expandable = self.expandable or bool(rel[0].value)
        super()._apply_pending()

    def _mem(self) -> dict[str, Any]:
        return {"torch_allocated_bytes": self.alloc, "torch_reserved_bytes": self.reserved,
                "torch_peak_bytes": self.peak}

    def _record(self, n, s, micro, k, loss, dt):
        super()._record(n, s, micro, k, loss, n * s / self.tps if self.tps else dt)

    def _run(self, batch, k, loss_fn):
        if self.before_run is not None:
            self.before_run()
        n = batch.shape[0]  # what GuardedLoop.step reads as the batch's rows
        micro = -(-n // k)
        s = batch.shape[1]
        if self.held is not None and self._attempt_step != self.steps:  # once per step, not per retry
            self._attempt_step = self.steps
            self.live = (self.live + [self.held(self.steps)])[-3:]
        kept = sum(self.live)
        base = WEIGHTS + ADAM + kept
        peak = base + GRADS + self.per_token * micro * s
        holes = self.excess
        CAP = self.cap  # noqa: N806
        if peak + holes > CAP:
            self.fail_log.append({"peak": peak, "holes": holes})
            self.reserved, self.excess = self.alloc, 0.0  # the OOM path empties the cache
            raise torch.OutOfMemoryError(f"CUDA out of memory (simulated: peak {peak / 2**30:.2f} GiB"
                                         f" + holes {holes / 2**30:.2f} GiB > cap {CAP / 2**30:.2f} GiB)")
        if self.frag:  # each step's odd-sized buffers leave holes; expandable segments merge most of them
            self.excess += self.frag * CAP * self.rng.random() * (0.2 if self.expandable else 1.0)
        self.alloc, self.peak = WEIGHTS + ADAM + kept, peak
        self.reserved = max(self.reserved, peak + holes)
        return 1.0


def features_for(loop: SimLoop, plan: dict) -> tuple[float, list, dict]:
    """What the live scorer computes for `plan` from the loop's steps rows: the estimator's part."""
    rows = loop.bus.steps.latest(len(loop.bus.steps))[-64:]
    if not rows:
        return 0.0, [], {}
    col = lambda k: np.array([float(r[k]) if r[k] is not None else np.nan for r in rows])  # noqa: E731
    fc = forecast(col("batch"), col("seq_len"), col("micro_batches"), [r["precision"] for r in rows],
                  col("torch_allocated_bytes"), col("torch_peak_bytes"), col("step_time_s"), float(plan["batch"]),
                  float(plan["seq_len"]), plan.get("precision"), usable_limit(loop.cap))
    last = rows[-1]
    a = col("torch_allocated_bytes")[-11:]
    f = {"mem_used_frac": last["torch_reserved_bytes"] / loop.cap,
         "torch_reserved_gap_frac": (last["torch_reserved_bytes"] - last["torch_allocated_bytes"]) / loop.cap,
         "alloc_growth_frac_per_step": float(np.median(np.diff(a))) / loop.cap if a.size >= 2 else 0.0,
         "plan_growth": plan["batch"] * plan["seq_len"] / max(1.0, last["batch"] / last["micro_batches"] * last["seq_len"])}
    if fc is None:
        return 0.0, [], f
    f.update(next_peak_est_frac=fc.mean / fc.limit, peak_cross_p=fc.p_horizon)
    risk = min(1.0, fc.p_horizon * 0.5 / loop.t_est)
    return risk, ([("peak_cross_p", risk)] if risk >= 0.25 else []), f


def run(batches: list[tuple[int, int]], frag: float = 0.0, cfg: GuardConfig | None = None, step_s: float = 0.26,
        verbose: bool = False, peek_last: bool = False, guard_on: bool = True) -> dict:
    """`peek_last`: the guard decides on the last step's sequence length (the Hugging Face callback
    decides at the end of a step, before the Trainer fetched the next batch)."""
    clock = [0.0]
    loop = SimLoop(frag=frag)
    guard = Guard(loop.bus, cfg or GuardConfig(), {0: loop}, threshold=0.5,
                  rescore=lambda g, plan: features_for(loop, plan), clock=lambda: clock[0], limits={0: CAP})
    loop.guard = guard if guard_on else None
    decisions: list[dict] = []
    ooms: list[dict] = []
    seen = 0
    for i, (b, s) in enumerate(batches):
        x = torch.zeros(b, s, dtype=torch.long)
        n_ev = len(loop.bus.events)
        before = {"allocated": loop.alloc, "reserved": loop.reserved}
        if peek_last and i:  # as GpuwatchCallback._peek_seq estimates it
            loop.peek = next_seq_estimate([bs[1] for bs in batches[max(0, i - 5):i]])
        loop.step(x, lambda mb: torch.zeros(()))
        evs = loop.bus.events.latest(len(loop.bus.events) - n_ev) if len(loop.bus.events) > n_ev else []
        acts = [e.detail.get("action") for e in evs if e.kind == "guard_action"]
        d = dict(guard.last_decision.get(0, {})) if guard_on else {}
        for e in evs:
            if e.kind == "oom":
                ooms.append({"step": i, "batch": b, "seq_len": s, "tokens": b * s, "micro": e.detail.get("batch"),
                             "larger_than_seen": b * s > seen, "actions_before": acts, **before,
                             "guard": d, "why": e.detail.get("error")})
        seen = max(seen, b * s)
        decisions.append({"step": i, "tokens": b * s, "actions": acts, "ceiling": loop.ceiling})
        clock[0] += step_s
        if loop.should_stop:
            break
        plan = loop.next_plan()  # one scoring round after the step, as the scorer thread does
        if plan is not None:
            r, why, f = features_for(loop, plan.scored())
            guard.on_risk(0, r, why, f, plan.scored(), False)
        if verbose:
            print(i, b, s, acts, loop.ceiling, [round(o["tokens"]) for o in ooms if o["step"] == i])
    return {"ooms": len(ooms), "oom_rows": ooms, "steps": loop.steps,
            "actions": [(d["step"], a) for d in decisions for a in d["actions"]],
            "micro_batches_max": max((r["micro_batches"] for r in loop.bus.steps.latest(len(loop.bus.steps))), default=0)}


def ramp_loop(n: int = 60) -> list[tuple[int, int]]:
    """The library benchmark's ramp-loop (support/library_scenarios.py) on the H200's calibration: batch 16, lengths up to ~2x the cap."""
    r = random.Random(1)
    s1 = int(2 * FIT_TOKENS / 16)
    s0 = max(16, s1 // 8)
    return [(16, max(8, int((s0 + (s1 - s0) * i / (n - 1)) * r.uniform(0.8, 1.0)))) for i in range(n)]


def ramp_hf(n: int = 30) -> list[tuple[int, int]]:
    r = random.Random(3)
    s1 = int(2 * FIT_TOKENS / 16)
    return [(16, s) for s in sorted(max(8, int((s1 // 8 + (s1 - s1 // 8) * i / (n - 1)) * r.uniform(0.8, 1.0)))
                                    for i in range(n))]


def fragment(n: int = 60) -> list[tuple[int, int]]:
    r = random.Random(2)
    smax = int(0.85 * FIT_TOKENS / 8)
    return [(8, r.randint(smax // 4, smax)) for _ in range(n)]


def held_bytes(i: int, mib: int = 2**20) -> int:
    """The library benchmark's fragment scenario (calls 25 and 28): the six odd-sized buffers of step i."""
    rr = random.Random(1000 + i)
    return sum(rr.randint(1, 48) * mib + rr.randint(0, 4095) for _ in range(6))


def fragment_false_alarm(steps: int = 6, tps: float = 200e3, rescore_smaller: bool = True) -> dict:
    """The guarded fragment arm's first steps on calls 25/28 (cap 31.5 GB, 781,709 bytes a token, the lengths
    of random.Random(2) up to 0.85 x 32k tokens / 8, the buffers held three steps), the scorer scoring the
    plan the loop shows during each step (that step's row not yet in its window), the steps' time at `tps`
    tokens/s (the healthy scenario's H200 rate, call 23: 223k). Returns the guard's actions by step and the
    estimator's figures of each round. `rescore_smaller=False`: without GuardedLoop's re-scoring of a plan
    smaller than the one the alarm was scored for (calls 25 and 28 ran without it)."""
    clock = [0.0]
    loop = SimLoop(cap=CAP25, per_token=PER_TOKEN25, held=held_bytes, tps=tps, precision="bf16", allow_bf16=False)
    guard = Guard(loop.bus, GuardConfig(), {0: loop}, threshold=0.5,
                  rescore=lambda g, plan: features_for(loop, plan), clock=lambda: clock[0], limits={0: CAP25})
    loop.guard = guard
    if not rescore_smaller:
        loop._rescore_smaller_plan = lambda: None
    rounds: list[dict] = []

    def score():  # one round of the scorer thread, during the step
        plan = loop.next_plan()
        r, why, f = features_for(loop, plan.scored())
        guard.on_risk(0, r, why, f, plan.scored(), False)
        rounds.append({"step": loop.steps, "plan_tokens": plan.tokens, "risk": round(r, 3),
                       "peak_cross_p": round(f.get("peak_cross_p", 0.0), 3),
                       "next_peak_est_frac": round(f.get("next_peak_est_frac", 0.0), 3)})
    loop.before_run = score
    smax = int(0.85 * FIT_TOKENS / 8)
    r = random.Random(2)
    lens = [r.randint(smax // 4, smax) for _ in range(steps)]
    acts = []
    for i, s in enumerate(lens):
        n_ev = len(loop.bus.events)
        loop.step(torch.zeros(8, s, dtype=torch.long), lambda mb: torch.zeros(()))
        evs = loop.bus.events.latest(len(loop.bus.events) - n_ev) if len(loop.bus.events) > n_ev else []
        acts += [{"step": i, "action": e.detail.get("action"), "value": e.detail.get("value"), "message": e.message}
                 for e in evs if e.kind == "guard_action"]
        clock[0] += 8 * s / tps
    return {"seq_lens": lens, "actions": acts, "rounds": rounds, "ooms": loop.ooms}


SCENARIOS = {"ramp-loop": (ramp_loop, 0.0, False), "ramp-hf": (ramp_hf, 0.0, True), "fragment": (fragment, 0.02, False)}
