"""The planner: before a step, the configuration for the coming steps from the memory estimate - not a
risk threshold and a timer.

Why: the threshold rule compares one risk with one number, lowers the batch by a fifth and gives it back
after 15 s of low risk. In a curriculum (each step longer than the last) the give-back walks into the OOM
the guard exists to prevent (a user's Hugging Face run: two OOMs, each 5 s after a raise, and 8 Trainer
restarts in 253 s). The estimator (predict/peak.py) can say, for any micro-batch, sequence length,
precision and checkpointing setting, what the step's peak will be, with its spread. So the planner:

1. lists the configurations the workload can switch to between steps without changing what it computes:
   micro-batches under the effective batch (divisors of it where a change restarts the framework),
   activation checkpointing on or off where the workload can switch it, and - only where nothing at the
   current precision fits - a lower precision;
2. asks the estimator for each one's peak over the coming steps: the next step's and the lookahead's
   sequence length where the workload knows them, else the trend of recent lengths carried over the steps
   the configuration would run for (two steps for a change that is free to undo, the planning horizon for
   one that costs a restart), and where the next batch is unknown the longest of the recent ones too
   (where the step's own batch is in hand - `GuardedLoop.step`, Lightning's `gw.step` - the trend starts
   from its length and the recent longest is not assumed);
3. keeps the current configuration while P(peak > usable limit) <= `p_max`; a new one must pass the same
   test against `change_margin` of the usable limit (hysteresis: a change is never made to the edge);
4. among the configurations that fit, values each by its expected tokens/s (control/pace.py: the step
   times measured in each (checkpointing, precision) group, what every extra micro-batch costs, and
   checkpointing's measured recompute - x 4/3 until it ran), less the measured restart cost where the change
   restarts the framework, spread over the rest of the run where the workload knows it (`steps_left`);
5. changes only when the current does not fit, or when the best is `min_gain` better and - for a change
   that needs more memory (a larger micro-batch, checkpointing off) - the classifier's risk is below
   `clear_ratio` x its threshold too. No timer: a give-back happens when the estimate says it fits the
   coming steps, and not before.
Where there is no estimate (no step has run; no model), the threshold rule of control/policy.py decides.
Every decision to change is a `guard_plan` event listing the configurations weighed. Pure Python.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

from gpuwatch.contract import Config, Precision, StepPlan, WorkloadView
from gpuwatch.control.pace import StepTimes

RESTART_PRIOR_S = 10.0  # a restart not measured yet (a Trainer's checkpoint save + load)


@dataclass(frozen=True)
class Estimate:
    """A configuration's estimated peak over the coming steps, as fractions of the usable limit."""

    mean: float
    sigma: float

    def p_over(self, margin: float) -> float:
        """P(peak > margin x usable limit), the estimate taken as normal."""
        s = max(self.sigma, 1e-6)
        return 0.5 * math.erfc((margin - self.mean) / s / math.sqrt(2.0))


# (configurations, sequence length each is asked at) -> their estimates (None: no estimate for it)
EstimateFn = Callable[[Sequence[tuple[Config, int]]], list[Estimate | None]]


@dataclass(frozen=True)
class PlannerConfig:
    p_max: float = 0.05  # the most P(peak > margin) a configuration may have
    change_margin: float = 0.95  # a new configuration must fit under this share of the usable limit
    alarm_margin: float = 0.90  # ... and under this while the classifier is at its alarm
    min_gain: float = 0.05  # a change that is not needed and restarts the framework must be worth this much more
    min_gain_free: float = 0.01  # ... one that needs no restart (the 3-step dwell keeps it from flapping)
    horizon_s: float = 60.0  # what a configuration is valued over, and a restart's change is checked for
    max_candidates: int = 12  # micro-batch sizes weighed at most
    min_dwell_steps: int = 3  # a change that is not needed waits this many steps after the last change (H200
    # call 4: a Trainer given back its batch at the resumed run's first decision flapped 2 <-> 1, 16 restarts)
    max_value_horizon_s: float = 900.0  # a restart's cost is spread over the run's rest, at most this long
    trend_steps: int = 16  # the lengths' trend is carried at most this many steps (no further than it was fitted
    # on: call 4 carried a curriculum's +26 tokens a step over 60 s, to 8,147 tokens of a 4,096 run)


