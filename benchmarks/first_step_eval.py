"""A session's first step: what the shape library (predict/prior.py) says of it, against what happened.

For every recorded session and GPU whose workload is a known model in an inference mode, the window just
before its first attempted step (the last sample before it) is cut as replay cuts it and scored with a
library; printed: the first attempt's shape, the library's activation estimate and the room the usable limit
leaves above the weights (room / activation), P(the first step peaks over the usable limit) - the window's
`peak_cross_p` - and whether the step ran or ran out of memory. Training sessions are scored with a library
built from every other training session (leave one session out: no session speaks for itself); held-out
sessions with the library of all training sessions (the shipped model's).

    python3 benchmarks/first_step_eval.py [--json OUT] [--heldout 'recordings/heldout-h200-*/*/']

The alarm counts at p >= the shipped model's estimator operating point (its manifest).
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpuwatch.predict import first_step as J  # noqa: E402
from gpuwatch.predict import prior as P  # noqa: E402
from gpuwatch.predict.dataset import default_sessions  # noqa: E402
from gpuwatch.predict.model import read_manifest  # noqa: E402


def show(title: str, rows: list[dict]) -> None:
    print(f"== {title}")
    for r in rows:
        room = "-" if r["room_over_act"] is None else f"{r['room_over_act']:.2f}"
        p = "-" if r["p"] is None else f"{r['p']:.2f}"
        print(f"  {r['session'][:40]:40s} {r['mode']:7s} {r['shape']:>10s} room/act {room:>6s}  p {p:>5s}  "
              f"{'ALARM' if r['alarm'] else '     '}  {r['outcome']}")
    print("  ", J.summary(rows))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--heldout", default=str(ROOT / "recordings" / "heldout-h200-*" / "*") + "/")
    a = ap.parse_args()
    t_e = float((read_manifest(ROOT / "models" / "risk.joblib").get("operating_point") or {}).get("estimator") or 0.5)
    train = default_sessions(ROOT)
    out = {"estimator_operating_point": t_e, "overhead": P.FIRST_STEP_OVERHEAD, "rel": P.FIRST_STEP_REL}
    rows = J.leave_one_out(train, t_e)
    show("training sessions, leave one session out", rows)
    out["training"] = {"rows": rows, "summary": J.summary(rows)}
    lib = P.build(train)
    held = []
    for s in sorted(Path(p) for p in glob.glob(a.heldout) if (Path(p) / "meta.json").exists()):
        for att in J.first_attempts(s):
            r = J.judge(att, lib, t_e)
            if r:
                held.append(r)
    show("held-out sessions, the library of every training session", held)
    out["heldout"] = {"rows": held, "summary": J.summary(held)}
    if a.json:
        a.json.write_text(json.dumps(out, indent=1, default=float))
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
