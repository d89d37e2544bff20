"""The guard: turns the live risk into actions on a workload before the failing step.

Two threads meet here. The scorer thread calls `on_risk` several times a second with each GPU's risk,
reasons and features (and, at an alarm's onset, asks the workload for an allocator snapshot). The
workload's thread calls `before_step` between steps: the policy decides on the latest risk, and when
the workload's plan grew since that risk was scored (a ramp's step up, a longer batch from the user's
loader), the plan is scored again right there, so a step the model says will fail is refused before
it runs. The guard talks to a workload only through `gpuwatch.contract` (`next_plan`,
`guard_view`, `accepts`, `apply`): gpuwatch's DeepSeek workload and a user's loop alike.

Each action is a `guard_action` event with the risk and the figures behind it. `observe` mode logs
what it would do (once while the same decision repeats) and acts on nothing. A failure that happens anyway is a `guard_miss`. Every state in
which the guard cannot act (no risk to act on, batch at its floor, no lower precision, observe) is a
`guard_unable` event, said once per state with what would help, never once per step.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from gpuwatch.contract import NONE, Action, GuardedWorkload, GuardMode, StepPlan, WorkloadView
from gpuwatch.control.planner import Decision, Estimate, Planner
from gpuwatch.control.policy import GuardConfig, Observation, Policy
from gpuwatch.predict.ahead import RISK_NEXT
from gpuwatch.predict.peak import FIRST_STEP_BASE, USABLE, usable_limit

# the planner's "keep" stands without weighing again (Guard._still_kept) while the coming steps are this far from
# the usable limit (its estimate + 1 sigma, and the scorer's), grow at most this much in tokens, for this many steps
PLAN_FAR = 0.8
PLAN_GROWTH = 1.1
PLAN_EVERY = 4
WOULD_QUIET_S = 30.0  # observe mode: the same would-be action is said again after this long without it


class Guard:
    def __init__(self, bus, cfg: GuardConfig, workloads: dict[int | None, GuardedWorkload], threshold: float,
                 rescore: Callable[[int | None, dict], tuple[float, list, dict]] | None = None,
                 snapshot_dir: Callable[[], Path | None] | None = None, clock=time.monotonic,
                 limits: dict[int | None, int | None] | None = None, unable: str | None = None,
                 estimate: Callable[[int | None, list], list] | None = None) -> None:
        """`unable`: why this guard can never act in this session (no GPU, no risk model): said once.
        `estimate(gpu, [(Config, seq_len), ...])`: the estimator's (mean, sigma) peak per configuration as a
        share of the usable limit (predict/plans.py) - with it the planner decides (control/planner.py)."""
        self.bus, self.cfg, self.threshold = bus, cfg, threshold
        self.limits = limits or {}
        self.workloads = workloads
        self.rescore = rescore
        self.snapshot_dir = snapshot_dir or (lambda: None)
        self.clock = clock
        self.policies = {g: Policy(cfg) for g in workloads}
        self.estimate = estimate
        self.planners = {g: Planner(cfg.planner) for g in workloads}
        self._kept_at_alarm: dict[int | None, bool] = {}
        self._last_plan: dict[int | None, tuple[Decision | None, int, int]] = {}  # the planner's last word, its plan's
        # tokens and the step it was given at (`_still_kept`)
        self._latest: dict[int | None, dict[str, Any]] = {}
        self._first_scored: set[int | None] = set()  # GPUs whose first step the guard scored itself
        self._lock = threading.Lock()
        self._said: dict[int | None, set[str]] = {}
        # observe mode: the would-be action said last and when it was last decided (`_say_once`)
        self._would: dict[int | None, tuple[tuple[str, Any], float]] = {}
        self.unable = unable
        self.actions = 0
        self.misses = 0
        self.stopped: dict[int | None, str] = {}  # workloads the guard stopped, and why
        self._alloc: dict[int | None, tuple[int | None, int]] = {}  # last allocated seen, steps it rose in a row
        # per workload: the figures of the last decision (before_step), for an OOM's diagnosis
        self.last_decision: dict[int | None, dict[str, Any]] = {}
        if unable:
            for g in workloads:
                self._unable(g, "session", f"guard {cfg.mode} but it cannot act: {unable}", _help_for(unable))
        elif cfg.mode == "observe":
            for g in workloads:
                self._unable(g, "observe", "guard in observe mode: it logs what it would do and acts on nothing",
                             "--guard on (or G in the dashboard) to let it act")

    @property
    def acting(self) -> bool:
        return self.cfg.mode == "on"

    def set_mode(self, mode: GuardMode) -> None:
        """on / observe / off at run time (the dashboard's G key); off keeps scoring, acts on nothing
        and logs nothing."""
        if mode != self.cfg.mode:
            self.cfg = replace(self.cfg, mode=mode)
            self.bus.emit("guard_override", f"guard switched to {mode}", who="user", mode=mode)
            for said in self._said.values():
                said.discard("observe")
            self._would.clear()

    # -- the scorer thread -----------------------------------------------------------------------------
    def on_risk(self, gpu: int | None, risk: float, reasons: list, feats: dict[str, float],
                plan: dict | None, onset: bool) -> None:
        with self._lock:  # the next step's risk: a step planned further ahead is refused when it is next
            self._latest[gpu] = {"risk": feats.get(RISK_NEXT, risk), "reasons": reasons, "features": feats, "plan": plan}
        w = self.workloads.get(gpu)
        if onset and w is not None:
            w.request_snapshot(self.snapshot_dir(), f"risk {risk:.2f}")

    def latest_risk(self, gpu: int | None) -> dict[str, Any] | None:
        """The scorer's latest figures for one GPU (risk, reasons, features, plan), or None."""
        with self._lock:
            got = self._latest.get(gpu)
            return dict(got) if got else None

    # -- the workload thread ---------------------------------------------------------------------------
    def before_step(self, w: GuardedWorkload, worst: dict[str, Any] | None = None) -> Action:
        """Decide before the workload's next step; the action (if any) has been handed to `w.apply`.
        Returns it, or NONE. `worst`: a data-parallel job's riskiest other rank (its `rank`, `gpu`, `risk`,
        `reasons`, `features` and `view`, its memory figures): where its risk is above this workload's own,
        the decision is made on that rank's figures (the job's one decision, applied by every rank)."""
        if self.cfg.mode == "off" or self.unable:
            return NONE
        gpu = w.gpu_index
        with self._lock:
            latest = dict(self._latest.get(gpu) or {})
        rank = None
        if worst and worst.get("risk") is not None and (latest.get("risk") is None or worst["risk"] > latest["risk"]):
            rank = worst.get("rank")
            latest = {k: worst.get(k) for k in ("risk", "reasons", "features", "plan")}
        plan = w.next_plan()
        d: dict[str, Any] = {"plan": None if plan is None else plan.scored(), "risk": None, "action": "none"}
        self.last_decision[gpu] = d
        if plan is not None and not latest and rank is None and self.rescore is not None and gpu not in self._first_scored:
            # nothing scored on this GPU yet - the first step can start before the scorer's first round, and
            # the first step is where the shape library speaks (predict/prior.py): score its plan now, once
            # (kept as the latest until the scorer's own rounds replace it; a failure is no decision, not a crash)
            self._first_scored.add(gpu)
            try:
                risk, reasons, feats = self.rescore(gpu, plan.scored())
            except Exception as e:  # noqa: BLE001 - the guard must never take the run down
                self.bus.emit("guard_unable", f"could not score the first step: {type(e).__name__}: {e}", "warning", gpu=gpu)
            else:
                latest = {"risk": feats.get(RISK_NEXT, risk), "reasons": reasons, "features": feats, "plan": plan.scored()}
                with self._lock:
                    self._latest.setdefault(gpu, latest)
        if plan is None or not latest:
            d["why_none"] = "no plan" if plan is None else "no risk scored yet"
            return NONE
        view = w.guard_view()
        if view.manual:
            d["why_none"] = "manual"
            self._would.pop(gpu, None)
            return NONE
        theirs: dict[str, Any] = worst or {}  # (a rank is set only from `worst`)
        if rank is not None:  # the other rank's GPU and memory figures
            view = replace(view, gpu=theirs.get("gpu"), **{k: v for k, v in (theirs.get("view") or {}).items()
                                                           if hasattr(view, k)})
            d["rank"] = rank
        rescored = False
        score_gpu = gpu if rank is None else theirs.get("gpu")
        if self.rescore is not None and (rank is None or score_gpu is not None) and self._worth_rescoring(plan, latest):
            risk, reasons, feats = self.rescore(score_gpu, plan.scored())  # the plan stepped up since it was scored
            latest.update(risk=feats.get(RISK_NEXT, risk), reasons=reasons, features=feats, plan=plan.scored())
            rescored = True
        obs = self._observe(w, plan, view, latest)
        obs.fresh = rescored or latest.get("plan") == plan.scored()
        obs.alloc_rising_steps = self._rising(gpu if rank is None else ("rank", rank), view)
        obs.decision = self._plan(w, plan, view, obs, score_gpu)
        act = self.policies[gpu].decide(obs)
        if obs.decision is not None:
            d["plan_decision"] = obs.decision.why
        f = obs.features
        d.update(risk=obs.risk, rescored=rescored, scored_plan=latest.get("plan"), action=act.kind, why=act.why,
                 peak_cross_p=f.get("peak_cross_p"), next_peak_est_frac=f.get("next_peak_est_frac"),
                 mem_used_frac=f.get("mem_used_frac"), torch_reserved_gap_frac=f.get("torch_reserved_gap_frac"),
                 limit_bytes=self.limits.get(view.gpu), cooldown_left_s=self.policies[gpu].cooldown_left(obs.now_s),
                 fresh=obs.fresh, frag_frac=obs.frag_frac, value=act.value)
        lim = self.limits.get(view.gpu)
        est = d["next_peak_est_frac"]
        if lim and est is not None and est == est and abs(est) < 1e6:
            u = _usable(lim, f)
            d.update(usable_limit_bytes=int(u), predicted_peak_bytes=int(est * u))
        if act.kind == "unable":
            self._would.pop(gpu, None)
            self._unable(gpu, act.why.split(";")[-1].strip(), f"guard cannot act: {act.why}", act.value, obs)
            return NONE
        if act.kind != "none":
            if self._say_once(gpu, act, obs.now_s):
                self._apply(w, act, obs, rank)
            return act
        return NONE

    def _say_once(self, gpu: int | None, act: Action, now_s: float) -> bool:
        """Whether to apply (or, observing, say) `act`. Acting: always. Observing, nothing changes after a "would", so
        the same decision comes every step (s50's Lightning observe arm: 108 "would plan" events in 150 steps; the
        near-cap sets: 41 "would release cache" in a row): said once while it keeps coming - another decision, WOULD_QUIET_S
        without it (a policy's cooldown decides none between), an OOM, a manual step, an unable state or a mode
        switch ends that."""
        if self.acting:
            return True
        key, last = (act.kind, act.value), self._would.get(gpu)
        self._would[gpu] = (key, now_s)
        return not (last is not None and last[0] == key and now_s - last[1] < WOULD_QUIET_S)

    def _plan(self, w: GuardedWorkload, plan: StepPlan, view: WorkloadView, obs: Observation,
              gpu: int | None) -> Decision | None:
        """The planner's decision where it can make one: the model rule, an estimator, a workload that takes
        a `plan`. A decision to keep the configuration at the classifier's alarm is said once per alarm."""
        if self.estimate is None or self.cfg.rule != "model" or not self.cfg.plan or "plan" not in w.accepts():
            return None

        def ask(asks):
            return [None if e is None else Estimate(*e) for e in self.estimate(gpu, list(asks))]

        kept = self._still_kept(w.gpu_index, plan, view, obs)
        if kept is not None:
            return kept
        try:
            dec = self.planners[w.gpu_index].decide(plan, view, ask, obs.risk, obs.threshold, self.cfg.clear_ratio)
            self._last_plan[w.gpu_index] = (dec, plan.tokens, view.steps)
        except Exception as e:  # noqa: BLE001 - the guard must never take the run down: the threshold rule decides
            self._unable(w.gpu_index, "planner", f"the planner failed ({type(e).__name__}: {e}); the threshold rule "
                         "decides", None)
            return None
        alarm = obs.risk is not None and obs.risk >= obs.threshold
        if dec is not None and not dec.change and alarm and not self._kept_at_alarm.get(w.gpu_index):
            self.bus.emit("guard_plan", f"configuration kept at the classifier's alarm (risk {obs.risk:.2f}): "
                          f"{dec.why}", gpu=w.gpu_index, chosen=dec.chosen.summary(), current=dec.current.summary(),
                          weighed=[x.summary() for x in dec.weighed], risk=obs.risk, change=False)
        self._kept_at_alarm[w.gpu_index] = alarm and dec is not None and not dec.change
        return dec

    def _still_kept(self, gpu: int | None, plan: StepPlan, view: WorkloadView, obs: Observation) -> Decision | None:
        """The planner's last "keep", reused without weighing again, where nothing it weighs can have moved:
        the same configuration, no alarm, its own estimate and the scorer's both under PLAN_FAR of the usable
        limit, the plan's tokens grown by at most PLAN_GROWTH since, and fewer than PLAN_EVERY steps ago.
        Weighing costs ~2 ms of Python a step (the estimate over the window, the pace fits): most of the
        guard's cost where nothing is wrong. The step is still learned (its time and length)."""
        last = self._last_plan.get(gpu)
        if last is None:
            return None
        dec, tokens, at = last
        if dec is None or dec.change:
            return None
        cur = dec.current
        est = obs.features.get("next_peak_est_frac")
        if (obs.risk is None or obs.risk >= obs.threshold * self.cfg.clear_ratio
                or cur.config != Planner.current_config(plan)
                or cur.peak is None or cur.peak.mean + cur.peak.sigma >= PLAN_FAR
                or est is None or est != est or est >= PLAN_FAR
                or plan.tokens > PLAN_GROWTH * tokens or view.steps - at >= PLAN_EVERY):
            return None
        self.planners[gpu].observe(view, plan.precision)
        self._kept_at_alarm[gpu] = False
        return dec

    def _worth_rescoring(self, plan: StepPlan, latest: dict) -> bool:
        """Score the grown plan now, in the workload's thread (a few ms), only when it could matter: the
        last estimate of the next peak scaled by the growth (an overestimate: weights do not grow with
        the batch) reaches `rescore_from`, or the risk was already within reach of the alarm. Variable
        sequence lengths grow the plan every other step; most of those steps are far from the limit."""
        old = _tokens(latest.get("plan") or {})
        if not latest.get("plan") or plan.tokens <= old:
            return False
        est = (latest.get("features") or {}).get("next_peak_est_frac")
        risk = latest.get("risk")
        if est is None or est != est or risk is None:
            return True
        return est * plan.tokens / max(1.0, old) >= self.cfg.rescore_from or risk >= 0.5 * self.threshold

    def _rising(self, gpu, view: WorkloadView) -> int | None:
        """In how many steps in a row torch allocated rose (by more than 0.05 % of the limit): a leak
        rises every step, a one-off jump once. None where the workload has no allocator figures."""
        a = view.last_allocated_bytes
        if a is None:
            return None
        prev, n = self._alloc.get(gpu, (None, 0))
        if prev is not None and a != prev:
            limit = self.limits.get(view.gpu) or 0
            n = n + 1 if a - prev > 0.0005 * limit else 0
        self._alloc[gpu] = (a, n)
        return n

    def _observe(self, w: GuardedWorkload, plan: StepPlan, view: WorkloadView, latest: dict) -> Observation:
        limit = self.limits.get(view.gpu)
        act_frac = 0.0
        frag = alloc = None
        first = False
        if limit and view.last_peak_bytes is not None and view.last_allocated_bytes is not None:
            act_frac = max(0.0, view.last_peak_bytes - view.last_allocated_bytes) / limit
            alloc = view.last_allocated_bytes / _usable(limit, latest.get("features") or {})
            if view.last_reserved_bytes is not None:
                frag = max(0.0, view.last_reserved_bytes - view.last_peak_bytes) / limit
        elif (latest.get("features") or {}).get(FIRST_STEP_BASE) is not None:
            # no step has run: what stays allocated is the shape library's weights (features._first_step), so
            # a lowered ceiling is sized to the estimate, not cut by a fixed 20 % (call 38: 192 -> 153 still failed)
            alloc, first = float(latest["features"][FIRST_STEP_BASE]), True
        return Observation(frag_frac=frag, alloc_frac=alloc, first_step=first,
            now_s=self.clock(), risk=latest.get("risk"), threshold=self.threshold,
            planned_batch=plan.wanted_batch or plan.batch, micro_batch=plan.batch, last_batch=view.last_ok_batch,
            ceiling=view.ceiling,
            floor=view.floor, precision=plan.precision, bf16_ok="bf16" in view.lower_precisions,
            lower_precisions=view.lower_precisions, accepts=w.accepts(), act_frac=act_frac,
            features=latest.get("features") or {}, reasons=latest.get("reasons") or [])

    def _apply(self, w: GuardedWorkload, act: Action, obs: Observation, rank: int | None = None) -> None:
        self.actions += 1
        gpu = w.gpu_index
        verb = "would " if not self.acting else ""
        on = f" (rank {rank}'s risk, the highest of the job's ranks)" if rank is not None else ""
        self.bus.emit("guard_action", f"{verb}{act.kind.replace('_', ' ')}: {act.why}{on}",
                      "error" if act.kind == "stop" else "warning", gpu=gpu,
                      action=act.kind, value=act.value, rule=self.cfg.rule, mode=self.cfg.mode,
                      risk=obs.risk, threshold=obs.threshold, reasons=obs.reasons[:3],
                      planned_batch=obs.planned_batch, ceiling=obs.ceiling, precision=obs.precision,
                      mem_used_frac=obs.features.get("mem_used_frac"),
                      next_peak_est_frac=obs.features.get("next_peak_est_frac"),
                      alloc_growth_frac_per_step=obs.features.get("alloc_growth_frac_per_step"),
                      torch_reserved_gap_frac=obs.features.get("torch_reserved_gap_frac"),
                      **({"decided_on_rank": rank} if rank is not None else {}),
                      **(_weighed(obs.decision) if act.kind == "plan" and obs.decision is not None else {}))
        if act.kind == "name_leak":  # naming costs nothing to the run: observe mode does it too
            w.request_snapshot(self.snapshot_dir(), act.why)
        if not self.acting:
            return
        if act.kind == "stop":
            self.stopped[gpu] = act.why
        w.apply(act, who="guard")
        self.policies[gpu].applied(act)

    def cannot_act(self, gpu: int | None, state: str, message: str, helps: str | None) -> None:
        """A workload's own reason the guard cannot act (a loop on the CPU, a framework that cannot change
        its batch): said once per (workload, state), as every such state is."""
        self._unable(gpu, state, message, helps)

    def _unable(self, gpu: int | None, key: str, message: str, helps: str | None, obs: Observation | None = None) -> None:
        """Say once per (workload, state) that the guard cannot act, and what would help."""
        said = self._said.setdefault(gpu, set())
        if key in said:
            return
        said.add(key)
        self.bus.emit("guard_unable", message + (f". What would help: {helps}" if helps else ""), "warning", gpu=gpu,
                      state=key, helps=helps, mode=self.cfg.mode, rule=self.cfg.rule,
                      risk=None if obs is None else obs.risk,
                      precision=None if obs is None else obs.precision)

    def after_oom(self, w: GuardedWorkload, batch: int, micro: int) -> tuple[str, int] | None:
        """A failure the guard did not prevent: recorded as a miss; a reactive rule decides the retry."""
        gpu = w.gpu_index
        self._would.pop(gpu, None)
        manual = w.guard_view().manual
        react = self.policies[gpu].after_oom(batch, micro) if self.acting and not manual else None
        if self.cfg.rule in ("model", "fixed"):
            self.misses += 1
            with self._lock:
                latest = self._latest.get(gpu) or {}
            self.bus.emit("guard_miss", f"OOM at batch {micro} not prevented by the guard ({self.cfg.rule}, "
                                        f"last risk {latest.get('risk', float('nan')):.2f})", "error", gpu=gpu,
                          rule=self.cfg.rule, risk=latest.get("risk"), batch=micro)
        return react


def _weighed(d: Decision) -> dict[str, Any]:
    """A plan's event detail: the configurations weighed, the one kept from and the one chosen."""
    return {"chosen": d.chosen.summary(), "current": d.current.summary(), "weighed": [x.summary() for x in d.weighed],
            "urgent": d.urgent}


def _help_for(unable: str) -> str:
    if "no GPU" in unable:
        return "run on a CUDA GPU (on a CPU there is no device memory to run out of, so nothing to score)"
    if "model" in unable:
        return "a risk model: models/risk.joblib with its manifest, or `gpuwatch train` on your sessions"
    return "see docs/LIBRARY.md"


def _tokens(plan: dict) -> float:
    return float(plan.get("batch") or 0) * float(plan.get("seq_len") or 0)


def _usable(limit: float, features: dict) -> float:
    """The usable limit the scored window's estimates are fractions of (the features' `USABLE`: with the
    window's highest peak), else the limit's rule alone (no step scored yet)."""
    u = features.get(USABLE)
    return float(u) if u is not None and u == u and u > 0 else usable_limit(limit)


__all__ = ["Guard", "GuardConfig", "NONE"]
