"""Each near-limit false alarm of the shipped model on the held-out sets (issue 29, session 48): where it began,
the model's score with and without the trend, how long until the session's next OOM (beyond the horizon an alarm
has to come true, or none), the features that carry it, and whether the session's steps record the allocator's
inactive split blocks (without them `trend.held` counts all cache beyond the peak as fragmentation). The same
alarms `gpuwatch eval` counts (`evaluate.event_metrics`: alarm starts, near = memory in use >= NEAR_FRAC).

    python3 benchmarks/near_limit_alarms.py [SESSION ...]     (default: every held-out session; ~70 s)
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpuwatch.predict import evaluate as E  # noqa: E402
from gpuwatch.predict.dataset import HORIZON_S, load_sessions  # noqa: E402
from gpuwatch.predict.features import NAMES, features  # noqa: E402
from gpuwatch.predict.heldout import MODEL, heldout_sessions, rules  # noqa: E402
from gpuwatch.predict.model import load_model  # noqa: E402

SHOWN = ("mem_used_frac", "next_peak_est_frac", "trend_cross_p", "frag_held_frac", "alloc_ttf_s")
SPLIT = "torch_inactive_split_bytes"


def main(argv: list[str]) -> None:
    import polars as pl

    model = load_model()
    paths = [Path(p) for p in argv] or heldout_sessions(ROOT)
    tls, warnings = load_sessions(paths, stride=5, feature_fn=functools.partial(features, prior=model.prior))
    for w in warnings:
        print(w, file=sys.stderr)
    where = {p.name: p for p in paths}
    rs = rules(model)
    h = int(HORIZON_S * 1e6)
    n = trend_only = 0
    for tl in tls:
        sc, sc_nt = rs[MODEL][1](tl), rs["model without the trend"][1](tl)
        alarm, alarm_nt = E.alarm_state(sc, model.threshold), E.alarm_state(sc_nt, model.threshold)
        near = np.nan_to_num(E.column(tl, "mem_used_frac"), nan=0.0) >= E.NEAR_FRAC
        split = SPLIT in pl.read_parquet_schema(where[tl.session] / "steps.parquet")
        for t in E.alarm_starts(tl.ts_us, alarm & (tl.y != -1), h):
            i = min(int(np.searchsorted(tl.ts_us, t)), tl.ts_us.size - 1)
            if ((tl.failures >= t) & (tl.failures <= t + 2 * h)).any() or not near[i]:
                continue
            n += 1
            trend_only += not alarm_nt[i]
            nxt = tl.failures[tl.failures > t]
            f = {k: round(float(tl.X[i, NAMES.index(k)]), 3) for k in SHOWN}
            print(f"{where[tl.session].parent.name[-18:]} {tl.session[:44]:44s} at {(t - tl.ts_us[0]) / 1e6:6.1f} s  "
                  f"score {sc[i]:.2f} (without the trend {sc_nt[i]:.2f})  next OOM "
                  f"{'none' if not nxt.size else f'{(nxt[0] - t) / 1e6:.1f} s later'}  split column {'yes' if split else 'no'}  {f}")
    print(f"{n} near-limit false alarms, {trend_only} of them the trend's alone")


if __name__ == "__main__":
    main(sys.argv[1:])
