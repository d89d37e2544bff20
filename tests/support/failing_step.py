"""`python tests/support/failing_step.py stress ...`: gpuwatch's command line with every prefill step
raising a RuntimeError - a failure the workload cannot recover from (UNRECOVERED, exit 1). The tests used
an impossible config for this (more experts per token than experts), which is now refused up front."""

from __future__ import annotations

import sys


def _boom(*_a, **_k):
    raise RuntimeError("injected step failure (tests/support/failing_step.py)")


if __name__ == "__main__":  # guarded: the sampler's spawned child re-imports this module
    from gpuwatch.workload import model as M

    M.step_prefill = _boom
    from gpuwatch.cli import main

    raise SystemExit(main(sys.argv[1:]))
