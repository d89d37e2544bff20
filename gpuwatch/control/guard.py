"""The guard: turns the live risk into actions on the workload before the failing step.

Two threads meet here. The scorer thread calls `on_risk` about ten times a second with each GPU's
risk, reasons and features (and, at an alarm's onset, asks the workload for an allocator snapshot).
The workload thread calls `before_step` between steps: the policy decides on the latest risk, and
when the schedule's plan changed since that risk was scored (a ramp's step up), the plan is scored
again right there, so a step the model says will fail is refused before it runs. Actions go through
the workload's controls (who="guard", why=...), and each is a `guard_action` event with the risk
and the figures behind it. `observe` mode logs what it would do and acts on nothing. A failure that
happens anyway is a `guard_miss` (and, for the reactive rules, their retry decision).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable

from gpuwatch.control import WorkloadControls
from gpuwatch.control.policy import NONE, Action, GuardConfig, Observation, Policy


class Guard:
    def __init__(self, bus, cfg: GuardConfig, workloads: dict[int | None, WorkloadControls], threshold: float,
                 rescore: Callable[[int | None, dict], tuple[float, list, dict]] | None = None,
                 snapshot_dir: Callable[[], Path | None] | None = None, clock=time.monotonic,
                 limits: dict[int | None, int | None] | None = None) -> None:
        self.bus, self.cfg, self.threshold = bus, cfg, threshold
        self.limits = limits or {}
        self.workloads = workloads
        self.rescore = rescore
        self.snapshot_dir = snapshot_dir or (lambda: None)
        self.clock = clock
        self.policies = {g: Policy(cfg) for g in workloads}
        self._latest: dict[int | None, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self.actions = 0
        self.misses = 0

    @property
    def acting(self) -> bool:
        return self.cfg.mode == "on"

    def set_mode(self, mode: str) -> None:
        """on / observe / off at run time (the dashboard's G key); off keeps scoring, acts on nothing
        and logs nothing."""
        from dataclasses import replace

        if mode != self.cfg.mode:
            self.cfg = replace(self.cfg, mode=mode)
            self.bus.emit("guard_override", f"guard switched to {mode}", who="user", mode=mode)

    # -- the scorer thread -----------------------------------------------------------------------------
    def on_risk(self, gpu: int | None, risk: float, reasons: list, feats: dict[str, float],
                plan: dict | None, onset: bool) -> None:
        with self._lock:
            self._latest[gpu] = {"risk": risk, "reasons": reasons, "features": feats, "plan": plan}
        w = self.workloads.get(gpu)
        if onset and w is not None and hasattr(w, "request_snapshot"):
            w.request_snapshot(self.snapshot_dir(), f"risk {risk:.2f}")

    # -- the workload thread ---------------------------------------------------------------------------
    def before_step(self, w) -> None:
        if self.cfg.mode == "off":
            return
        gpu = w.cfg.gpu_index
        with self._lock:
            latest = dict(self._latest.get(gpu) or {})
        plan = w.plan_info()
        if plan is None or not latest:
            return
        if self.rescore is not None and latest.get("plan") and _tokens(plan) > _tokens(latest["plan"]):
            risk, reasons, feats = self.rescore(gpu, plan)  # the plan stepped up since it was scored
            latest.update(risk=risk, reasons=reasons, features=feats, plan=plan)
        obs = self._observe(w, plan, latest)
        act = self.policies[gpu].decide(obs)
        if act.kind != "none":
            self._apply(w, act, obs)

    def _observe(self, w, plan: dict, latest: dict) -> Observation:
        last = getattr(w, "last", None) or {}
        limit = self.limits.get(w.cfg.gpu_index)
        act_frac = 0.0
        if limit and last.get("torch_peak_bytes") is not None and last.get("torch_allocated_bytes") is not None:
            act_frac = max(0.0, last["torch_peak_bytes"] - last["torch_allocated_bytes"]) / limit
        wanted = w.schedule.wanted()
        return Observation(
            now_s=self.clock(), risk=latest.get("risk"), threshold=self.threshold,
            planned_batch=wanted[0] if wanted else plan["batch"],
            last_batch=getattr(w, "last_ok_batch", None), ceiling=w.ceiling, precision=w.precision,
            bf16_ok=getattr(w, "bf16_supported", True), act_frac=act_frac, features=latest.get("features") or {},
            reasons=latest.get("reasons") or [])

    def _apply(self, w, act: Action, obs: Observation) -> None:
        self.actions += 1
        gpu = w.cfg.gpu_index
        verb = "would " if not self.acting else ""
        self.bus.emit("guard_action", f"{verb}{act.kind.replace('_', ' ')}: {act.why}", "warning", gpu=gpu,
                      action=act.kind, value=act.value, rule=self.cfg.rule, mode=self.cfg.mode,
                      risk=obs.risk, threshold=obs.threshold, reasons=obs.reasons[:3],
                      planned_batch=obs.planned_batch, ceiling=obs.ceiling, precision=obs.precision,
                      mem_used_frac=obs.features.get("mem_used_frac"),
                      next_peak_est_frac=obs.features.get("next_peak_est_frac"))
        if not self.acting:
            return
        if act.kind in ("lower_ceiling", "raise_ceiling"):
            w.set_ceiling(act.value, who="guard", why=act.why)
        elif act.kind == "clear_ceiling":
            w.set_ceiling(None, who="guard", why=act.why)
        elif act.kind == "refuse_step":  # one control: a separate ceiling would be overridden by the hold
            w.hold(who="guard", why=act.why, batch=act.value)
        elif act.kind == "precision":
            w.set_precision(act.value, who="guard", why=act.why)

    def after_oom(self, w, batch: int, micro: int) -> tuple[str, int] | None:
        """A failure the guard did not prevent: recorded as a miss; a reactive rule decides the retry."""
        gpu = w.cfg.gpu_index
        react = self.policies[gpu].after_oom(batch, micro) if self.acting and not getattr(w, "manual", False) else None
        if self.cfg.rule in ("model", "fixed"):
            self.misses += 1
            with self._lock:
                latest = self._latest.get(gpu) or {}
            self.bus.emit("guard_miss", f"OOM at batch {micro} not prevented by the guard ({self.cfg.rule}, "
                                        f"last risk {latest.get('risk', float('nan')):.2f})", "error", gpu=gpu,
                          rule=self.cfg.rule, risk=latest.get("risk"), batch=micro)
        return react


def _tokens(plan: dict) -> float:
    return float(plan.get("batch") or 0) * float(plan.get("seq_len") or 0)


__all__ = ["Guard", "GuardConfig", "NONE"]
