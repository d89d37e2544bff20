"""One optimizer step of the user's loop as it runs and as it is recorded: the micro-batches' forward and
backward (under the precision's autocast) and the one update (`_run`), the steps row with the allocator's
figures and the training FLOPs (`_record`, `_flops`), an OOM the guard did not prevent (`_recover`: the
`oom` and `oom_recovered` events, the same step retried at half the micro-batch, at the floor a stop) and
the clean stop (`_stop`: the user's checkpoint hook first). A base class of `loop.GuardedLoop`, apart from
the loop's API (`step()` decides, then runs these) and from the guard's side (`guarded.py`); it reads and
keeps the loop's own state, which `GuardedLoop.__init__` sets. The allocator's figures come through `_mem`,
which tests override to fake them.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

from gpuwatch.integrations.batches import Batch, shares
from gpuwatch.predict import ahead as A
from gpuwatch.workload import flops as F
from gpuwatch.workload import mechanics as X


class LoopSteps:
    """How `GuardedLoop` runs, records and recovers a step."""

    def _run(self, batch: Batch, k: int, loss_fn) -> float | None:
        total = None
        amp = self.precision in ("bf16", "fp16")
        for part, w in shares(batch, k):
            if amp:
                with torch.autocast(self.device.type, dtype=torch.bfloat16 if self.precision == "bf16" else torch.float16):
                    loss = loss_fn(part)
            else:
                loss = loss_fn(part)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
                raise ValueError(f"loss_fn must return a scalar tensor (got shape {shape})")
            (loss * w).backward()
            d = loss.detach() * w
            total = d if total is None else total + d
            del loss
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return float(total) if (self.record_loss and total is not None) else None

    def _record(self, n: int, s: int, micro: int, k: int, loss: float | None, dt: float) -> None:
        self.steps += 1
        self.state = "running"
        self.last_ok_batch = micro
        self._last_dt = dt
        mem = {**self._mem(), **X.blocks(self.device)}  # what X.step_memory reads, with memory() through _mem (tests fake it)
        if self._baseline is None and self.device.type == "cuda" and self.guard is not None:
            from gpuwatch.workload.memsnap import baseline

            self._baseline = baseline(self.device)
        row = {"ts": time.time_ns() // 1000, "step": self.steps - 1, "gpu": self.gpu_index, "mode": "train",
               "phase": "train", "precision": self.precision, "batch": n, "seq_len": s, "step_time_s": dt,
               "tokens_per_s": n * s / dt if dt > 0 else None, **self._flops(n * s, dt), "loss": loss,
               "max_abs_logit": None, **mem, "expert_impl": None, "micro_batches": k,
               "next_batch": self.running_micro_batch(n), "next_seq_len": s,  # what the live plan shows
               "next_precision": self.precision, **A.capped(A.pick(self._shapes[1:]), self.running_micro_batch(None)),
               "checkpointing": self.checkpointing}
        if len(self._shapes) > 1:  # wrap knows the next batch: that is the plan
            nb, ns = self._shapes[1]
            row.update(next_batch=self.running_micro_batch(nb), next_seq_len=ns)
        self._ends = (self._ends + [row["ts"] / 1e6])[-(A.PACE_STEPS + 1):]
        self._in_hand = False  # the batch in hand has run: between steps the next one is not known
        self._last = row
        self.bus.steps.append(row)
        self._maybe_snapshot()

    def _flops(self, tokens: int, dt: float) -> dict[str, float | None]:
        """Training FLOPs by the usual estimate, 6 x parameters x tokens (forward 2, backward 4; attention's
        own FLOPs left out), and the share of the device's dense peak at this precision."""
        if self._params is None or dt <= 0:
            return {"tflops": None, "mfu": None}
        tf = 6.0 * self._params * tokens / dt / 1e12
        peak = F.peak_tflops(self._device_name, self.precision)
        return {"tflops": tf, "mfu": tf / peak if peak else None}

    def _recover(self, failure: str, n: int, s: int, micro: int, before: int | None) -> bool:
        """An OOM the guard did not prevent: free, record, and retry the same batch at half the
        micro-batch (same effective batch). At the floor: checkpoint and stop. True = retry."""
        self.ooms += 1
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        elif self.model is not None:
            self.model.zero_grad(set_to_none=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.bus.emit("oom", X.oom_message(micro, s, self.precision), "error", gpu=self.gpu_index,
                      **X.oom_detail(micro=micro, seq=s, precision=self.precision, error=failure, effective_batch=n,
                                     allocated_before=before, step=self.steps, checkpointing=self.checkpointing,
                                     phase=None, reserved_before=self._last.get("torch_reserved_bytes"),
                                     limit_bytes=self.memory_limit_bytes,
                                     guard_decision=None if self.guard is None else self.guard.last_decision.get(self.gpu_index)))
        if self.guard is not None:
            self.guard.after_oom(self, n, micro)
        after = self._mem().get("torch_allocated_bytes")
        if micro <= self.floor:
            self.bus.emit("oom_recovered", "not recovered: the micro-batch is at its floor; stopping cleanly",
                          "error", gpu=self.gpu_index,
                          **X.recovered_detail(decision="stop", retried=False, allocated_before=before,
                                               allocated_after=after, next_batch=None, next_seq_len=None,
                                               next_precision=None))
            self._stop(f"OOM at the micro-batch floor ({micro} x {s})")
            return False
        self.ceiling = max(self.floor, micro // 2)
        self.retries += 1
        self.bus.emit("oom_recovered", f"recovered: micro-batch ceiling -> {self.ceiling}, same step retried "
                      f"(effective batch {n} kept)", "warning", gpu=self.gpu_index,
                      **X.recovered_detail(decision=f"ceiling -> {self.ceiling}", retried=True, retry_control="ceiling",
                                           retry_value=self.ceiling, allocated_before=before, allocated_after=after,
                                           next_batch=self.ceiling, next_seq_len=s, next_precision=self.precision))
        return True

    def _stop(self, why: str) -> None:
        """Call the user's checkpoint hook, then stop: the loop's next `step()` and `wrap()` end."""
        saved = None
        if self.checkpoint is not None:
            try:
                saved = self.checkpoint(self.steps)
                self.bus.emit("guard_remedy", f"checkpoint hook called at step {self.steps} before stopping",
                              "warning", gpu=self.gpu_index, remedy="checkpoint", step=self.steps,
                              saved=None if saved is None else str(saved))
            except Exception as e:  # noqa: BLE001 - a failing hook is said; the stop still happens
                self.bus.emit("guard_remedy", f"checkpoint hook failed: {type(e).__name__}: {e}", "error",
                              gpu=self.gpu_index, remedy="checkpoint", step=self.steps)
        self.stopped = why
        self.state = "stopped"

    def _mem(self) -> dict[str, Any]:
        return X.memory(self.device)
