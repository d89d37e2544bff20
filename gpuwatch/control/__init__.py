"""Layer 3a: the guard turns risk into actions on a workload. It knows nothing of torch: it drives any
object implementing `GuardedWorkload` (gpuwatch.contract) - gpuwatch's own DeepSeek workload
and the library loop around a user's training loop alike. `WorkloadControls` is what a person (the
dashboard's keys) may do to a running workload."""

from __future__ import annotations

from gpuwatch.contract import (ACTIONS, NONE, Action, GuardedWorkload, StepPlan, WorkloadControls,
                                       WorkloadView)

__all__ = ["ACTIONS", "NONE", "Action", "GuardedWorkload", "StepPlan", "WorkloadControls", "WorkloadView"]
