"""gpuwatch's guard in a Lightning `Trainer` (`pip install 'gpuwatch[lightning]'`).

    gw = GpuwatchLightningCallback()
    trainer = L.Trainer(callbacks=[gw], reload_dataloaders_every_n_epochs=1)
    trainer.fit(model, train_dataloaders=gw.dataloader(dataset, batch_size=8, shuffle=True))

and, for a micro-batch that changes at any step, one line in your module:

    def training_step(self, batch, i):
        return gw.step(self, batch, lambda b: self.loss_of(b))   # b: a micro-batch; its mean loss

`gw.step` runs the batch as micro-batches under the guard's ceiling inside the step (one process,
automatic optimization): each micro-batch's mean loss times its share, all but the last backpropagated
through Lightning's own `strategy.backward` (its precision plugin and loss scaling; its backward hooks see
each micro-batch), the last returned for Lightning to backpropagate; the optimizer steps once, so the
effective batch and the update hold (tested against an unguarded run). The guard then plans the
micro-batch, given back as well as taken, at every optimizer step, with no restart and no wait for the
epoch's end.

Without `gw.step` - what Lightning allows: `trainer.accumulate_grad_batches` may change between epochs (that is what its
GradientAccumulationScheduler does), and a data loader is re-read each epoch with
`reload_dataloaders_every_n_epochs=1`; mid-epoch neither can change without breaking the accumulation's
alignment (it counts batches from the epoch's start) and the loader prefetches a batch ahead. So the
guard decides after every optimizer step (recorded, scored, every action an event); mid-epoch it is shown
the running per-device batch as fixed, so it plans only what can change then (activation checkpointing),
and a new micro-batch takes effect at the next epoch: the data loader from `gw.dataloader(...)` yields
batches of the new per-device size and the accumulation goes up by the same factor, so the effective
batch holds (and the sampler's order with it). A leak stop saves a checkpoint
(`trainer.save_checkpoint`, or your `checkpoint` hook) and sets `trainer.should_stop`: the run ends
cleanly after the current step.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from gpuwatch.extras import require

require("gpuwatch.integrations.lightning", "lightning")  # one line naming the extra

import lightning as L  # noqa: E402
import torch  # noqa: E402

from gpuwatch.control.policy import GuardConfig
from gpuwatch.integrations.batches import batch_size_of, chunks, per_device_batch, seq_len_of, shares
from gpuwatch.integrations.loop import GuardedLoop


def lightning_precision(trainer) -> str:
    """The precision a Lightning Trainer runs ("bf16-mixed", "16-mixed", "32-true", "bf16-true"...)."""
    p = str(getattr(trainer, "precision", "32-true"))
    return "bf16" if p.startswith("bf16") else "fp16" if p.startswith("16") else "fp32"


def _loss_from(trainer, pl_module) -> str | None:
    """Where a batch's loss is read from under automatic optimization (each divided by the accumulation):
    "backward" - the loss `on_before_backward` sees, right after the forward; "output" - the batch's output at
    its end, where fp16-mixed's scaler scales the backward's loss (its inf check reads the host every step
    anyway); None under manual optimization (the step's output as returned)."""
    if not pl_module.automatic_optimization:
        return None
    return "output" if getattr(trainer.precision_plugin, "scaler", None) is not None else "backward"


def _stop_fit(loop: GuardedLoop, trainer) -> None:
    """End the fit after this step: `should_stop`, and Lightning's `min_steps` / `min_epochs` lifted where they
    would keep it running (Lightning says "Training will continue..." and the guard could act no more)."""
    trainer.should_stop = True
    fl = trainer.fit_loop
    try:
        kept = (fl.epoch_loop.min_steps or 0) > trainer.global_step or (fl.min_epochs or 0) > trainer.current_epoch
        if kept:
            fl.epoch_loop.min_steps, fl.min_epochs = None, 0
            loop.bus.emit("guard_remedy", "Lightning: min_steps / min_epochs lifted so that the guard's stop ends the fit",
                          "warning", gpu=loop.gpu_index, remedy="stop", step=loop.steps)
    except AttributeError:  # another Lightning's loops: the fit may run on to its minimum
        pass


def _accumulation(trainer) -> int:
    """The batches each optimizer step accumulates (`accumulate_grad_batches`, at least 1)."""
    return max(1, int(trainer.accumulate_grad_batches))


def _steps_left(trainer) -> int | None:
    """Optimizer steps the fit still has: `max_steps` where set, else Lightning's own estimate."""
    try:
        total = trainer.max_steps if (trainer.max_steps or -1) > 0 else trainer.estimated_stepping_batches
        return max(0, int(total) - int(trainer.global_step))
    except Exception:  # noqa: BLE001 - inf (max_epochs=-1) or not computable here: the planner's own horizon
        return None


class ResizableBatchSampler(torch.utils.data.Sampler):
    """Batches of `batch_size` indices from `sampler`; the size is read when an epoch starts."""

    def __init__(self, sampler, batch_size: int, drop_last: bool = False) -> None:
        self.sampler, self.batch_size, self.drop_last = sampler, int(batch_size), drop_last

    def __iter__(self):
        b, batch = self.batch_size, []
        for i in self.sampler:
            batch.append(i)
            if len(batch) == b:
                yield batch
                batch = []
        if batch and not self.drop_last:
            yield batch

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)


