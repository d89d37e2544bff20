"""A workload as the guard sees it and nothing more (the `GuardedWorkload` protocol's members the guard calls):
what it plans and how it reports itself come from a subclass or the test; what the guard applies is kept in
`applied`. Used by tests/test_planner.py and benchmarks/bench_guard_step.py."""

from __future__ import annotations

from gpuwatch.contract import Action

ACCEPTS = frozenset({"lower_ceiling", "raise_ceiling", "clear_ceiling", "refuse_step", "plan", "checkpointing"})


class StubWorkload:
    gpu_index = 0

    def __init__(self) -> None:
        self.applied: list[Action] = []

    def accepts(self):
        return ACCEPTS

    def apply(self, action, who="guard"):
        self.applied.append(action)

    def request_snapshot(self, d, r):
        pass
