"""gpuwatch's workload as the guard sees it (`gpuwatch.contract.GuardedWorkload`): the next step's plan,
the figures it reads back, the actions it accepts and how each one becomes a control of the workload's
own (applied by its thread before the next step). A base class of `runner.Workload`, apart from the
step loop because it is the contract's translation and nothing else; it reads the workload's own state.
"""

from __future__ import annotations

from gpuwatch.contract import Action, WorkloadView, expand_plan, lower_precisions
from gpuwatch.workload import mechanics as X


class GuardedSide:
    def guard_view(self) -> WorkloadView:
        last = self.last or {}
        return WorkloadView(gpu=self.cfg.gpu_index, ceiling=self.schedule.ceiling, last_ok_batch=self.last_ok_batch,
                            lower_precisions=lower_precisions(self.precision, self.bf16_supported),
                            manual=self.manual, last_peak_bytes=last.get("torch_peak_bytes"),
                            last_allocated_bytes=last.get("torch_allocated_bytes"),
                            last_reserved_bytes=last.get("torch_reserved_bytes"), device=self.device.type,
                            checkpointing=self.checkpointing if self._can_checkpoint() else None,
                            last_step_time_s=last.get("step_time_s"),
                            last_tokens=(int(last["batch"]) * int(last["seq_len"])) if last else None,
                            last_seq_len=last.get("seq_len"), steps=self._step,
                            last_checkpointing=bool(last.get("checkpointing")))

    def _can_checkpoint(self) -> bool:  # train mode, on the model's own switch
        return self.cfg.mode == "train" and X.can_checkpoint(getattr(self, "model", None))

    def accepts(self) -> frozenset[str]:
        acts = {"lower_ceiling", "raise_ceiling", "clear_ceiling", "refuse_step", "precision", "stop", "plan"}
        if self._can_checkpoint():
            acts.add("checkpointing")
        if self.device.type == "cuda":
            acts |= {"release_cache", "name_leak"}
        return frozenset(acts)

    def apply(self, action: Action, who: str = "guard") -> None:
        """Hand one guard action to the workload; it takes effect before the next step."""
        k, v, why = action.kind, action.value, action.why
        if k in ("lower_ceiling", "raise_ceiling"):
            self.set_ceiling(v, who=who, why=why)
        elif k == "clear_ceiling":
            self.set_ceiling(None, who=who, why=why)
        elif k == "refuse_step":  # one control: a separate ceiling would be overridden by the hold
            self.hold(who=who, why=why, batch=v)
        elif k == "precision":
            if v != self.precision:
                self.set_precision(v, who=who, why=why)
        elif k == "checkpointing":
            if bool(v) != self.checkpointing:
                self._put("checkpointing", bool(v), who, why)
        elif k == "plan":  # the planner's configuration, as the elementary changes (contract.expand_plan)
            wanted = self.schedule.wanted()
            for a in expand_plan(action, self.schedule.ceiling, wanted[0] if wanted else None):
                self.apply(a, who)
        elif k == "release_cache":
            self._put("release_cache", bool(v), who, why)
        elif k == "stop":  # a leak: end cleanly (the summary and the recording close as after --duration)
            self.stopped_by = why
            self._stop.set()
            self._resume.set()
        elif k != "name_leak":
            raise ValueError(f"unknown guard action {k!r}")
