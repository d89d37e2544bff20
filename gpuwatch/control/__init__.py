"""Layer 3a: the guard turns risk into actions on the workload. It knows nothing of torch:
it drives any object with these controls, which `gpuwatch.workload.runner.Workload` implements
(thread-safe, applied before the next step, each recorded as a `control` event)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class WorkloadControls(Protocol):
    """What a guard may do to a running workload, and what it may read back."""

    precision: str  # the precision of the steps now running (fp32, tf32, bf16, fp16)
    state: str  # idle, building, running, paused, stopped, failed, finished

    @property
    def batch(self) -> int: ...  # the batch the next step will use

    def set_batch_size(self, n: int) -> None: ...
    def set_seq_len(self, n: int) -> None: ...
    def set_precision(self, p: str) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def stop(self, join: bool = True) -> None: ...
