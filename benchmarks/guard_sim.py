"""The guard library benchmark's scenarios on a CPU with simulated device memory (tests/support/guard_sim.py:
the real GuardedLoop, Guard, Policy and peak estimator; only the memory is simulated, with the H200's
calibration): per scenario, unguarded and guarded, the OOMs, steps, micro-batches and the guard's actions,
and for every guarded OOM the decision the guard took before that step and its figures. No GPU, seconds.

    python3 benchmarks/guard_sim.py [--scenario ramp-loop|ramp-hf|fragment|all] [--json OUT] [-v]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # gpuwatch, and the simulation in tests/support

from support.guard_sim import SCENARIOS, run  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="all")
    ap.add_argument("--json", default=None)
    ap.add_argument("-v", action="store_true")
    a = ap.parse_args()
    out = {}
    for name, (make, frag, peek) in SCENARIOS.items():
        if a.scenario not in ("all", name):
            continue
        for arm in ("unguarded", "guarded"):
            r = out.setdefault(name, {})[arm] = run(make(), frag=frag, verbose=a.v, peek_last=peek,
                                                    guard_on=arm == "guarded")
            print(name, arm, json.dumps({k: r[k] for k in ("ooms", "steps", "micro_batches_max", "actions")}))
            for o in r["oom_rows"] if arm == "guarded" else []:
                print("  OOM", json.dumps(o, default=str))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
