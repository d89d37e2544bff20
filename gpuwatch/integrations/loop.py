"""`GuardedLoop`: gpuwatch's guard around any PyTorch training loop.

    with GuardedLoop(model, optimizer, record_dir="recordings") as g:
        for batch in g.wrap(loader):                  # stops when the guard stopped the run
            g.step(batch, lambda mb: loss_of(model, mb))  # forward + backward per micro-batch, one update

`step()` is told the step's batch (a tensor, or a dict/tuple of tensors with the batch first; the
sequence length is the second dimension of the first 2-D tensor, or `seq_len=`). Before running it,
the guard decides on the live risk of *this* plan (re-scored at once when the plan grew since the last
scoring): the batch is split into micro-batches under the guard's ceiling, each micro-batch's loss is
weighted by its share of the batch and backpropagated, and the optimizer steps once, so the effective
batch and the update are those of the unsplit step (to rounding; tested). When the risk has stayed low
the ceiling is raised back gradually. A fragmentation alarm releases the allocator's cache and switches
it to expandable segments; a leak is named (an allocator snapshot in the session) and, before the step
that would fail, your `checkpoint(step)` hook is called and the loop stops cleanly (`g.stopped` says
why). An OOM the guard did not prevent is recorded, the step retried at half the micro-batch (same
effective batch); at the floor the loop stops instead (never an OOM loop).

It records a normal gpuwatch session (samples 10 Hz, one steps row per optimizer step, risk, guard and
control events) that `gpuwatch replay`, `score`, `report` and `train` open. The loop is one
`GuardedWorkload` (gpuwatch.contract); the session is the same `runtime.Session` that
`gpuwatch stress` runs. Cost per step: docs/LIBRARY.md.

Here: the loop's API (the session, `wrap`, `step`, `decide` and what frameworks call). Its two base
classes hold the rest of `GuardedLoop`: `steps.LoopSteps` how a step runs, is recorded and recovers from
an OOM; `guarded.LoopGuardedSide` the loop as the guard and the session see it (the contract's side).
"""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from gpuwatch.extras import require

require("GuardedLoop (gpuwatch.integrations)", modules=("torch",))  # one line: what to install

import torch  # noqa: E402

from gpuwatch.contract import Action, StepPlan
from gpuwatch.integrations.batches import Batch, batch_size_of, chunks, first_tensor, seq_len_of
from gpuwatch.integrations.guarded import LoopGuardedSide
from gpuwatch.integrations.steps import LoopSteps
from gpuwatch.control.policy import GuardConfig
from gpuwatch.predict import ahead as A
from gpuwatch.runtime import ModelChoice, Session, SessionConfig
from gpuwatch.workload import mechanics as X

MAX_AHEAD = 16  # batches `wrap` draws ahead of the step at most (the lookahead: predict/ahead.py)