@dataclass(frozen=True)
class Weighed:
    config: Config
    micro_batches: int
    seq_len: int  # the sequence length its peak was estimated at
    peak: Estimate | None
    p_over: float
    fits: bool
    tokens_per_s: float | None
    restart: bool
    value: float

    def summary(self) -> dict:
        c = self.config
        return {"micro_batch": c.micro_batch, "checkpointing": c.checkpointing, "precision": c.precision,
                "micro_batches": self.micro_batches, "seq_len": self.seq_len,
                "peak_frac": None if self.peak is None else round(self.peak.mean, 4),
                "peak_sigma": None if self.peak is None else round(self.peak.sigma, 4),
                "p_over": round(self.p_over, 4), "fits": self.fits,
                "tokens_per_s": None if self.tokens_per_s is None else round(self.tokens_per_s, 1),
                "restart": self.restart, "value": round(self.value, 1)}


@dataclass(frozen=True)
class Decision:
    chosen: Weighed
    current: Weighed
    weighed: tuple[Weighed, ...]
    change: bool
    urgent: bool  # the current configuration does not fit the coming steps
    why: str


class Planner:
    """Per workload: the step times it has seen, the recent sequence lengths, and the restart cost."""

    def __init__(self, cfg: PlannerConfig | None = None) -> None:
        self.cfg = cfg or PlannerConfig()
        self.times = StepTimes()
        self.lens: deque = deque(maxlen=16)
        self._steps_seen = 0
        self._paces: deque = deque(maxlen=8)
        self._changed_at = -10**9  # the step count when the last change was decided

    def observe(self, view: WorkloadView, precision: str) -> None:
        """Learn the last step (once per step): its time per micro-batch in its configuration."""
        if view.steps <= self._steps_seen:
            return
        # the first step this process saw - CUDA's and the framework's warm-up (H200 s40g: 3.47 s, then 0.51 s a
        # step) - whatever its number: a resumed run counts on from its checkpoint's step
        first = self._steps_seen == 0
        self._steps_seen = view.steps
        if view.last_seq_len:
            self.lens.append(int(view.last_seq_len))
        dt, tok, micro, s = view.last_step_time_s, view.last_tokens, view.last_ok_batch, view.last_seq_len
        if first or not (dt and dt > 0 and tok and micro and s):
            return
        n = max(1, round(tok / s))
        k = math.ceil(n / micro)
        self.times.add(bool(view.last_checkpointing), precision, k, float(tok), float(s), dt)
        self._paces.append(dt)

    # -- the coming steps ---------------------------------------------------------------------------------
    def _pace_s(self) -> float | None:
        p = sorted(self._paces)
        return p[len(p) // 2] if p else None

    def coming_seq(self, plan: StepPlan, steps_ahead: float, capped: bool = True) -> int:
        """The longest sequence the configuration will meet within `steps_ahead` steps (the trend carried at
        most `trend_steps` unless `capped` is off: what a valuation looks at, never a fit)."""
        s = max(int(plan.seq_len), int(plan.ahead_seq_len or 0))
        lens = list(self.lens)
        if len(lens) >= 3:
            slope = _slope(lens)
            if slope > 0:
                ahead = min(steps_ahead, self.cfg.trend_steps) if capped else steps_ahead
                # from the step's own length where its batch is known (drawn ahead, or in hand) - that step is
                # the first of the coming ones - else from the last step's: after an epoch wraps to short lengths
                # the trend starts at the batch in hand
                if plan.ahead_steps is not None or plan.in_hand:
                    s = max(s, int(math.ceil(int(plan.seq_len) + slope * max(0.0, ahead - 1))))
                else:
                    s = max(s, int(math.ceil(lens[-1] + slope * ahead)))
        if plan.ahead_steps is None and not plan.in_hand and lens:  # the next batches are not known: the recent
            # longest may come again
            s = max(s, max(lens))
        return s

    def _horizon_steps(self) -> float:
        p = self._pace_s()
        return max(2.0, self.cfg.horizon_s / p) if p else 2.0

    # -- the candidates -----------------------------------------------------------------------------------
    def candidates(self, plan: StepPlan, view: WorkloadView, precisions: Sequence[Precision]) -> list[Config]:
        n = int(plan.wanted_batch or plan.effective_batch or plan.batch)
        floor = max(1, int(view.floor))
        sizes: list[int] = []
        for k in range(1, n + 1):
            m = math.ceil(n / k)
            if m < floor:
                break
            if view.largest is not None and m > view.largest:
                continue
            if view.restart_cost_s is not None and n % m:
                continue  # a framework's per-device batch keeps the effective batch only as a divisor
            if m not in sizes:
                sizes.append(m)
        if len(sizes) > self.cfg.max_candidates:  # evenly spread over the sizes, the largest and smallest kept
            top = len(sizes) - 1
            sizes = [sizes[i] for i in sorted({round(i * top / (self.cfg.max_candidates - 1))
                                               for i in range(self.cfg.max_candidates)})]
        cur = plan.batch
        if cur not in sizes:
            sizes.append(cur)
        ckpts = [False, True] if view.checkpointing is not None and plan.mode == "train" else [bool(plan.checkpointing)]
        return [self.config_of(plan, m, c, p) for p in precisions for c in ckpts for m in sizes]

    @staticmethod
    def config_of(plan: StepPlan, micro_batch: int, checkpointing: bool, precision: Precision) -> Config:
        """The configuration of `micro_batch` under the plan's effective batch: a train step accumulates
        over ceil(batch / micro-batch) micro-batches; an inference step does not, nor a train workload that
        runs a smaller batch instead (its effective batch is below what the schedule wants)."""
        n = int(plan.wanted_batch or plan.effective_batch or plan.batch)
        accumulates = plan.mode == "train" and int(plan.effective_batch or plan.batch) >= n
        k = max(1, math.ceil(n / max(1, micro_batch))) if accumulates else 1
        return Config(micro_batch, checkpointing, precision, k)

    @classmethod
    def current_config(cls, plan: StepPlan) -> Config:
        return cls.config_of(plan, plan.batch, bool(plan.checkpointing), plan.precision)

    def decide(self, plan: StepPlan, view: WorkloadView, estimate: EstimateFn, risk: float | None = None,
               threshold: float = 1.0, clear_ratio: float = 0.5) -> Decision | None:
        """The configuration for the coming steps, or None where the estimator has nothing to say."""
        self.observe(view, plan.precision)
        cfg = self.cfg
        current = self.current_config(plan)
        n = int(plan.wanted_batch or plan.effective_batch or plan.batch)
        alarm = risk is not None and risk >= threshold
        near = 2.0
        far = self._horizon_steps()

        s_ref = self.coming_seq(plan, near)  # every candidate's tokens/s at the same length
        restarts = view.restart_cost_s is not None
        h_value = self.value_horizon_s(view)
        s_value = self.coming_seq(plan, h_value / (self._pace_s() or h_value), capped=False)  # the run's end, or
        # as far as the horizon reaches

        def weigh(configs: list[Config]) -> list[Weighed]:
            asks = []
            for c in configs:
                restart = restarts and c.micro_batch != current.micro_batch
                asks.append((c, self.coming_seq(plan, far if restart else near), restart))
            # where changes restart the framework: does each hold to the valuation's end on the trend? One that
            # will not is charged the restart that will follow it (H200 curriculum: 16 -> 8 -> 4 paid two).
            # Asked in the same call (one window built per decision)
            ahead = restarts and s_value > s_ref
            got = estimate([(c, s) for c, s, _r in asks] + ([(c, s_value) for c, _s, _r in asks] if ahead else []))
            ests, holds = got[:len(asks)], (got[len(asks):] if ahead else [None] * len(asks))
            out = []
            for (c, s, restart), e, h in zip(asks, ests, holds):
                is_cur = c == current  # the current keeps to its estimate; at the classifier's alarm a new one
                margin = 1.0 if is_cur else cfg.alarm_margin if alarm else cfg.change_margin  # needs more room
                p = e.p_over(margin) if e is not None else 1.0
                tps = self._tokens_per_s(c, n, s_ref)
                another = h is not None and h.p_over(margin) > cfg.p_max
                value = (tps or 0.0) * self._left(restart, another, view, h_value)
                out.append(Weighed(c, math.ceil(n / c.micro_batch), s, e, p, e is not None and p <= cfg.p_max,
                                   tps, restart, value))
            return out

        weighed = weigh(self.candidates(plan, view, [plan.precision]))
        if not any(w.peak is not None for w in weighed):
            return None
        cur = next(w for w in weighed if w.config == current)
        fitting = [w for w in weighed if w.fits]
        if not fitting and view.lower_precisions:  # nothing at this precision: a lower one is weighed too
            weighed += weigh(self.candidates(plan, view, list(view.lower_precisions)))
            fitting = [w for w in weighed if w.fits]
        if cur.fits:
            dwell = view.steps - self._changed_at < cfg.min_dwell_steps
            better = [] if dwell or cur.tokens_per_s is None else [w for w in fitting if w is not cur and w.value > 0
                      and w.value >= (1 + (cfg.min_gain if w.restart else cfg.min_gain_free)) * cur.value
                      and (not _needs_more(w, cur) or (risk is not None and risk < clear_ratio * threshold))]
            if not better:
                return Decision(cur, cur, tuple(weighed), False, False,
                                f"kept: peak {_est(cur)} fits the coming steps (seq {cur.seq_len})")
            best = max(better, key=_rank)
            self._changed_at = view.steps
            return Decision(best, cur, tuple(weighed), True, False,
                            f"{_name(best.config)}: peak {_est(best)} fits the coming steps (seq {best.seq_len}) at "
                            f"{best.value / max(cur.value, 1e-9):.2f}x the expected tokens/s of {_name(current)}")
        if fitting:
            best = max(fitting, key=_rank)
            self._changed_at = view.steps
            why = "at the classifier's alarm, " if alarm and cur.p_over <= cfg.p_max * 4 else ""
            return Decision(best, cur, tuple(weighed), True, True,
                            f"{why}{_name(current)} peak {_est(cur)} would cross the limit (P {cur.p_over:.2f}) within "
                            f"the coming steps (seq {cur.seq_len}); {_name(best.config)} peak {_est(best)} fits, "
                            f"best expected tokens/s of {len(fitting)} that fit")
        # nothing fits: the smallest peak, where smaller than now (some peak is known: checked above)
        low_mean, low = min(((w.peak.mean, w) for w in weighed if w.peak is not None), key=lambda k: k[0])
        if cur.peak is not None and low_mean < cur.peak.mean and low.config != current:
            self._changed_at = view.steps
            return Decision(low, cur, tuple(weighed), True, True,
                            f"nothing fits the coming steps (seq {cur.seq_len}); {_name(low.config)} has the smallest "
                            f"peak {_est(low)}")
        return None

    def _tokens_per_s(self, c: Config, n: int, s: int) -> float | None:
        t = self.times.step_time(c.checkpointing, c.precision, math.ceil(n / c.micro_batch), float(n * s), float(s))
        return n * s / t if t and t > 0 else None

    def value_horizon_s(self, view: WorkloadView) -> float:
        """What a change that restarts the framework is valued over: the rest of the run where the workload
        knows it (a Trainer's max_steps) at the recent pace, at most `max_value_horizon_s`; else `horizon_s`."""
        pace = self._pace_s()
        if view.steps_left is None or not pace:
            return self.cfg.horizon_s
        return max(1.0, min(self.cfg.max_value_horizon_s, view.steps_left * pace))

    def _left(self, restart: bool, another: bool, view: WorkloadView, h: float) -> float:
        """The share of the valuation horizon `h` left for steps: less this change's restart, and the next
        one's where the configuration will not hold to the horizon's end."""
        if view.restart_cost_s is None:
            return 1.0
        cost = view.restart_cost_s or RESTART_PRIOR_S  # 0.0: none measured yet
        paid = cost * (int(restart) + int(another))
        return max(0.0, h - paid) / h


def _needs_more(w: Weighed, cur: Weighed) -> bool:
    """The change takes more memory than the current configuration: by the estimates (checkpointing off at a
    quarter of the micro-batch may need less than checkpointing on at the whole: H200 call 7 kept
    checkpointing for 110 steps because switching it off counted as taking memory back)."""
    if w.peak is not None and cur.peak is not None:
        return w.peak.mean > cur.peak.mean
    c, k = w.config, cur.config
    return c.micro_batch > k.micro_batch or (k.checkpointing and not c.checkpointing) or _bytes(c.precision) > _bytes(k.precision)


def _bytes(p: str) -> int:
    return 4 if p in ("fp32", "tf32") else 2


def _slope(ys: list[int]) -> float:
    n = len(ys)
    mx, my = (n - 1) / 2.0, sum(ys) / n
    sxx = sum((i - mx) ** 2 for i in range(n))
    return sum((i - mx) * (y - my) for i, y in enumerate(ys)) / sxx if sxx else 0.0


def _est(w: Weighed) -> str:
    return "?" if w.peak is None else f"{w.peak.mean:.0%} +- {w.peak.sigma:.0%}"


def _name(c: Config) -> str:
    return f"micro-batch {c.micro_batch}" + (" + checkpointing" if c.checkpointing else "") + f" {c.precision}"


def _rank(w: Weighed) -> tuple:
    """The best value; on a tie (every one worth nothing: a restart that costs more than the run has left)
    the one that needs no restart, then the larger micro-batch."""
    return (round(w.value, 6), not w.restart, w.config.micro_batch)