class StepLoss:
    """An optimizer step's loss, read without waiting for the step. Each loss Lightning backpropagates (already
    divided by the accumulation, so their sum is the step's mean) is summed on its device and copied,
    non-blocking, into pinned host memory behind an event (Lightning divides by the accumulation even where
    an epoch's last step runs fewer batches: the callback scales by what ran); `take()` waits for that event only - the step's
    last forward - not for the backward and optimizer step queued after it. Reading the loss at the step's
    end otherwise (`float(loss)`) is a host sync every step, which an unguarded Lightning loop without a
    logged loss does not have: the GPU then idles while the guard records and decides and Lightning fetches
    the next batch. On the CPU, or where pinned memory fails, `take()` reads the sum directly."""

    def __init__(self) -> None:
        self._sum: torch.Tensor | None = None
        self._buf: torch.Tensor | None = None
        self._event = None
        self._pinned = True  # False once pinned memory failed: read the sum directly
        self.count = 0  # losses added since the last take

    def add(self, loss: Any) -> None:
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            return
        d = loss.detach().float().reshape(())
        self._sum = d if self._sum is None else self._sum + d
        self.count += 1
        if not (d.is_cuda and self._pinned):
            return
        try:
            if self._buf is None:
                self._buf, self._event = torch.empty((), dtype=torch.float32, pin_memory=True), torch.cuda.Event()
            self._buf.copy_(self._sum, non_blocking=True)
            self._event.record()
        except RuntimeError:  # no pinned memory here: take() reads the sum (a sync, as before)
            self._pinned, self._buf, self._event = False, None, None

    def take(self) -> float | None:
        """The loss summed since the last take (None if none was added); resets the sum and the count."""
        s, self._sum, self.count = self._sum, None, 0
        if s is None:
            return None
        if self._event is not None and s.is_cuda:  # (None once pinned memory failed)
            self._event.synchronize()
            return float(self._buf)  # pinned host memory: no device sync
        return float(s)


