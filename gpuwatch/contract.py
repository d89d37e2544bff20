"""The one contract between the guard and any workload: what the next step will be (`StepPlan`), what
the guard may read back (`WorkloadView`), and the actions a workload accepts (`Action`, `ACTIONS`).

Why a contract and not duck typing: the guard used to read a dozen members of gpuwatch's own
`Workload` (its schedule, its pending controls, `last`, `manual`, `cfg.gpu_index`...), so nothing else
could be guarded. It sits at the bottom of the layers (stdlib only), so the guard (control), the
workloads (workload, integrations) and the risk model (predict) can all name its types. Now the guard asks a `GuardedWorkload` three questions (`next_plan`, `guard_view`,
`accepts`) and hands it one `Action` at a time through `apply`; gpuwatch's DeepSeek workload
(`gpuwatch.workload.runner.Workload`) and the library loop around a user's own training loop
(`gpuwatch.integrations.loop.GuardedLoop`) both implement it. Pure Python: no torch here.

The plan carries what the risk model scores (batch, seq_len, precision, mode): `StepPlan.scored()` is
the dict the scorer takes today.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, get_args, runtime_checkable

# The project's vocabularies, typed once here (each tuple is its Literal's values, for argparse choices and
# run-time checks); everything else imports them.
Precision = Literal["fp32", "tf32", "bf16", "fp16"]
PRECISIONS: tuple[Precision, ...] = get_args(Precision)
WorkloadMode = Literal["prefill", "decode", "train"]  # what gpuwatch's workload (or a user's loop) runs
WORKLOAD_MODES: tuple[WorkloadMode, ...] = get_args(WorkloadMode)
GuardMode = Literal["off", "observe", "on"]  # observe: decide and log, act on nothing
GUARD_MODES: tuple[GuardMode, ...] = get_args(GuardMode)
GuardRule = Literal["model", "fixed", "accelerate", "composer"]  # control/policy.py's docstring says each
GUARD_RULES: tuple[GuardRule, ...] = get_args(GuardRule)

# Every action the guard may return. A workload says which of them it can apply (`accepts`); the guard
# never sends one it cannot, and says once what would have helped instead.
ActionKind = Literal[
    "lower_ceiling",  # value: the new micro-batch ceiling (train: same effective batch by accumulation)
    "raise_ceiling",  # value: the new, higher ceiling (giving the batch back)
    "clear_ceiling",  # no ceiling any more
    "refuse_step",  # value: the batch to hold (the schedule's step up is refused)
    "precision",  # value: the precision to switch to (bf16 / fp16)
    "release_cache",  # fragmentation: empty the caching allocator; value True = also expandable segments
    "name_leak",  # memory grows at a fixed plan: save an allocator snapshot naming the growing blocks
    "stop",  # the run cannot be saved: call the user's checkpoint hook (where there is one), stop cleanly
    "checkpointing",  # value: True = activation (gradient) checkpointing on, False = off; the batch is kept
    "plan",  # value: a `Config` the planner chose (micro-batch, checkpointing, precision) - applied as one change
]
ACTIONS: tuple[ActionKind, ...] = get_args(ActionKind)


@dataclass(frozen=True)
class Action:
    kind: ActionKind | Literal["none", "unable"]  # "unable": the policy's word that it should act and cannot
    value: Any = None
    why: str = ""


NONE = Action("none")


@dataclass(frozen=True)
class StepPlan:
    """The next step, as the workload will run it if the guard does nothing more."""

    batch: int  # the micro-batch: what one forward/backward holds in memory
    seq_len: int
    precision: Precision = "fp32"
    mode: WorkloadMode = "train"
    micro_batches: int = 1  # gradient accumulation steps the batch is split into
    effective_batch: int | None = None  # samples per optimizer update (train), else the batch
    wanted_batch: int | None = None  # what the schedule or the user's loader wants before any ceiling
    # the largest step planned within the lookahead (gpuwatch/predict/ahead.py), where the workload knows one
    ahead_batch: int | None = None  # its micro-batch, the ceiling applied
    ahead_seq_len: int | None = None
    ahead_steps: int | None = None  # how many steps ahead (1 = this one)
    checkpointing: bool = False  # activation checkpointing on for this step (train only)
    # the step's own batch is drawn already (GuardedLoop.step, Lightning's gw.step): its length is known, so the
    # planner need not assume the longest recent one comes next. The planner's alone: not in `scored()`
    in_hand: bool = False

    @property
    def tokens(self) -> int:
        return int(self.batch) * int(self.seq_len)

    def scored(self) -> dict[str, Any]:
        """The plan as the risk model's feature function reads it."""
        out: dict[str, Any] = {"batch": self.batch, "seq_len": self.seq_len, "precision": self.precision, "mode": self.mode,
               "effective_batch": self.effective_batch if self.effective_batch is not None else self.batch,
               "micro_batches": self.micro_batches}
        if self.ahead_batch and self.ahead_seq_len:
            out.update(ahead_batch=self.ahead_batch, ahead_seq_len=self.ahead_seq_len, ahead_steps=self.ahead_steps)
        if self.checkpointing:  # only when on: every scored dict of a run without it stays as it was
            out["checkpointing"] = True
        return out


@dataclass(frozen=True)
class Config:
    """One configuration the planner weighs for the coming steps: what a workload can change between steps
    without changing what it computes (the effective batch is kept by accumulation)."""

    micro_batch: int
    checkpointing: bool = False
    precision: Precision = "fp32"
    # train steps the effective batch is accumulated over at this micro-batch (1: no accumulation - also
    # every inference step, where a smaller micro-batch is a smaller batch); what the estimate adds the
    # gradients held across micro-batches for
    micro_batches: int = 1


