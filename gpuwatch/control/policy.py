"""The guard's decisions, pure Python (no torch, no threads): from the risk, its reasons and recent
telemetry to an action on the workload, with hysteresis and a cooldown. Tested on score sequences.

Rules (the same guard runs any of them, so they compare like for like):
- `model` (gpuwatch): when the risk reaches the alarm threshold, refuse a schedule's step up (hold the
  batch that fits), else lower the batch ceiling by `lower_by`; fall back fp32 -> bf16 (or fp16) when
  the batch is at its floor, when memory keeps growing at a fixed batch, or when the estimated saving
  of the precision switch beats that of a smaller batch; raise the ceiling back gradually once the
  risk stays below `clear_ratio` x threshold for `restore_after_s`.
- `fixed`: the common stress-test rule: memory > 90 % of the effective limit halves the batch,
  < 30 % doubles it (never above the schedule's own batch).
- `accelerate`: nothing before a failure; after an OOM, batch x 0.9 and retry the same step
  (accelerate's find_executable_batch_size).
- `composer`: nothing before a failure; after an OOM, halve the micro-batch and re-run the same
  batch (Composer's automatic microbatching).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpuwatch.contract import (GUARD_RULES, NONE, Action, ActionKind, GuardMode, GuardRule, Precision,
                               lower_precisions)
from gpuwatch.control.planner import PlannerConfig


@dataclass(frozen=True)
class GuardConfig:
    mode: GuardMode = "on"  # off | observe (decide and log, act on nothing) | on
    rule: GuardRule = "model"
    lower_by: float = 0.2  # lower the ceiling by this fraction of the current batch
    cooldown_s: float = 2.0  # no second action within this long
    clear_ratio: float = 0.5  # the risk counts as low below threshold x this (hysteresis)
    restore_after_s: float = 15.0  # low this long before the ceiling goes back up
    restore_by: float = 0.125  # each raise: this fraction of the schedule's own batch
    fixed_high: float = 0.90
    fixed_low: float = 0.30
    precision_fallback: bool = True
    # fragmentation: reserved-but-unallocated memory this large (fraction of the limit), with memory this
    # full or the risk at its threshold, releases the allocator's cache (and switches it to expandable
    # segments once, where the workload can); at most once per `frag_every_s`
    frag_gap: float = 0.05
    frag_used: float = 0.85
    frag_every_s: float = 10.0
    # a leak: torch allocated grows by more than this fraction of the limit per step at a plan that does
    # not grow. Named once (an allocator snapshot); the run is stopped cleanly (checkpoint hook first)
    # when the next step's estimated peak is within `leak_stop_steps` steps (at this rate) of `leak_stop_at`.
    leak_growth: float = 0.002
    leak_stop_steps: float = 5.0  # the risk the guard reads is up to one scoring round (~2 steps) old
    leak_stop_at: float = 0.98
    size_to: float = 0.9  # a lowered ceiling aims the estimated peak at this share of the usable limit
    rescore_from: float = 0.8  # a grown plan is scored before its step when its scaled peak estimate reaches this
    leak_min_steps: int = 4  # torch allocated rose after each of this many steps in a row (a one-off
    # jump, such as the optimizer's state after the first step, is not a leak)
    plan: bool = True  # the planner decides where the estimator can (control/planner.py); False: thresholds only
    planner: PlannerConfig = field(default_factory=PlannerConfig)

    @property
    def label(self) -> str:
        """The rule as the panels and summaries name it: `model`, or `model-thresholds` with the planner off."""
        return self.rule if self.plan or self.rule != "model" else f"{self.rule}-thresholds"


@dataclass
class Observation:
    """What the policy sees before a step: everything in plain numbers."""

    now_s: float
    risk: float | None
    threshold: float
    planned_batch: int  # what the schedule wants for the next step
    last_batch: int | None  # the batch of the last step that ran (fit)
    ceiling: int | None  # the guard's current ceiling (None = none)
    floor: int = 1
    micro_batch: int | None = None  # the micro-batch the planned step runs as, where a framework's per-device batch
    # caps it below the ceiling (a Trainer's 8 x 2: 8); what the risk's estimate was made for
    precision: Precision = "bf16"
    bf16_ok: bool = True
    lower_precisions: tuple[Precision, ...] | None = None  # None: from precision and bf16_ok
    accepts: frozenset[str] | None = None  # the actions the workload can apply (None: all)
    alloc_rising_steps: int | None = None  # steps in a row after which torch allocated rose (None: unknown)
    act_frac: float = 0.0  # the last step's activation peak (peak - allocated) / effective limit
    # reserved beyond the last step's peak / effective limit: what the caching allocator holds that no
    # step used at once (fragmentation). None: unknown, the feature torch_reserved_gap_frac is read instead
    # (reserved - allocated: that also counts the cache a step's activations leave, which the next step reuses)
    frag_frac: float | None = None
    alloc_frac: float | None = None  # the last step's allocated after it / the usable limit for a peak
    first_step: bool = False  # no step has run: alloc_frac is the shape library's weights (predict/prior.py)
    fresh: bool = False  # the risk was scored for this very plan, now (not the plan of a round ago)
    features: dict[str, float] = field(default_factory=dict)
    reasons: list = field(default_factory=list)
    decision: Any = None  # the planner's (control/planner.Decision) where it made one: it replaces the
    # threshold rule's lowering and raising; the leak, fragmentation and stop rules stay




def _lower(obs: Observation) -> tuple[Precision, ...]:
    if obs.lower_precisions is not None:
        return obs.lower_precisions
    return lower_precisions(obs.precision, obs.bf16_ok)


def _coming_near(decision: Any, near: float) -> bool:
    """The planner's estimate of the coming steps' peak (its upper 95 %) reaches `near` of the usable limit,
    or there is none. Only then is the cache released ahead of need: where the coming peak stays below, the
    caching allocator itself frees the cached segments no step uses before it would fail (a release then
    only makes the next steps allocate afresh - H100 call s40h: one release in every no-cap Trainer run,
    with a coming peak of ~64 % of the card). The same holds near the limit: torch's caching allocator, short
    of memory (the card's or its per-process fraction), frees every cached segment no live block uses and
    retries before it raises an OOM - what `empty_cache` does. What a release adds is the first one's switch
    to expandable segments (new segments grow in place, so freed pieces merge); after it, with the planner
    deciding, no release is made: each cost the step 0.3-0.4 s (gc.collect, empty_cache, the next step's
    allocation afresh - H100 calls s47b/c, two or three in every guarded Trainer and Lightning run)."""
    est = getattr(getattr(decision, "current", None), "peak", None)
    return est is None or est.mean + 1.645 * est.sigma >= near


def _can(obs: Observation, kind: ActionKind) -> bool:
    return obs.accepts is None or kind in obs.accepts


def _f(obs: Observation, name: str, default: float = 0.0) -> float:
    v = obs.features.get(name)
    return default if v is None or v != v else float(v)


class Policy:
    """Stateful only in time: when it last acted and since when the risk has been low."""

    def __init__(self, cfg: GuardConfig) -> None:
        if cfg.rule not in GUARD_RULES:
            raise ValueError(f"rule must be one of {GUARD_RULES}")
        self.cfg = cfg
        self._last_action = -1e18
        self._low_since: float | None = None
        self._leak_named = False
        self._released = -1e18
        self._expandable = False

    def applied(self, act: Action) -> None:
        """The guard applied `act` to the workload (observe mode decides and applies nothing): after a release
        that switched the allocator to expandable segments, the next releases only release."""
        if act.kind == "release_cache" and act.value:
            self._expandable = True

    def cooldown_left(self, now_s: float) -> float:
        """Seconds until the cooldown after the last action ends (0: none)."""
        return max(0.0, self.cfg.cooldown_s - (now_s - self._last_action))

    def decide(self, obs: Observation) -> Action:
        """The action before the next step. Kind "unable" (value: what would help) = the guard should act
        and cannot; the guard says so once."""
        if self.cfg.rule in ("accelerate", "composer"):
            return NONE  # reactive rules act only after a failure (see after_oom)
        leak = self._leak(obs) if self.cfg.rule == "model" else None
        if leak is not None and leak.kind == "stop":  # a stop before the crash does not wait out a cooldown
            return leak
        # the cooldown keeps the guard from acting twice on a risk scored before its last action; a risk
        # scored for this very plan, now, at the alarm is not that (call 23: a cooldown let a step the
        # guard had scored at p 0.97 run unsplit into the OOM)
        urgent = obs.fresh and obs.risk is not None and obs.risk >= obs.threshold and self.cfg.rule == "model"
        urgent = urgent or (obs.decision is not None and obs.decision.urgent)  # the estimate says it will not fit
        if obs.now_s - self._last_action < self.cfg.cooldown_s and not urgent:
            if leak is not None:
                self._leak_named = False  # named after the cooldown
            return NONE
        act = self._fixed(obs) if self.cfg.rule == "fixed" else self._model(obs, leak)
        if act.kind not in ("none", "unable", "release_cache"):  # a release has its own period (frag_every_s)
            self._last_action = obs.now_s
        return act

    # -- remedies beyond the batch -------------------------------------------------------------------
    def _leak(self, obs: Observation) -> Action | None:
        """Memory that grows at a fixed plan is not helped by a smaller batch: name it, then stop cleanly
        before the step that would fail."""
        growth = _f(obs, "alloc_growth_frac_per_step")
        if growth <= self.cfg.leak_growth or _f(obs, "plan_growth", 1.0) > 1.0:
            return None
        if obs.alloc_rising_steps is not None and obs.alloc_rising_steps < self.cfg.leak_min_steps:
            return None
        est = _f(obs, "next_peak_est_frac", _f(obs, "mem_used_frac", float("nan")))
        if est != est:
            return None
        left = max(0.0, (self.cfg.leak_stop_at - est) / growth)
        what = f"memory grows {growth:.2%} of the limit per step at a fixed plan (a leak)"
        if left <= self.cfg.leak_stop_steps and _can(obs, "stop"):
            return Action("stop", None, f"{what}; the next step's peak {est:.0%} of the limit, about {left:.0f} "
                                        f"step(s) from {self.cfg.leak_stop_at:.0%}: stopping cleanly before the OOM")
        if not self._leak_named and _can(obs, "name_leak"):
            self._leak_named = True
            return Action("name_leak", growth, f"{what}; about {left:.0f} steps to the limit at this rate")
        return None

    def _fragmented(self, obs: Observation, alarm: bool) -> Action | None:
        gap = obs.frag_frac if obs.frag_frac is not None else _f(obs, "torch_reserved_gap_frac")
        used = _f(obs, "mem_used_frac")
        if gap < self.cfg.frag_gap or not (alarm or used >= self.cfg.frag_used) or not _can(obs, "release_cache"):
            return None
        if obs.now_s - self._released < self.cfg.frag_every_s:
            return None
        self._released = obs.now_s
        expand = not self._expandable  # set by `applied`: observe mode decides a release and applies nothing
        what = "reserved beyond the last step's peak" if obs.frag_frac is not None else "reserved but not allocated"
        return Action("release_cache", expand,
                      f"{gap:.0%} of the limit {what} (fragmentation) at {used:.0%} used: "
                      f"cache released" + ("; allocator switched to expandable segments" if expand else ""))

    # -- the model rule ------------------------------------------------------------------------------
    def _model(self, obs: Observation, leak: Action | None = None) -> Action:
        if leak is not None:
            return leak
        r = obs.risk
        alarm = r is not None and r >= obs.threshold
        if obs.decision is not None:  # the planner: a change, else the cache's release where it is fragmented
            self._low_since = None
            if obs.decision.change:
                return Action("plan", obs.decision.chosen.config, obs.decision.why)
            if self._expandable:  # see _coming_near: past the switch a release only re-allocates
                return NONE
            return (self._fragmented(obs, alarm) if alarm or _coming_near(obs.decision, self.cfg.frag_used) else None) or NONE
        if alarm:  # a smaller micro-batch lowers the peak for sure; the cache's release comes after it
            self._low_since = None
            act = self._reduce(obs)
            if act.kind != "unable":
                return act
            return self._fragmented(obs, True) or act
        frag = self._fragmented(obs, False)
        if frag is not None:
            return frag
        if r is None:
            return NONE
        if r < obs.threshold * self.cfg.clear_ratio:
            self._low_since = obs.now_s if self._low_since is None else self._low_since
            if obs.ceiling is not None and obs.now_s - self._low_since >= self.cfg.restore_after_s:
                self._low_since = obs.now_s  # the next raise waits as long again
                return self._raise(obs)
        else:
            self._low_since = None
        return NONE

    def _reduce(self, obs: Observation) -> Action:
        cur = _running(obs)
        why = f"risk {obs.risk:.2f} >= {obs.threshold:.2f}" + (f" ({_top(obs.reasons)})" if obs.reasons else "")
        growing = _f(obs, "alloc_growth_frac_per_step") > 0.002 and _f(obs, "plan_growth", 1.0) <= 1.0
        lower = _lower(obs) if self.cfg.precision_fallback and _can(obs, "precision") else ()
        if lower and obs.precision == "fp32" and (cur <= obs.floor or growing or self._precision_saves_more(obs)):
            to = lower[0]
            return Action("precision", to, why + ("; batch at its floor" if cur <= obs.floor else
                                                  "; memory grows at a fixed batch" if growing else
                                                  "; halving activations saves more than a smaller batch"))
        # refuse a step up that the ceiling does not already stop: under a ceiling the next micro-batch is
        # the ceiling, and when that is what ran last (risk still high) the ceiling itself must come down
        if (obs.last_batch and cur > obs.last_batch and obs.last_batch >= obs.floor
                and _can(obs, "refuse_step")):
            hold = max(obs.floor, min(obs.last_batch, self._fits(obs, cur)))
            return Action("refuse_step", hold,
                          f"{why}; the schedule's step to {obs.planned_batch} refused, held at {hold}")
        if cur <= obs.floor or not _can(obs, "lower_ceiling"):
            helps = ["a smaller sequence length", "gradient checkpointing", "a larger memory limit or GPU"]
            if obs.precision in ("fp32", "tf32") and not lower:
                helps.insert(0, "bf16/fp16 (autocast)")
            where = "batch already at its floor" if cur <= obs.floor else "this workload cannot lower its batch"
            return Action("unable", "; ".join(helps), f"{why}; {where}" + ("" if obs.precision not in ("bf16", "fp16")
                                                                            else f", already {obs.precision}"))
        new = max(obs.floor, min(cur - 1, int(cur * (1 - self.cfg.lower_by)), self._fits(obs, cur)))
        return Action("lower_ceiling", new, f"{why}; batch ceiling {cur} -> {new}")

    def _fits(self, obs: Observation, cur: int) -> int:
        """The micro-batch whose step the estimate puts under `size_to` of the usable limit, the step's
        activations taken in proportion to the micro-batch (what stays allocated does not shrink): a
        20 % cut is not enough for a step planned at 1.3x the limit. `cur` where unknown."""
        est, a = _f(obs, "next_peak_est_frac", float("nan")), obs.alloc_frac
        if a is None or est != est or est <= a:
            return cur
        # a first step (the library's estimate, its 1.25 overhead a margin already): size_to of the room
        # above the weights - size_to of the whole limit left a v2-lite step, weights 88 % of it, 1.5 % for
        # its activations (call 39: 40 -> 5, where 40 fitted; the small preset's 48/192/96 -> 30/135/70 ran)
        room = self.cfg.size_to * (1.0 - a) if obs.first_step else self.cfg.size_to - a
        return cur if room <= 0 else max(obs.floor, int(cur * room / (est - a)))

    def _precision_saves_more(self, obs: Observation) -> bool:
        """Autocast halves activations, not fp32 weights or optimizer state: the saving is about half
        of the step's activation peak, a smaller batch saves `lower_by` of it. Choose precision only
        when the smaller batch would not bring the estimated next peak under 95 % and precision would."""
        est, act = _f(obs, "next_peak_est_frac"), max(0.0, obs.act_frac)
        return act > 0 and est - self.cfg.lower_by * act > 0.95 >= est - 0.5 * act

    def _raise(self, obs: Observation) -> Action:
        base = obs.planned_batch
        step = max(1, round(base * self.cfg.restore_by))
        new = (obs.ceiling or base) + step
        if new >= base:
            return Action("clear_ceiling", None, f"risk below {obs.threshold * self.cfg.clear_ratio:.2f} for "
                                                 f"{self.cfg.restore_after_s:g} s; ceiling lifted (schedule's batch {base})")
        return Action("raise_ceiling", new, f"risk below {obs.threshold * self.cfg.clear_ratio:.2f} for "
                                            f"{self.cfg.restore_after_s:g} s; ceiling {obs.ceiling} -> {new}")

    # -- the fixed rule --------------------------------------------------------------------------------
    def _fixed(self, obs: Observation) -> Action:
        frac = obs.features.get("mem_used_frac")
        if frac is None or frac != frac:
            return NONE
        cur = _running(obs)
        if frac > self.cfg.fixed_high and cur > obs.floor:
            new = max(obs.floor, cur // 2)
            return Action("lower_ceiling", new, f"memory {frac:.0%} > {self.cfg.fixed_high:.0%}: batch {cur} -> {new}")
        if frac < self.cfg.fixed_low and obs.ceiling is not None:
            new = obs.ceiling * 2
            if new >= obs.planned_batch:
                return Action("clear_ceiling", None, f"memory {frac:.0%} < {self.cfg.fixed_low:.0%}: ceiling lifted")
            return Action("raise_ceiling", new, f"memory {frac:.0%} < {self.cfg.fixed_low:.0%}: batch -> {new}")
        return NONE

    # -- after a failure -----------------------------------------------------------------------------
    def after_oom(self, batch: int, micro: int) -> tuple[str, int] | None:
        """What a reactive rule does after an OOM at micro-batch `micro` of a step of `batch`:
        ("batch", smaller batch) or ("ceiling", micro-batch ceiling: same effective batch), and retry
        the same step; None = the schedule recovers as it always has (the failed step is lost)."""
        if self.cfg.rule == "accelerate":
            return "batch", max(1, int(batch * 0.9))
        if self.cfg.rule == "composer":
            return "ceiling", max(1, micro // 2)
        return None


def _running(obs: Observation) -> int:
    """The micro-batch the planned step runs as: the schedule's under the ceiling and the framework's per-device batch
    (review of 5c2159a: sized from 16 where 8 x 2 ran, a cut to 9 changed nothing and the flagged step ran)."""
    return min(obs.planned_batch, obs.ceiling or obs.planned_batch, obs.micro_batch or obs.planned_batch)


def _top(reasons: list) -> str:
    return ", ".join(str(r[0]) for r in reasons[:2])
