"""What ranks the risk above its alarm (issue 29, predict/composite.py `over`): for every alarm onset of the shipped
model on the shipped sets, the estimate's excess over the usable limit in the alarm's first horizon, true and
false, starting near the limit or not; then, on the seen sets and on the four pooled blind sets, the catches at
0 near-limit false alarms and at three baselines' near-limit rates with the excess mapped at other scales
(what OVER_SCALE was picked by, session 43).

    python3 benchmarks/alarm_excess.py [--no-sweep]     (~1 min to cut the windows, ~3 min for the sweep; 2 cores)
Prints one JSON line per onset group, then one per (sets, scale).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpuwatch.predict import evaluate as E  # noqa: E402
from gpuwatch.predict.composite import ALARM, OVER_SCALE  # noqa: E402
from gpuwatch.predict.dataset import default_sessions, load_sessions, sessions_under  # noqa: E402
from gpuwatch.predict.features import NAMES, features  # noqa: E402
from gpuwatch.predict.model import load_model  # noqa: E402

POOLED = ("heldout-h200-2026-12-04-blind-2901", "heldout-h200-2026-12-06-blind-2903",
          "heldout-h100-2026-12-06-blind-2905", "heldout-h200-2026-12-06-blind-2906")
SCALES = (0.005, 0.03, 0.1, 0.5)


def onsets(model, tls) -> dict[str, list[float]]:
    """The highest `over` in each alarm onset's first horizon, by (true/false, near/far)."""
    h = int(E.HORIZON_S * 1e6)
    out: dict[str, list[float]] = {}
    for tl in tls:
        sc = model.estimator.predict_proba(tl.X)[:, 1]
        ov = model.estimator.over(tl.X)
        near = np.nan_to_num(tl.X[:, NAMES.index("mem_used_frac")], nan=0.0) >= E.NEAR_FRAC
        for t in E.alarm_starts(tl.ts_us, E.alarm_state(sc, ALARM) & (tl.y != -1), h):
            i = int(np.searchsorted(tl.ts_us, t))
            true = bool(((tl.failures >= t) & (tl.failures <= t + 2 * h)).any())
            key = f"{'true' if true else 'false'} alarms starting {'near' if near[i] else 'far from'} the limit"
            out.setdefault(key, []).append(float(ov[(tl.ts_us >= t) & (tl.ts_us < t + h)].max()))
    return out


def scored(model, tl, scale: float) -> np.ndarray:
    """The shipped risk with the excess mapped at `scale` (OVER_SCALE's place): the composite's own `combine`,
    handed the excess rescaled so that over / OVER_SCALE reads over / scale."""
    c = model.estimator
    return c.combine(c.p_estimator(tl.X), c.classifier.predict_proba(tl.X)[:, 1],
                     c.over(tl.X) * (OVER_SCALE / scale))[:, 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-sweep", action="store_true", help="the onsets only")
    args = ap.parse_args()
    model = load_model(ROOT / "models" / "risk.joblib")
    ff = functools.partial(features, prior=model.prior)
    groups = {"train": default_sessions(ROOT)}
    for d in sorted((ROOT / "recordings").glob("heldout-*")):
        groups[d.name] = sessions_under(d)
    tls = {g: load_sessions(ps, stride=5, feature_fn=ff)[0] for g, ps in groups.items()}
    every = [t for ts in tls.values() for t in ts]
    for key, v in sorted(onsets(model, every).items()):
        a = np.array(v)
        print(json.dumps({"onsets": key, "n": len(a), "over_median": round(float(np.median(a)), 3),
                          "over_q90": round(float(np.quantile(a, 0.9)), 3), "at_0": round(float((a == 0).mean()), 2)}))
    if args.no_sweep:
        return
    sets = {"seen": [t for g, ts in tls.items() if g not in POOLED for t in ts],
            "pooled blind": [t for g in POOLED for t in tls[g]]}
    for name, ts in sets.items():
        base = E.baseline_metrics(ts)
        rates = {"0": 0.0, **{k: base[k].near_fa_per_hour or 0.0 for k in ("vramtop", "next-step peak", "time-to-full")}}
        for scale in SCALES:
            sc = [scored(model, t, scale) for t in ts]
            caught = {k: (m.caught if (m := E.recall_at_fa(ts, sc, r, near=True)) else None) for k, r in rates.items()}
            print(json.dumps({"sets": name, "scale": scale, "caught_at_near_rate_of": caught}), flush=True)


if __name__ == "__main__":
    main()
