"""The user's loop as the guard and the session see it (`gpuwatch.contract.GuardedWorkload` and
`SessionWorkload`): the next step's plan, the figures the guard reads back, the actions it accepts and
how each becomes the loop's own state (applied before the next step, by the loop's thread), the
allocator snapshot it asks for, and what the session records and asks of a workload. A base class of
`loop.GuardedLoop`, apart from the loop's API and its steps because it is the contract's translation
and nothing else (as `workload/guarded.py` is for gpuwatch's workload); it reads the loop's own state,
which `GuardedLoop.__init__` sets and the loop's steps keep.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gpuwatch.contract import Action, StepPlan, WorkloadView, expand_plan
from gpuwatch.integrations.batches import chunks
from gpuwatch.predict import ahead as A
from gpuwatch.workload import mechanics as X
from gpuwatch.workload.allocator import release_cache


class LoopGuardedSide:
    """The `GuardedWorkload` (and `SessionWorkload`) members of `GuardedLoop`."""

    # -- the guard's contract (GuardedWorkload) ------------------------------------------------------------
    def next_plan(self) -> StepPlan | None:
        w = self._wanted
        if w is None or self.should_stop:
            return None
        (n, s), micro = w, self.running_micro_batch(w[0])
        ah = A.capped(A.pick(self._shapes), self.running_micro_batch(None))  # this step first
        return StepPlan(batch=micro, seq_len=s, precision=self.precision, mode="train",
                        micro_batches=chunks(n, micro), effective_batch=n, wanted_batch=n,
                        ahead_batch=ah["ahead_batch"], ahead_seq_len=ah["ahead_seq_len"], ahead_steps=ah["ahead_steps"],
                        checkpointing=self.checkpointing, in_hand=self._in_hand)

    def running_micro_batch(self, n: int | None) -> int | None:
        """The micro-batch a step of `n` rows runs as (n None: the cap alone, or None): a framework's fixed one, else
        under the ceiling and its per-device batch (a Trainer's 4 x 4 runs 4s; shown 16, s50's observe arm re-planned)."""
        caps = [c for c in ((self.micro_batch_fixed,) if self.micro_batch_fixed else (self.ceiling, self.largest)) if c]
        return min(caps + [n]) if n is not None else (min(caps) if caps else None)

    def guard_view(self) -> WorkloadView:
        last = self._last
        lower = ("bf16",) if self.allow_bf16 and self.precision == "fp32" and _bf16_ok(self.device) else ()
        fixed = self.micro_batch_fixed
        floor = max(self.floor, fixed) if fixed else self.floor
        largest = fixed if fixed else self.largest
        return WorkloadView(gpu=self.gpu_index, ceiling=self.ceiling, last_ok_batch=self.last_ok_batch,
                            floor=floor, lower_precisions=lower, manual=self.manual,
                            last_peak_bytes=last.get("torch_peak_bytes"),
                            last_allocated_bytes=last.get("torch_allocated_bytes"),
                            last_reserved_bytes=last.get("torch_reserved_bytes"), device=self.device.type,
                            checkpointing=self.checkpointing if self.can_checkpoint else None,
                            restart_cost_s=self.restart_cost_s, last_step_time_s=self._last_dt,
                            last_tokens=(int(last["batch"]) * int(last["seq_len"])) if last else None,
                            last_seq_len=last.get("seq_len"), steps=self.steps,
                            last_checkpointing=bool(last.get("checkpointing")), largest=largest,
                            steps_left=self.steps_left)

    @property
    def can_checkpoint(self) -> bool:
        return X.can_checkpoint(self.model, self.checkpointing_hook)

    def accepts(self) -> frozenset[str]:
        acts = {"lower_ceiling", "raise_ceiling", "clear_ceiling", "refuse_step", "stop", "plan"}
        if self.can_checkpoint:
            acts.add("checkpointing")
        if self.allow_bf16:
            acts.add("precision")
        if self.device.type == "cuda":
            acts |= {"release_cache", "name_leak"}
        return frozenset(acts)

    def apply(self, action: Action, who: str = "guard") -> None:
        with self._lock:
            self._pending.append((action, who))

    def _apply_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        steps = [a for act, who in pending
                 for a in ((x, who) for x in expand_plan(act, self.ceiling, (self._wanted or (None,))[0]))]
        for act, who in steps:
            k, v = act.kind, act.value
            if k in ("checkpointing", "precision") and v == (self.checkpointing if k == "checkpointing" else self.precision):
                continue  # a plan restates what is already in effect
            if k in ("lower_ceiling", "raise_ceiling", "refuse_step"):
                v = max(self.floor, int(v))
                self.ceiling = v
            elif k == "clear_ceiling":
                self.ceiling = v = None
            elif k == "precision":
                self.precision = v
            elif k == "checkpointing":
                if not self.can_checkpoint:
                    continue
                X.set_checkpointing(self.model, bool(v), self.checkpointing_hook)
                self.checkpointing = v = bool(v)
            elif k == "release_cache":
                v = ", ".join(release_cache(self.device, expandable=bool(v))) or "nothing to release here"
                self.remedies.append(v)
                self.bus.emit("guard_remedy", f"fragmentation: {v}", "warning", gpu=self.gpu_index,
                              remedy="release_cache", result=v)
            elif k == "stop":
                self._stop_why = act.why
                continue
            else:
                continue
            control = {"lower_ceiling": "ceiling", "raise_ceiling": "ceiling", "clear_ceiling": "ceiling",
                       "refuse_step": "hold"}.get(k, k)
            shown = "none (lifted)" if v is None else v
            self.bus.emit("control", f"{control} -> {shown} ({who}: {act.why})", gpu=self.gpu_index,
                          control=control, value=v, who=who, why=act.why, step=self.steps)

    def request_snapshot(self, directory: Path | None, reason: str) -> None:
        self._snapshot_req = (reason, directory)

    def _maybe_snapshot(self) -> None:
        req, self._snapshot_req = self._snapshot_req, None
        if req is not None and self.device.type == "cuda":
            from gpuwatch.workload.memsnap import snapshot_event

            snapshot_event(self.bus, self.device, req, self._baseline, self.gpu_index, "allocator snapshot")

    # -- what the session records and the runtime asks -----------------------------------------------------
    def describe(self) -> dict[str, Any]:
        n, s = self._wanted or (None, None)
        params = self._params
        return {"preset": "user", "mode": "train", "schedule": "user", "precision": self.precision, "batch": n,
                "seq_len": s, "device": str(self.device), "params": params, "overrides": {},
                "faults": {"memory_limit_bytes": self.memory_limit_bytes}, "integrity_every": 0, "seed": None,
                "gpu_index": self.gpu_index, "library": "gpuwatch.integrations.GuardedLoop", "label": self.label}

    honours_deadline = False  # a user's loop is never told --duration's end (gpuwatch.contract.SessionWorkload)
    ends_at: float | None = None

    def past_end(self) -> bool:
        return False

    @property
    def device_name(self) -> str:
        return self._device_name

    @property
    def unrecovered(self) -> str | None:
        """Why the loop failed (`fail`), once it has."""
        return self.stopped if self.state == "failed" else None

    def export_state(self) -> dict[str, Any]:
        return {"step": self.steps, "precision": self.precision, "ooms": self.ooms, "retries": self.retries}

    def stop(self, join: bool = True) -> None:
        """The session is stopping (Session.stop calls every workload's): nothing runs on a thread here,
        the state says the loop is over."""
        if self.state not in ("stopped", "failed"):
            self.state = "finished" if self.stopped is None else "stopped"


def _bf16_ok(dev: torch.device) -> bool:
    return dev.type != "cuda" or bool(torch.cuda.is_bf16_supported())
