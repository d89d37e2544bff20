"""What any choice between two arms' configurations could give, step by step (issue 28, session 51).

    python3 benchmarks/planner_bound.py benchmarks/results/s50/p1/lightning.jsonl [more .jsonl ...]

`planner_curriculum.py` runs every arm over the same curriculum (the same sequence length at the same step) and
writes each arm's step log. For every (static, planner) pair of arms in a file, this prints the static arm's steps'
time over the planner's (what the planner gained, the first step left out as the arms' warm-up), and over an oracle
that ran each step as whichever of the two was faster at it - the most a per-step choice between those two arms'
configurations could gain, the switches free. Where the oracle stays under a target, no planner choosing among
those configurations reaches it on that curriculum."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def step_logs(path: Path) -> dict[str, list]:
    """Each arm's step log ([step, ms, sequence length, ...] rows) from a planner_curriculum.py output."""
    arms = {}
    for line in path.read_text().splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if isinstance(d, dict) and d.get("step_log"):
            arms[d["arm"]] = d["step_log"]
    return arms


def pair(static: list, planner: list) -> dict[str, float] | None:
    """The static arm's step time over the planner's and over the per-step oracle's (None: the curricula differ)."""
    n = min(len(static), len(planner))
    if n < 2 or any(static[i][2] != planner[i][2] for i in range(n)):
        return None
    ts = sum(r[1] for r in static[1:n])
    tp = sum(r[1] for r in planner[1:n])
    to = sum(min(static[i][1], planner[i][1]) for i in range(1, n))
    return {"steps": n, "static_ms": ts, "planner_ms": tp, "oracle_ms": to, "planner_x": ts / tp, "oracle_x": ts / to}


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    for a in argv:
        p = Path(a)
        if not p.is_file():
            print(f"planner_bound: {a}: no such file", file=sys.stderr)
            return 2
        arms = step_logs(p)
        for s in (k for k in arms if "static" in k):
            for q in (k for k in arms if "planner" in k):
                r = pair(arms[s], arms[q])
                if r is None:
                    print(f"{p}: {s} / {q}: the arms ran different curricula")
                    continue
                print(f"{p}: {s} / {q}: {r['steps']} steps; static's steps over the planner's {r['planner_x']:.3f}x, "
                      f"over the per-step oracle's {r['oracle_x']:.3f}x ({r['static_ms']:.0f} / {r['planner_ms']:.0f} / "
                      f"{r['oracle_ms']:.0f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