class GpuwatchLightningCallback(L.Callback):
    def __init__(self, record_dir: str | Path | None = "recordings", name: str | None = None, guard: str = "on",
                 guard_config: GuardConfig | None = None, checkpoint=None, **loop_kwargs: Any) -> None:
        self.record_dir, self.name, self.guard, self.guard_config = record_dir, name, guard, guard_config
        self.checkpoint = checkpoint
        self.loop_kwargs = loop_kwargs
        self.loop: GuardedLoop | None = None
        self.sampler: ResizableBatchSampler | None = None
        self.base_batch: int | None = None
        self.effective: list[int] = []  # the effective batch of every optimizer step
        self._trainer = None
        self._step_seen = 0
        self._t0: float | None = None
        self._seq = 1  # the longest sequence of the running optimizer step's batches (its row's, its decision's)
        self._batch_n = 1
        self._can_resize = False
        self.splitting = False  # `step()` runs the batches: the micro-batch changes at any step
        self.micro: int | None = None  # the micro-batch `step()` runs a batch as (None: whole)
        self._said_whole = False
        self._batch_idx = 0
        self._held: list = []  # (parameter, gradient) set aside over Lightning's zeroing (`step`)
        self._loss = StepLoss()  # the step's loss, read without a host sync at the step's end
        self._assumed: tuple[int, int] | None = None  # (length, accumulation) the last decision with `step()` assumed
        self._inner = False  # `step()`'s own backward of a micro-batch (its loss is in the one Lightning returns)

    def step(self, module, batch, loss_fn) -> torch.Tensor:
        """Your `training_step`'s loss, with the batch run as micro-batches under the guard's ceiling:
        `loss_fn(micro_batch)` returns a micro-batch's mean loss. Returns what `training_step` returns."""
        trainer = module.trainer
        if not (trainer.training and module.training and torch.is_grad_enabled()):
            return loss_fn(batch)  # validation or prediction through the same step: nothing to split
        why = None
        if trainer.world_size != 1:
            why = "several processes"
        elif not module.automatic_optimization:
            why = "manual optimization"
        elif self not in trainer.callbacks:
            why = "this callback is not among the Trainer's callbacks"
        if why is not None:
            if not self._said_whole and self.loop is not None:
                self._said_whole = True
                self.loop.bus.emit("guard_unable", f"Lightning: gw.step runs the batch whole ({why}); the micro-batch "
                                   "changes between epochs only", "warning", gpu=self.loop.gpu_index,
                                   state="no in-step split")
            return loss_fn(batch)
        n = batch_size_of(batch)
        self.splitting = True
        acc = _accumulation(trainer)
        try:  # the batch `step()` is given (a training_step may tokenize what the loader gave)
            s = seq_len_of(batch)
        except TypeError:
            s = self._seq
        first = self._batch_idx % acc == 0
        self._note_length(s, first)
        a = self._assumed
        if first and (a is None or a[1] != acc or (acc == 1 and a[0] != s)):
            # nothing decided yet, the accumulation changed since, or (in hand) another length than assumed
            self._decide(trainer, self._per_device(trainer) * acc)
            if self.loop.should_stop:  # a stop with nothing run since the step's end: this batch still runs (Lightning
                self.micro = 1  # cannot skip it without a phantom optimizer step), one row at a time
        k = chunks(n, self.micro)
        if k <= 1:
            return loss_fn(batch)
        parts = shares(batch, k)
        # Lightning zeroes the gradients after training_step returns, before its backward, on the first batch of
        # an accumulation: there the micro-batches' gradients are set aside (no copy) and put back just before
        # that backward (`on_before_backward`); the stale ones of the last step are dropped first, as Lightning
        # would drop them, so nothing is held twice
        params = [p for p in module.parameters() if p.requires_grad]
        if first:
            for p in params:
                p.grad = None
        done = None
        for part, w in parts[:-1]:
            loss = loss_fn(part) * w
            self._inner = True
            try:
                trainer.strategy.backward(loss / acc, None)  # as Lightning scales the returned loss
            finally:
                self._inner = False
            d = loss.detach()
            done = d if done is None else done + d
            del loss
        if first:
            self._held = [(p, p.grad) for p in params if p.grad is not None]
            for p, _g in self._held:
                p.grad = None
        part, w = parts[-1]
        return loss_fn(part) * w + done

    def _note_length(self, s: int, first: bool) -> None:
        """A batch's sequence length: the step's is the longest of its batches (`first`: the step's first)."""
        self._seq = s if first else max(self._seq, s)

    def _decide(self, trainer, effective: int) -> None:
        """The guard decides the next step with `step()` (the micro-batch in the step). At a step's end
        (`on_train_batch_end`, where a leak stop still ends the fit before another batch runs) it assumes the next
        batch is as long as the last: in hand, so the longest recent length is not assumed to come; `step()`
        decides again on the batch in hand only where its length is another (a new length, an epoch's wrap) or
        nothing was decided yet (the first step). With accumulation the step's other batches are not in hand:
        there each step is decided once, at its end, the longest recent length assumed."""
        self.loop.micro_batch_fixed = None
        self.loop.steps_left = _steps_left(trainer)
        if self.sampler is None:  # the user's own loader: its batch is the largest micro-batch (review of 5c2159a)
            self.loop.largest = max(self.loop.largest or 0, self._per_device(trainer))
        acc = _accumulation(trainer)
        self._assumed = (self._seq, acc)
        plan = self.loop.decide(effective, self._seq, in_hand=acc == 1)
        if plan is None:  # a leak: checkpoint saved by the hook; the fit ends after this step (a stop is decided at
            _stop_fit(self.loop, trainer)  # a step's end, before the next batch, unless nothing has run since)
            return
        self.micro = self.loop.in_step_split(self.micro, plan.batch, self._per_device(trainer), effective,
                                             trainer.global_step, "Lightning: each batch", "no wait for the epoch's end")

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        """Lightning's own backward is next, its zeroing done: the micro-batches' gradients go back, and its
        loss (the batch's, over the accumulation) is added to the step's."""
        held, self._held = self._held, []
        for p, g in held:
            p.grad = g if p.grad is None else p.grad.add_(g)
        if not self._inner and _loss_from(trainer, pl_module) == "backward":
            self._loss.add(loss)

    def dataloader(self, dataset, batch_size: int, shuffle: bool = False, drop_last: bool = False,
                   generator: torch.Generator | None = None, **kw) -> torch.utils.data.DataLoader:
        """A DataLoader whose batch size the guard can change between epochs."""
        base = (torch.utils.data.RandomSampler(dataset, generator=generator) if shuffle
                else torch.utils.data.SequentialSampler(dataset))
        self.sampler = ResizableBatchSampler(base, batch_size, drop_last)
        self.base_batch = int(batch_size)
        return torch.utils.data.DataLoader(dataset, batch_sampler=self.sampler, **kw)

    # -- Lightning events -------------------------------------------------------------------------------------
    def on_train_start(self, trainer, pl_module) -> None:
        self._trainer = trainer
        self._step_seen = trainer.global_step
        self._assumed, self._t0, self.micro, self.splitting = None, None, None, False
        if self.loop is not None and self.loop.state in ("finished", "stopped", "failed"):
            self.loop = None  # a second fit with this callback: its own session (the last one was closed)
        if self.loop is None:
            kw = {"allow_bf16": False, **self.loop_kwargs}  # Lightning's precision is fixed for a fit()
            self.loop = GuardedLoop(pl_module, None, record_dir=self.record_dir, name=self.name, guard=self.guard,
                                    guard_config=self.guard_config, label="Lightning Trainer",
                                    device=pl_module.device, checkpoint=self._save,
                                    precision=lightning_precision(trainer), **kw)
            self.base_batch = self.base_batch or None
            self.loop.largest = self.base_batch
            self.loop.start()
        self._can_resize = self.sampler is not None and trainer.reload_dataloaders_every_n_epochs == 1
        if not self._can_resize:
            self.loop.bus.emit("guard_unable", "Lightning: the guard cannot change the batch of this data loader; it "
                               "records, scores, and stops cleanly on a leak. What would help: train_dataloaders="
                               "gw.dataloader(dataset, batch_size) and Trainer(reload_dataloaders_every_n_epochs=1)",
                               "warning", gpu=self.loop.gpu_index, state="fixed data loader")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._t0 is None:
            self._t0 = time.perf_counter()
        self._batch_idx = batch_idx
        try:
            s, self._batch_n = seq_len_of(batch), batch_size_of(batch)
        except TypeError:
            return
        self._note_length(s, batch_idx % _accumulation(trainer) == 0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._held:  # training_step returned None (a skipped batch): no backward came for what step() set aside
            for p, _g in self._held:
                p.grad = None
            self._held = []
        if _loss_from(trainer, pl_module) == "output":
            self._loss.add(outputs.get("loss") if isinstance(outputs, dict) else outputs)
        if trainer.global_step == self._step_seen:
            return  # still accumulating
        self._step_seen = trainer.global_step
        now = time.perf_counter()
        dt, self._t0 = now - (self._t0 or now), now
        k = trainer.accumulate_grad_batches
        e = self._per_device(trainer) * k
        self.effective.append(e)
        got = self._step_loss(trainer, pl_module, outputs)
        per_dev = self._per_device(trainer)
        self.loop.record_step(e, self._seq, k * chunks(per_dev, self.micro), dt, loss=got)
        if self.splitting:
            self._decide(trainer, e)
            return
        # mid-epoch without `step()`: only checkpointing can change now
        self.loop.micro_batch_fixed = per_dev
        self.loop.steps_left = _steps_left(trainer)
        if self.loop.decide(e, self._seq) is None:  # a leak: checkpoint saved by the hook, stop after this step
            _stop_fit(self.loop, trainer)

    def _step_loss(self, trainer, pl_module, outputs) -> float | None:
        """The optimizer step's mean loss over the batches that ran: their losses (each divided by the
        accumulation by Lightning, also where an epoch's last step ran fewer) summed and scaled by
        accumulation / batches. Under manual optimization: the step's output as returned."""
        n, got = self._loss.count, self._loss.take()
        if got is not None:
            return got * _accumulation(trainer) / max(1, n)
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        return float(loss.detach()) if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        """Between epochs: the guard's ceiling becomes the next epoch's per-device batch."""
        if not self._can_resize or self.loop.should_stop or self.splitting:
            return  # with `step()` the micro-batch has changed in the step already
        k = trainer.accumulate_grad_batches
        e = self._per_device(trainer) * k
        self.loop.micro_batch_fixed = None  # between epochs: the next epoch's per-device batch is open
        plan = self.loop.decide(e, self._seq)
        if plan is None:
            _stop_fit(self.loop, trainer)
            return
        want = per_device_batch(e, min(self.base_batch or e, plan.batch))
        if want != self.sampler.batch_size:
            self.loop.bus.emit("control", f"Lightning: per-device batch {self.sampler.batch_size} -> {want}, "
                               f"accumulate_grad_batches {k} -> {e // want} from the next epoch (effective batch "
                               f"{e} kept)", gpu=self.loop.gpu_index, control="epoch_batch", value=[want, e // want],
                               who="guard", why="the guard's micro-batch ceiling")
            self.sampler.batch_size = want
            trainer.accumulate_grad_batches = e // want

    def on_train_end(self, trainer, pl_module) -> None:
        if self.loop is not None:
            self.loop.close()

    def _per_device(self, trainer) -> int:
        return self.sampler.batch_size if self.sampler is not None else self._batch_n

    def _save(self, step: int):
        if self.checkpoint is not None:
            return self.checkpoint(step)
        if self._trainer is None:
            return None
        path = Path(self._trainer.default_root_dir) / f"gpuwatch-stop-step{step}.ckpt"
        self._trainer.save_checkpoint(path)
        return path
