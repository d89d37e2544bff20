"""The risk model's view in the seconds before each OOM of a session: its score and the estimate's features (the next
step's and the lookahead's estimated peak against the usable limit, their crossing probabilities, memory in use), a
row every `--every` seconds - to read why an OOM was caught or missed (issue 29: blind set 2911's missed decode OOM,
its lookahead's estimate 0.744 of the usable limit two steps ahead, docs/BENCHMARKS.md). Reads recordings only.

    python3 benchmarks/before_oom.py SESSION [--seconds 8] [--every 0.9]
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpuwatch.predict.dataset import load_sessions  # noqa: E402
from gpuwatch.predict.features import NAMES, features  # noqa: E402
from gpuwatch.predict.heldout import MODEL, rules  # noqa: E402
from gpuwatch.predict.model import load_model  # noqa: E402

SHOWN = ("mem_used_frac", "next_peak_est_frac", "peak_cross_p", "ahead_peak_est_frac", "ahead_cross_p", "trend_cross_p")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("session", type=Path)
    ap.add_argument("--seconds", type=float, default=8.0, help="how far before each OOM (default 8)")
    ap.add_argument("--every", type=float, default=0.9, help="seconds between the rows shown (default 0.9)")
    a = ap.parse_args(argv)
    if not (a.session / "meta.json").is_file():
        print(f"before_oom: {a.session}: not a gpuwatch session (no meta.json)", file=sys.stderr)
        return 1
    model = load_model()
    tls, warnings = load_sessions([a.session], stride=1, feature_fn=functools.partial(features, prior=model.prior))
    for w in warnings:
        print(w, file=sys.stderr)
    if not tls:
        print(f"before_oom: {a.session}: no timeline could be read", file=sys.stderr)
        return 1
    for tl in tls:
        if not tl.failures.size:
            print(f"{tl.session}: no OOM")
            continue
        score = rules(model)[MODEL][1](tl)
        for f in tl.failures:
            print(f"{tl.session}: OOM at {(f - tl.ts_us[0]) / 1e6:.1f} s (threshold {model.threshold:.2f})")
            last = -np.inf
            for i in np.nonzero((tl.ts_us >= f - a.seconds * 1e6) & (tl.ts_us <= f))[0]:
                if tl.ts_us[i] - last < a.every * 1e6:
                    continue
                last = tl.ts_us[i]
                shown = "  ".join(f"{k} {float(tl.X[i, NAMES.index(k)]):.3f}" for k in SHOWN)
                print(f"  {(tl.ts_us[i] - f) / 1e6:6.2f} s  score {score[i]:.3f}  {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