@dataclass(frozen=True)
class WorkloadView:
    """What the guard reads back before a step: plain numbers, read once."""

    gpu: int | None  # the NVML index the workload runs on (None: no GPU)
    ceiling: int | None  # the guard's current micro-batch ceiling
    last_ok_batch: int | None = None  # the micro-batch of the last step that ran
    floor: int = 1  # the smallest micro-batch the workload can run
    lower_precisions: tuple[Precision, ...] = ()  # what `precision` could switch to here, best first
    manual: bool = False  # a user's change overrides the guard until handed back
    last_peak_bytes: int | None = None  # torch's peak allocated during the last step
    last_allocated_bytes: int | None = None  # torch allocated after it
    last_reserved_bytes: int | None = None  # torch reserved after it
    device: str = "cpu"  # "cuda" or "cpu"
    # activation checkpointing now: None = this workload cannot switch it (not offered to the planner)
    checkpointing: bool | None = None
    # seconds a change of the micro-batch costs where it restarts the framework (a Trainer's save + load),
    # measured by the workload (None: a change needs no restart; 0.0 before the first one was measured)
    restart_cost_s: float | None = None
    last_step_time_s: float | None = None  # wall time of the last step that ran (all its micro-batches)
    last_tokens: int | None = None  # tokens that step processed (effective batch x sequence length)
    last_seq_len: int | None = None  # that step's sequence length
    steps: int = 0  # optimizer steps that ran so far (the planner learns each one's time once)
    last_checkpointing: bool = False  # activation checkpointing during the last step
    largest: int | None = None  # the largest micro-batch the workload will run (None: the whole batch)
    steps_left: int | None = None  # optimizer steps the run still has, where the workload knows it (a Trainer)


@runtime_checkable
class GuardedWorkload(Protocol):
    """What the guard drives. Called from the workload's own thread between steps (`next_plan`,
    `guard_view`, `apply`) and from the scorer thread (`next_plan`, `request_snapshot`)."""

    gpu_index: int | None

    def next_plan(self) -> StepPlan | None: ...  # None: no next step (finished)
    def guard_view(self) -> WorkloadView: ...
    def accepts(self) -> frozenset[str]: ...  # the ACTIONS this workload can apply
    def apply(self, action: Action, who: str = "guard") -> None: ...  # before its next step
    def request_snapshot(self, directory: Path | None, reason: str) -> None: ...


class SessionWorkload(GuardedWorkload, Protocol):
    """What the session (`gpuwatch.runtime.Session`) and its front ends read of each workload it runs,
    besides the guard's contract: gpuwatch's `Workload` and the library's `GuardedLoop` both have it."""

    state: str  # idle, building, running, paused, stopped, failed, finished
    manual: bool  # a user's change overrides the guard until handed back
    unrecovered: str | None  # the failure that stopped it, where one did
    device_name: str  # "CPU", or the CUDA device's name
    memory_limit_bytes: int | None  # its cap on the GPU's memory (a fault or the user's), if any
    honours_deadline: bool  # it stops at `ends_at` (Session.ends_in); where not, it is never told one
    ends_at: float | None  # when the run ends (epoch s; --duration): the lookahead ends there
    guard: Any  # the session's guard (control.guard.Guard), set by the session before start; None unguarded

    def past_end(self) -> bool: ...  # past `ends_at`: no step starts, nothing is planned
    def describe(self) -> dict[str, Any]: ...  # its configuration as meta.json records it (preset, mode, gpu_index...)
    def export_state(self) -> dict[str, Any]: ...  # what a resume needs ("step", "precision", ...)
    def start(self) -> Any: ...
    def stop(self, join: bool = True) -> None: ...


@runtime_checkable
class WorkloadControls(Protocol):
    """What a person (the dashboard's keys) may do to a running workload."""

    precision: Precision  # the precision of the steps now running (fp32, tf32, bf16, fp16)
    state: str  # idle, building, running, paused, stopped, failed, finished

    @property
    def batch(self) -> int: ...  # the batch the next step will use

    def set_batch_size(self, n: int) -> None: ...
    def set_seq_len(self, n: int) -> None: ...
    def set_precision(self, p: str) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def stop(self, join: bool = True) -> None: ...


def next_step_columns(plan: StepPlan | None) -> dict[str, Any]:
    """The next step's plan as a steps row and an `oom_recovered` event record it (what a replay scores)."""
    return {"next_batch": plan.batch if plan else None, "next_seq_len": plan.seq_len if plan else None,
            "next_precision": plan.precision if plan else None}


def expand_plan(action: Action, ceiling: int | None, wanted: int | None) -> list[Action]:
    """A `plan` action as the workload's elementary changes, in the order they apply: the micro-batch
    ceiling (cleared where the plan's micro-batch is the whole batch), activation checkpointing, precision.
    Every workload applies a plan through this one function, so a plan means the same in all of them."""
    if action.kind != "plan":
        return [action]
    c: Config = action.value
    out: list[Action] = []
    if wanted is not None and c.micro_batch >= wanted:
        if ceiling is not None:
            out.append(Action("clear_ceiling", None, action.why))
    elif c.micro_batch != ceiling:
        out.append(Action("lower_ceiling" if ceiling is None or c.micro_batch < ceiling else "raise_ceiling",
                          c.micro_batch, action.why))
    out.append(Action("checkpointing", bool(c.checkpointing), action.why))
    out.append(Action("precision", c.precision, action.why))
    return out


def lower_precisions(current: str, bf16_ok: bool = True) -> tuple[Precision, ...]:
    """Where a guard may fall back from `current` (only fp32/tf32 have somewhere to go)."""
    if current not in ("fp32", "tf32"):
        return ()
    return ("bf16", "fp16") if bf16_ok else ("fp16",)
