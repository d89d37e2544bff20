"""gpuwatch's guard in a Hugging Face `Trainer` (`pip install 'gpuwatch[hf]'`).

    from gpuwatch.integrations.hf import GpuwatchCallback, train

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[GpuwatchCallback()])
    train(trainer)            # = trainer.train(), resumed with a smaller per-device batch when the guard asks

What the Trainer allows: its data loader's batch size is fixed for a whole `train()` call, and
`on_step_begin` comes after the step's micro-batches were fetched. So the callback decides at the end of
each optimizer step (before the next one), for the next step. In one process (the usual fine-tune) `train()`
splits each of the Trainer's batches inside its own `training_step` into micro-batches under the guard's
ceiling - each one's loss weighted by its share (or, where the Trainer normalises the loss by the batch's
tokens, as it is), backpropagated, the optimizer stepping once as before - so a smaller micro-batch, and the
batch given back, take effect at the next step with no restart: the effective batch, the data order and
the update hold (tested against an unguarded run). With several processes (DDP, DeepSpeed), or
`GpuwatchCallback(split=False)`, the per-device batch itself changes instead: the callback asks the
Trainer to save a checkpoint and stop (`control.should_save`, `should_training_stop`), and `train()`
resumes from that checkpoint with the per-device batch down and `gradient_accumulation_steps` up by the
same factor, so the effective batch (per-device x accumulation x devices) holds; each such restart costs a
checkpoint save and load, measured and counted. An OOM the guard did not prevent always resumes from
the last checkpoint. A leak stop saves a checkpoint and ends training cleanly.

The planner (gpuwatch/control/planner.py) weighs, before each step, the per-device batches that keep
the effective batch and activation checkpointing - the model's own `gradient_checkpointing_enable` /
`disable`, switched between two steps with no restart - and counts each restart's measured cost (from the
request to the resumed run's first step) against what a larger batch would gain. The precision is the
Trainer's (`args.bf16` / `fp16` / `tf32`): the guard never "falls back" to one already in effect, and
does not switch the Trainer's (that is fixed for a `train()` call).

The sequence length of a step comes from `state.num_input_tokens_seen` (set
`include_num_input_tokens_seen=True` in the TrainingArguments), else from `seq_len=`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from gpuwatch.extras import require

require("gpuwatch.integrations.hf", "hf")  # one line naming the extra, not a bare ModuleNotFoundError

from transformers import TrainerCallback  # noqa: E402

from gpuwatch.contract import Action
from gpuwatch.control.policy import GuardConfig
from gpuwatch.integrations.batches import batch_size_of, chunks, per_device_batch, shares
from gpuwatch.integrations.loop import GuardedLoop


class GpuwatchCallback(TrainerCallback):
    def __init__(self, record_dir: str | Path | None = "recordings", name: str | None = None, guard: str = "on",
                 guard_config: GuardConfig | None = None, seq_len: int | None = None, restart: bool = True,
                 split: bool = True, **loop_kwargs: Any) -> None:
        """`loop_kwargs` go to `GuardedLoop` (memory_limit, risk_model, threshold, source, gpu_index...).
        `split`: run a smaller micro-batch inside the Trainer's step (one process only; `train()` installs it)
        rather than restart the Trainer with a smaller per-device batch; `restart`: allow those restarts."""
        self.record_dir, self.name, self.guard, self.guard_config = record_dir, name, guard, guard_config
        self.seq_len = seq_len
        self.restart = restart
        self.split = split
        self.splitting = False  # `train()` split the Trainer's step: micro-batch changes need no restart
        self.split_refused: str | None = None  # why `train()` could not split the step (then it restarts)
        self.micro: int | None = None  # the micro-batch each of the Trainer's batches runs as (None: whole)
        self.loop_kwargs = loop_kwargs
        self.loop: GuardedLoop | None = None
        self.pending: tuple[int, int] | None = None  # (per-device batch, accumulation) for the resumed run
        self.base_batch: int | None = None  # the user's own per-device batch (what is given back)
        self.restarts = 0
        self.ooms = 0  # OOMs the guard did not prevent (each resumed at half the per-device batch)
        self.effective: list[int] = []  # the effective batch of every optimizer step (tests, benchmarks)
        self._t0 = None
        self._tokens = 0
        self._said_seq = False
        self._lens: list[int] = []  # the sequence lengths of the last steps (the next one's estimate)
        self._restart_t0: float | None = None  # when the last restart was asked for (its cost runs to the next step)
        self.restart_costs: list[float] = []  # seconds per restart: checkpoint save, stop, load, resume
        self.step_overhead_s: list[float] = []  # gpuwatch's own time after each step (record, decide): the last 1,000

    # -- Trainer events --------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kw):
        if self.loop is None:
            kw = {"allow_bf16": False, **self.loop_kwargs}  # the Trainer's precision is its args'
            self.loop = GuardedLoop(model, None, record_dir=self.record_dir, name=self.name, guard=self.guard,
                                    guard_config=self.guard_config, label="Hugging Face Trainer",
                                    device=args.device, precision=trainer_precision(args), **kw)
            self.base_batch = args.per_device_train_batch_size
            self.loop.largest = self.base_batch
            # 0.0: a restart's cost not measured yet; None: the micro-batch changes with no restart (or not at all)
            self.loop.restart_cost_s = 0.0 if self.restart and not self.splitting else None
            self.loop.start()
            if self.split_refused:
                self.loop.bus.emit("guard_unable", f"Hugging Face Trainer: the step cannot be split in place "
                                   f"({self.split_refused}); a smaller micro-batch restarts the Trainer from a "
                                   "checkpoint instead", "warning", gpu=self.loop.gpu_index, state="no in-step split")
        self.loop.precision = trainer_precision(args)
        self._tokens = state.num_input_tokens_seen or 0
        self._decide(args, state, control)
        return control

    def on_step_begin(self, args, state, control, **kw):
        if self._t0 is None:
            self._t0 = time.perf_counter()
        if self._restart_t0 is not None:  # the first step after a restart: what the restart cost
            self.restart_costs.append(self._t0 - self._restart_t0)
            self._restart_t0 = None
            if not self.splitting:  # split in the step, the planner's changes restart nothing (an OOM's resume did)
                self.loop.restart_cost_s = sum(self.restart_costs) / len(self.restart_costs)
        return control

    def on_step_end(self, args, state, control, **kw):
        now = time.perf_counter()
        dt = now - (self._t0 or now)
        self._t0 = now  # the next step's time runs from here (it includes fetching its batches)
        e = self._effective(args)
        self.effective.append(e)
        self.loop.record_step(e, self._seq(args, state, e),
                              args.gradient_accumulation_steps * chunks(args.per_device_train_batch_size, self.micro), dt,
                              loss=_last_loss(state))
        self._decide(args, state, control)
        self.step_overhead_s = (self.step_overhead_s + [time.perf_counter() - now])[-1000:]
        return control

    def on_train_end(self, args, state, control, **kw):
        self._t0 = None
        if self.pending is None or not self.restart:
            self.close()
        return control

    def close(self) -> None:
        if self.loop is not None:
            self.loop.close()

    def restart_asked(self) -> None:
        """A restart starts now (a change of the per-device batch, or an OOM's): its cost runs from here to the
        resumed run's first step (the first request since a step ran counts; a second before it is the same one)."""
        if self._restart_t0 is None:
            self._restart_t0 = time.perf_counter()

    # -- deciding ---------------------------------------------------------------------------------------------
    def _effective(self, args) -> int:
        return args.per_device_train_batch_size * args.gradient_accumulation_steps

    def _seq(self, args, state, e: int) -> int:
        seen = state.num_input_tokens_seen or 0
        if seen > self._tokens:
            s = max(1, round((seen - self._tokens) / (e * max(1, args.world_size))))
            self._tokens = seen
            return s
        if self.seq_len is None and not self._said_seq:
            self._said_seq = True
            self.loop.bus.emit("guard_unable", "Hugging Face Trainer: the sequence length of a step is unknown; the "
                               "guard scores the batch alone. What would help: include_num_input_tokens_seen=True "
                               "in TrainingArguments, or GpuwatchCallback(seq_len=...)", "warning",
                               gpu=self.loop.gpu_index, state="no sequence length")
        return self.seq_len or 1

    def _decide(self, args, state, control) -> None:
        e = self._effective(args)
        self.loop.steps_left = max(0, state.max_steps - state.global_step) if (state.max_steps or 0) > 0 else None
        plan = self.loop.decide(e, self._peek_seq(args))
        if plan is None:  # the guard stopped the run (a leak): checkpoint, then end training cleanly
            self.pending = None
            control.should_save = True
            control.should_training_stop = True
            return
        per_dev = args.per_device_train_batch_size
        if self.splitting:  # the next step's batches run as micro-batches of the plan's size, no restart
            self.micro = self.loop.in_step_split(self.micro, plan.batch, per_dev, e, state.global_step,
                                                 "Trainer: each per-device batch", "no restart")
            return
        want = per_device_batch(e, min(self.base_batch or e, plan.batch))
        if self.restart and want != per_dev:
            self.restart_asked()
            self.pending = (want, e // want)
            control.should_save = True
            control.should_training_stop = True
            self.loop.bus.emit("control", f"Trainer: per-device batch {args.per_device_train_batch_size} -> {want}, "
                               f"gradient accumulation {args.gradient_accumulation_steps} -> {e // want} (effective "
                               f"batch {e} kept); checkpoint and resume", gpu=self.loop.gpu_index, control="restart",
                               value=[want, e // want], who="guard", why="the guard's micro-batch ceiling",
                               step=state.global_step)

    def _peek_seq(self, args) -> int:
        """The sequence length the next step is scored with. The Trainer fetches the next batch after this
        callback decided, so it is not known: the last step's, plus the largest rise between consecutive
        steps of the last few (a length-sorted or growing dataset: deciding on the last length alone is
        one step late, and that step was call 23's OOM in the HF ramp)."""
        last = int(self.loop.last_step.get("seq_len") or self.seq_len or 1)
        self._lens = (self._lens + [last])[-(PEEK_STEPS + 1):] if self.loop.last_step else self._lens
        return next_seq_estimate(self._lens) or last


PEEK_STEPS = 4


def next_seq_estimate(lens: list[int]) -> int | None:
    """The next step's sequence length from the last steps' (oldest first): the last, plus the largest rise
    between consecutive steps of the last `PEEK_STEPS` (no rise: the last). None without any."""
    if not lens:
        return None
    tail = lens[-(PEEK_STEPS + 1):]
    rise = max((b - a for a, b in zip(tail, tail[1:])), default=0)
    return int(tail[-1] + max(0, rise))


def trainer_precision(args) -> str:
    """The precision a Trainer's arguments run (mixed precision: autocast to it)."""
    if getattr(args, "bf16", False):
        return "bf16"
    if getattr(args, "fp16", False):
        return "fp16"
    return "tf32" if getattr(args, "tf32", False) else "fp32"


def train(trainer, max_restarts: int = 16, **train_kwargs):
    """`trainer.train(**train_kwargs)` with the guard. In one process the Trainer's step is split in place
    (`split_steps`): the guard's micro-batch applies from the next step, with no restart. Otherwise the run
    is resumed from its last checkpoint with the per-device batch and gradient accumulation the guard asked
    for, as often as it asks (at most `max_restarts`). An OOM the guard did not prevent is recorded and the
    run resumed from the last checkpoint (without one, from the start: those steps are run again) at half
    the micro-batch; at a micro-batch of 1 it is raised."""
    import torch
    from transformers.trainer_utils import get_last_checkpoint

    cb = next((c for c in trainer.callback_handler.callbacks if isinstance(c, GpuwatchCallback)), None)
    if cb is None:
        raise ValueError("add GpuwatchCallback() to the Trainer's callbacks first")
    if cb.split and not cb.splitting:
        cb.split_refused = split_refusal(trainer)  # said once the session is up (on_train_begin)
        if cb.split_refused is None:
            split_steps(trainer, cb)
    kw = dict(train_kwargs)
    try:
        while True:
            failed = None
            try:
                out = trainer.train(**kw)
            except torch.OutOfMemoryError as e:
                failed = str(e).splitlines()[0][:300]
            if failed is not None:  # outside the handler: its traceback pins the step's tensors
                cb.restart_asked()
                b, k = trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps
                cb.ooms += 1
                if cb.loop is not None:
                    g = cb.loop.guard
                    cb.loop.bus.emit("oom", f"CUDA OOM in the Trainer at per-device batch {b}", "error",
                                     gpu=cb.loop.gpu_index, batch=b, effective_batch=b * k, error=failed,
                                     step=trainer.state.global_step, micro_batches=k,
                                     seq_len_scored=cb.loop.next_plan().seq_len if cb.loop.next_plan() else None,
                                     guard_decision=None if g is None else g.last_decision.get(cb.loop.gpu_index))
                    if cb.loop.guard is not None:
                        cb.loop.guard.after_oom(cb.loop, b * k, b)
                micro = cb.micro or b
                if micro <= 1 or cb.restarts >= max_restarts:
                    raise torch.OutOfMemoryError(failed)
                if cb.splitting:  # the same per-device batch, resumed with its micro-batch halved in the step
                    nb, cb.pending = micro // 2, (b, k)
                    cb.micro = nb
                else:
                    nb = per_device_batch(b * k, b // 2)
                    cb.pending = (nb, b * k // nb)
                if cb.loop is not None:  # the guard's ceiling follows, so the resumed run is not talked back up
                    cb.loop.apply(Action("lower_ceiling", nb, f"OOM at micro-batch {micro}"), who="recovery")
                _free(trainer)
            if cb.pending is None or cb.restarts >= max_restarts or (cb.loop is not None and cb.loop.should_stop):
                return out
            b, k = cb.pending
            cb.pending = None
            cb.restarts += 1
            trainer.args.per_device_train_batch_size = b
            trainer.args.gradient_accumulation_steps = k
            trainer._train_batch_size = trainer.args.train_batch_size  # the Trainer keeps its own copy
            last = get_last_checkpoint(trainer.args.output_dir) if Path(trainer.args.output_dir).is_dir() else None
            kw = {**train_kwargs, "resume_from_checkpoint": last}
            if last is None and cb.loop is not None:
                cb.loop.bus.emit("oom_recovered", f"no checkpoint yet: the Trainer starts again at per-device batch {b} "
                                 f"x {k} accumulation", "warning", gpu=cb.loop.gpu_index, who="recovery", retried=True,
                                 decision=f"per-device batch -> {b}, accumulation -> {k}")
    finally:
        cb.pending = None
        cb.close()


def split_refusal(trainer) -> str | None:
    """Why the Trainer's step cannot be split in place (None: it can). It can with one process, the Trainer's
    own `training_step` and `compute_loss` (a subclass's may compute its loss or step in ways the split cannot
    weigh), and an optimizer that steps once per optimizer step (layer-wise optimizers step inside the
    backward hooks, LOMO inside the backward, DeepSpeed's engine counts an accumulation's backwards itself)."""
    from transformers import Trainer

    args = trainer.args
    if int(getattr(args, "world_size", 1) or 1) > 1 or int(getattr(args, "n_gpu", 1) or 1) > 1:
        return "several processes or GPUs"
    if getattr(trainer, "is_deepspeed_enabled", False):
        return "DeepSpeed"
    optim = str(getattr(getattr(args, "optim", None), "value", getattr(args, "optim", "")))
    if optim.endswith("_layerwise") or optim in ("lomo", "adalomo"):
        return f"optimizer {optim} steps inside the backward"
    for name in ("training_step", "compute_loss"):
        if getattr(type(trainer), name) is not getattr(Trainer, name):
            return f"{type(trainer).__name__} overrides {name}"
    return None


def split_steps(trainer, cb: GpuwatchCallback) -> None:
    """Run each batch of the Trainer's `training_step` as micro-batches of at most `cb.micro` rows: the
    Trainer's own step per micro-batch (its autocast, loss scaling and backward), the loss weighted by the
    micro-batch's share of the batch's label tokens (counted as the Trainer counts them) unless the Trainer
    already normalises it by the batch's item count, the losses summed as the Trainer sums its
    accumulation's. The optimizer still steps once per step."""
    step = trainer.training_step  # the bound method

    def training_step(model, inputs, num_items_in_batch=None, *a, **kw):
        try:
            k = chunks(batch_size_of(inputs), cb.micro)
        except TypeError:  # no batch dimension to split
            k = 1
        if k <= 1:
            return step(model, inputs, num_items_in_batch, *a, **kw)
        whole = _normalised_by_items(trainer, num_items_in_batch)
        parts = shares(inputs, k)
        weights = [1.0] * k if whole else _token_shares(trainer, [p for p, _w in parts]) or [w for _p, w in parts]
        total = None
        for (part, _w), w in zip(parts, weights):
            with _loss_scaled(trainer, w):
                out = step(model, part, num_items_in_batch, *a, **kw)
            total = out if total is None else total + out
        return total

    trainer.training_step = training_step
    cb.splitting = True


def _token_shares(trainer, parts: list) -> list[float] | None:
    """Each micro-batch's share of the batch's label tokens, counted as the Trainer counts items
    (`shift_labels`, else `labels[..., 1:]` for a causal LM loss, else `labels`; -100 ignored): a model's mean
    loss is over those tokens, so with padding a row share would weigh short rows wrong. None without 2-D
    labels (the row share then)."""
    counts = []
    shifts = None  # read once, at the first micro-batch that needs it
    for p in parts:
        lab = p.get("shift_labels") if hasattr(p, "get") else None
        if lab is None:
            lab = p.get("labels") if hasattr(p, "get") else None
            if lab is not None and getattr(lab, "dim", lambda: 0)() >= 2:
                shifts = _shifts_labels(trainer) if shifts is None else shifts
                lab = lab[..., 1:] if shifts else lab
        if lab is None or getattr(lab, "dim", lambda: 0)() < 2:
            return None
        counts.append(int(lab.ne(-100).sum()))
    total = sum(counts)
    return [c / total for c in counts] if total > 0 else None


def _shifts_labels(trainer) -> bool:
    """The model's loss is over `labels[..., 1:]` (a causal LM's): the model's loss function (what the Trainer
    counts items by as well, read from the model itself: the config may not name a `loss_type`, and GPT-2 then
    falls back to the causal loss)."""
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss

        m = trainer.accelerator.unwrap_model(trainer.model) if hasattr(trainer, "accelerator") else trainer.model
        return (getattr(m, "loss_function", None) is ForCausalLMLoss
                and not getattr(getattr(m, "config", None), "is_encoder_decoder", False))
    except Exception:  # noqa: BLE001 - an older transformers or a model without one: the Trainer's flag stands
        return False


def _normalised_by_items(trainer, num_items_in_batch) -> bool:
    """Whether the Trainer's loss is already the sum over the batch's items divided by their count (then a
    micro-batch's losses add up as they are), by the Trainer's own test."""
    flag = getattr(trainer, "loss_is_scaled_for_ga", None)
    if flag is not None:
        return bool(flag)
    return bool((getattr(trainer, "model_accepts_loss_kwargs", False) and num_items_in_batch is not None)
                or getattr(trainer, "compute_loss_func", None) is not None)


class _loss_scaled:
    """`trainer.compute_loss` times `w` while it is entered (the instance's own attribute, restored after)."""

    def __init__(self, trainer, w: float) -> None:
        self.trainer, self.w = trainer, w

    def __enter__(self):
        if self.w == 1.0:
            return self
        t, w = self.trainer, self.w
        self.had = "compute_loss" in t.__dict__
        self.prev = t.__dict__.get("compute_loss")
        inner = t.compute_loss

        def compute_loss(*a, **kw):
            out = inner(*a, **kw)
            return (out[0] * w, *out[1:]) if isinstance(out, tuple) else out * w
        t.compute_loss = compute_loss
        return self

    def __exit__(self, *exc) -> None:
        if self.w == 1.0:
            return
        if self.had:
            self.trainer.compute_loss = self.prev
        else:
            del self.trainer.compute_loss


def _free(trainer) -> None:
    import gc

    import torch

    if trainer.optimizer is not None:
        trainer.optimizer.zero_grad(set_to_none=True)
    trainer.model.zero_grad(set_to_none=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _last_loss(state) -> float | None:
    for rec in reversed(state.log_history or []):
        if "loss" in rec:
            return float(rec["loss"])
    return None