class GuardedLoop(LoopSteps, LoopGuardedSide):
    """A `GuardedWorkload` driven by the user's loop, and the session that records and guards it."""

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None, *,
                 record_dir: str | Path | None = "recordings", name: str | None = None, guard: str = "on",
                 rule: str = "model", guard_config: GuardConfig | None = None, device: str | torch.device | None = None,
                 memory_limit: int | None = None, checkpoint: Callable[[int], Any] | None = None,
                 precision: str = "fp32", allow_bf16: bool = True, min_micro_batch: int = 1,
                 risk_model: str | Path | None = None, use_model: bool = True, threshold: float | None = None,
                 source: str | None = None, gpu_index: int | None = None, sampler: str = "process",
                 interval_s: float = 0.1, record_loss: bool = True, label: str = "user loop",
                 checkpointing: Callable[[bool], Any] | None = None, score_hz: float | None = None) -> None:
        """`memory_limit` (bytes) caps this process's CUDA memory (set_per_process_memory_fraction) and
        is what the risk is measured against; `checkpoint(step)` is called before a clean stop;
        `precision` is what your loop runs (the guard may switch fp32 to bf16 autocast when
        `allow_bf16`); `source` replays a recording as the live telemetry (tests, demos) and
        `gpu_index` ties the loop to one of its GPUs. `checkpointing(on)`: your switch for activation
        checkpointing, where the model is not a transformers model (whose own switch is used); with either,
        the planner may turn it on to keep the batch (control/planner.py). `precision` is read from an
        autocast around `step()` where there is one. `score_hz`: how often the risk is scored (default 5 Hz;
        the planner's estimates between steps do not wait for it)."""
        self.model, self.optimizer, self.checkpoint = model, optimizer, checkpoint
        self.device = torch.device(device) if device is not None else _device_of(model)
        self.precision = precision
        self.checkpointing_hook = checkpointing
        self.checkpointing = X.checkpointing_now(model)  # activation checkpointing on now
        self.restart_cost_s: float | None = None  # a framework that restarts to change the micro-batch sets it
        self.largest: int | None = None  # a framework's largest per-device batch (its user's), where it has one
        self.steps_left: int | None = None  # a framework's optimizer steps still to run, where it knows them
        # the micro-batch a framework runs until it can next change it (Lightning: between epochs): the guard sees it
        # as floor and largest (checkpointing open), so it plans no change that would not happen nor counts on one
        self.micro_batch_fixed: int | None = None
        self._last_dt: float | None = None
        self.allow_bf16 = allow_bf16
        self.floor = max(1, int(min_micro_batch))
        self.memory_limit_bytes = memory_limit
        self.record_loss = record_loss
        self.label = label
        self.ceiling: int | None = None  # the guard's micro-batch ceiling
        self.last_ok_batch: int | None = None
        self.manual = False
        self.state = "idle"
        self.guard = None  # set by the session
        self.stopped: str | None = None  # why the loop stopped (the guard, or an OOM at the floor)
        self.steps = self.ooms = self.retries = 0
        self.remedies: list[str] = []
        self.step_overhead_s: list[float] = []  # gpuwatch's own time per step (the guard, bookkeeping)
        self._wanted: tuple[int, int] | None = None  # (batch, seq_len) of the step being decided
        self._shapes: list[tuple[int, int]] = []  # (batch, seq_len) of the batch `wrap` gave and those drawn ahead
        self._ends: list[float] = []  # when the last steps ended (s): the lookahead's pace
        self._ahead_ok = True  # the loader's batches are on the CPU (drawing them early costs no GPU memory)
        self._in_hand = False  # the plan's batch is the step's own, drawn already (decide(in_hand=True))
        self._stop_why: str | None = None
        self._last: dict[str, Any] = {}
        self._snapshot_req: tuple[str, Any] | None = None
        self._pending: list[tuple[Action, str]] = []  # guard actions, applied before the next step
        self._baseline = None
        self._lock = threading.Lock()
        self.gpu_index = gpu_index
        self._params = sum(p.numel() for p in model.parameters()) if model is not None else None
        self._device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "CPU"
        if memory_limit and self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, memory_limit / total), self.device)
        cfg = guard_config or GuardConfig(mode=guard, rule=rule)
        if guard_config is None:
            cfg = replace(cfg, mode=guard, rule=rule)
        self.session_config = SessionConfig(
            record_dir=Path(record_dir) if record_dir is not None else None, name=name, source=source,
            sampler=sampler, interval_s=interval_s, guard=cfg, score_hz=score_hz,
            model=ModelChoice(path=Path(risk_model) if risk_model else None, enabled=use_model, threshold=threshold))
        self.session: Session | None = None

    # -- the session --------------------------------------------------------------------------------------
    def start(self) -> "GuardedLoop":
        """Build and start the session (sampler, recorder, scorer, guard). `with` does this."""
        if self.session is None:
            with _main_not_reimported():  # the sampler child is spawned here
                self.session = Session(self.session_config, workloads=self._attach)
            self.session.start()
            self.bus.emit("workload_start", f"{self.label} guarded by gpuwatch on {self.device}", gpu=self.gpu_index,
                          **self.describe())
            g = self.session.guard
            if g is not None and not g.unable and self.device.type != "cuda" and self.gpu_index is None:
                g.cannot_act(self.gpu_index, "loop on the CPU", f"guard {g.cfg.mode} but this loop runs on {self.device}, "
                             "not on a GPU the session watches", "move the model and batches to a CUDA device "
                             "(GuardedLoop(device=...) when the model has no parameters yet)")
        return self

    def _attach(self, bus, nvml_index) -> list:
        self.bus = bus
        if self.gpu_index is None and self.device.type == "cuda":
            from gpuwatch.workload.factory import cuda_identity

            self.gpu_index = nvml_index(cuda_identity(self.device))
        return [self]

    def close(self) -> None:
        """Stop the session and close the recording (Parquet per table). `with` does this."""
        if self.session is not None:
            if self.state not in ("stopped", "failed"):
                self.state = "finished"
            self.bus.emit("workload_stop", f"{self.label} {self.state} after {self.steps} steps"
                          + (f": {self.stopped}" if self.stopped else ""), gpu=self.gpu_index, stopped_by=self.stopped)
            self.session.stop()

    def __enter__(self) -> "GuardedLoop":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def session_dir(self) -> Path | None:
        r = self.session.recorder if self.session else None
        return r.dir if r is not None else None

    @property
    def last_step(self) -> dict[str, Any]:
        """The last steps row recorded (empty before the first step)."""
        return dict(self._last)

    @property
    def should_stop(self) -> bool:
        return self.stopped is not None

    # -- the user's loop ------------------------------------------------------------------------------------
    def wrap(self, loader: Iterable[Batch], lookahead: bool = True) -> Iterator[Batch]:
        """Iterate the data loader until it ends or the guard stops the run. With `lookahead`, the batches
        of the next few seconds (4 s at the recent pace, at most MAX_AHEAD) are drawn from the loader before
        they are due, so the risk sees the largest of them coming (predict/ahead.py) - not for batches
        that live on the GPU already (holding them early would cost the memory it guards)."""
        it = iter(loader)
        buf: collections.deque = collections.deque()  # (batch, its shape): each batch's shape read once
        while not self.should_stop:
            look = lookahead and self._ahead_ok
            want = 1 + (min(MAX_AHEAD, A.steps_within(self._ends)) if look else 0)
            while len(buf) < want:
                try:
                    b = next(it)
                except StopIteration:
                    break
                buf.append((b, (batch_size_of(b), seq_len_of(b)) if look else None))
            if not buf:
                return
            batch, shape = buf.popleft()
            if look:  # a batch already on the GPU ends the lookahead
                t = first_tensor(batch)
                self._ahead_ok = look = t is None or t.device.type == "cpu"
            self._shapes = [shape, *(sh for _b, sh in buf if sh is not None)] if look and shape is not None else []
            yield batch

    def step(self, batch: Batch, loss_fn: Callable[[Batch], torch.Tensor], seq_len: int | None = None) -> float | None:
        """One optimizer step over `batch`: the guard decides, the batch runs as micro-batches under its
        ceiling (`loss_fn(micro_batch)` returns the micro-batch's mean loss; it is weighted by its share
        and backpropagated), then `optimizer.step()` and `zero_grad()` (when an optimizer was given).
        Returns the batch's mean loss (None when `record_loss=False`), or None after a stop."""
        if self.session is None:
            self.start()
        if self.should_stop:
            return None
        t_in = time.perf_counter()
        self.precision = X.autocast_precision(self.device.type, self.precision)  # the caller's autocast, if any
        n = batch_size_of(batch)
        s = seq_len if seq_len is not None else seq_len_of(batch)
        if self.decide(n, s, in_hand=True) is None:
            return None
        overhead = time.perf_counter() - t_in
        for _attempt in range(64):
            micro = min(n, self.ceiling) if self.ceiling else n
            k = chunks(n, micro)
            before = self._mem().get("torch_allocated_bytes")
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            t0 = time.perf_counter()
            failure = None
            try:
                loss = self._run(batch, k, loss_fn)
            except Exception as e:  # noqa: BLE001 - classified below, outside the handler
                if not X.is_oom(e):
                    self.fail(e)
                    raise
                failure = X.first_line(e)
            if failure is None:
                break
            if not self._recover(failure, n, s, micro, before):  # outside the except: its traceback pins tensors
                return None
        else:
            self._stop("OOM retried 64 times")
            return None
        dt = time.perf_counter() - t0
        t1 = time.perf_counter()
        self._record(n, s, micro, k, loss, dt)
        self.step_overhead_s = (self.step_overhead_s + [overhead + time.perf_counter() - t1])[-1000:]
        return loss

    def fail(self, exc: BaseException) -> None:
        """The user's step raised (not an OOM): recorded as a `workload_error` before it propagates, so the
        session says the loop died, and where, instead of "finished"."""
        if self.state == "failed":
            return
        self.state = "failed"
        self.stopped = f"{type(exc).__name__}: {X.first_line(exc)}"
        if self.session is not None:
            self.bus.emit("workload_error", f"{self.label} failed at step {self.steps}: {self.stopped}", "error",
                          gpu=self.gpu_index, step=self.steps, error=self.stopped, exception=type(exc).__name__)

    # -- frameworks that run the step themselves (Hugging Face, Lightning) ----------------------------------
    def decide(self, batch_size: int, seq_len: int, in_hand: bool = False) -> StepPlan | None:
        """The guard decides for a step of `batch_size` x `seq_len` (the effective batch); returns the
        plan (its `batch` the micro-batch under the guard's ceiling) or None when the run must stop (the
        checkpoint hook has then been called). `in_hand`: the step's own batch, drawn already (`step()`,
        `gw.step`): the plan says so (`in_hand`), and the planner does not assume the longest recent length
        comes next (as where a framework decides before fetching): s47's epoch wrap gave back 16 steps late."""
        if self.session is None:
            self.start()
        if self.should_stop:
            return None
        self._wanted = (int(batch_size), int(seq_len))
        self._in_hand = bool(in_hand)  # the plan says so (`StepPlan.in_hand`) until the step has run
        if self.guard is not None and not self.manual:
            self._rescore_smaller_plan()
            self.guard.before_step(self)
        self._apply_pending()
        if self._stop_why is not None:
            self._stop(self._stop_why)
            return None
        return self.next_plan()

    def in_step_split(self, current: int | None, micro: int, per_device: int, effective: int, step: int,
                      what: str, note: str) -> int | None:
        """The micro-batch a framework's own step runs its per-device batch as (None: whole), given the plan's
        `micro`; a change from `current` is a `control` event ("split") naming `what` runs split and `note`
        (what the change did not need). For frameworks that split their step in place (hf.py, lightning.py)."""
        new = None if micro >= per_device else int(micro)
        if new != current:
            k = chunks(per_device, new)
            self.bus.emit("control", f"{what} of {per_device} runs as {k} micro-batch{'es' if k > 1 else ''} of at most "
                          f"{new or per_device} in the step (effective batch {effective} kept; {note})",
                          gpu=self.gpu_index, control="split", value=[new or per_device, k], who="guard",
                          why="the guard's micro-batch ceiling", step=step)
        return new

    def _rescore_smaller_plan(self) -> None:
        """An alarm scored for a larger plan than this step's is not this step's risk: the scorer scores the
        plan the loop shows, which between steps is the last step's (often before that step's own row was in
        its window), and the guard re-scores a plan only when it grew. With random lengths that alarm would
        split a shorter step the larger one has just run without (H200 calls 25 and 28, the fragment
        scenario's step 4: p 0.99 for the 18,784-token step 3, which then fit, split the 12,496-token step
        4). Here the smaller plan is scored now, as a grown one is; only at an alarm, so a few ms rarely."""
        g, plan = self.guard, self.next_plan()
        if plan is None or getattr(g, "rescore", None) is None:
            return
        got = g.latest_risk(self.gpu_index)
        scored = (got or {}).get("plan") or {}
        if not got or got.get("risk") is None or got["risk"] < g.threshold or scored == plan.scored():
            return
        if float(scored.get("batch") or 0) * float(scored.get("seq_len") or 0) <= plan.tokens:
            return  # the same size or grown: the guard's own rule (Guard._worth_rescoring)
        r, why, f = g.rescore(self.gpu_index, plan.scored())
        g.on_risk(self.gpu_index, r, why, f, plan.scored(), False)

    def record_step(self, batch_size: int, seq_len: int, micro_batches: int, step_time_s: float,
                    loss: float | None = None) -> None:
        """One optimizer step that ran (a steps row; the allocator figures are read here)."""
        self._record(int(batch_size), int(seq_len), -(-int(batch_size) // max(1, micro_batches)), max(1, micro_batches),
                     loss, step_time_s)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)


@contextlib.contextmanager
def _main_not_reimported():
    """Spawned children (the sampler process) re-run the parent's `__main__` unless told not to: a user's
    training script without an `if __name__ == "__main__":` guard would train again in the child. The
    sampler needs nothing from `__main__` (its target lives in gpuwatch), so while it is spawned the
    main module shows neither `__spec__` nor `__file__`, which is what multiprocessing reads to decide."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {k: main.__dict__[k] for k in ("__spec__", "__file__") if k in main.__dict__}
    main.__dict__["__spec__"] = None
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def _device_of(model) -> torch.device:
    if model is not None:
        for p in model.parameters():
            return p.device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
