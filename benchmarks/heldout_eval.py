"""Score a risk model on sessions it never trained on and no design choice looked at: the held-out H200
sessions of recordings/heldout-h200-*/ (`gpuwatch train` reads only recordings/sample-h200-* and
recordings/h200-*; see recordings/README.md). Prints, per session and in all, what the model card reports
(recall, false alarms per healthy hour, near the limit, lead time in seconds and steps), and the same
without the lookahead (predict/ahead.py: the feature ahead_cross_p blanked, the next step only).

    python3 benchmarks/heldout_eval.py [--model models/risk.joblib] [--json OUT] [SESSION ...]
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
from gpuwatch.predict.dataset import load_sessions  # noqa: E402
from gpuwatch.predict.features import NAMES, features  # noqa: E402
from gpuwatch.predict.model import load_model  # noqa: E402


def _line(name: str, m: E.Metrics) -> str:
    near = f"{m.near_false_alarms} in {m.near_hours * 60:.1f} min" + (
        f" ({m.near_fa_per_hour:.1f}/h)" if m.near_fa_per_hour is not None else "")
    lead = "-" if m.lead_s_median is None else f"{m.lead_s_median:.1f} s / {m.lead_steps_median:.0f} steps (p10 {m.lead_s_p10:.1f} s)"
    return (f"{name:44s} OOMs {m.caught}/{m.oom_events}  false alarms {m.false_alarms} in {m.healthy_hours * 60:.1f} "
            f"healthy min  near the limit {near}  lead {lead}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sessions", nargs="*", type=Path)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "risk.joblib")
    ap.add_argument("--stride", type=int, default=5)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--no-prior", action="store_true", help="without the model's shape library (a session's first step unseen)")
    a = ap.parse_args()
    paths = a.sessions or sorted(p for d in (ROOT / "recordings").glob("heldout-h200-*") for p in d.iterdir()
                                 if p.is_dir() and (p / "meta.json").exists())
    model = load_model(a.model)
    ff = None if a.no_prior or model.prior is None else functools.partial(features, prior=model.prior)
    tls, warnings = load_sessions(paths, stride=a.stride, feature_fn=ff)
    for w in warnings:
        print("warning:", w)
    j = NAMES.index("ahead_cross_p")
    out: dict = {"model": model.label, "threshold": model.threshold, "stride": a.stride, "sessions": {},
                 "shape_library": ff is not None}
    scores, blind = [], []
    for t in tls:
        s = model.estimator.predict_proba(t.X)[:, 1]
        x0 = t.X.copy()
        x0[:, j] = np.nan
        scores.append(s)
        blind.append(model.estimator.predict_proba(x0)[:, 1])
        m = E.event_metrics([t], [s], model.threshold)
        out["sessions"][t.session] = m.row()
        print(_line(t.session, m))
    for name, sc in (("all (shipped model)", scores), ("all, without the lookahead", blind)):
        m = E.event_metrics(tls, sc, model.threshold)
        out[name] = m.row()
        print(_line(name, m))
    if a.json:
        a.json.write_text(json.dumps(out, indent=1, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
