"""The guard in users' own training loops, unguarded vs guarded, paired, on one GPU under a memory cap
(docs/BENCHMARKS.md, issue 16). The scenarios, their model and their targets are
tests/support/library_scenarios.py (the tests run its CPU dry run); this is the measurement's command.

    python3 benchmarks/guard_library.py --out /tmp/guard_library.json [--budget-s 200] [--sessions DIR]
    python3 benchmarks/guard_library.py --dry-run --out /tmp/dry.json      # CPU, tiny, ~30 s
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # gpuwatch, and the scenarios in tests/support

from support.library_scenarios import SCENARIOS, run  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sessions", default=None, help="where the guarded arms' sessions go (default: OUT's folder)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, a tiny model, simulated OOMs: the code paths only")
    ap.add_argument("--only", nargs="*", default=None, help=f"scenarios: {' '.join(SCENARIOS)}")
    ap.add_argument("--steps", type=int, default=None, help="steps of the ramp and fragment scenarios")
    ap.add_argument("--budget-s", type=float, default=200.0,
                    help="start no scenario after this many seconds (each writes its result as it ends)")
    a = ap.parse_args()
    run(a.out, a.sessions, dry=a.dry_run, only=a.only, steps=a.steps, budget_s=a.budget_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
