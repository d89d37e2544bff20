"""Score a risk model on sessions it never trained on and no design choice looked at, beside the baselines.

By default the held-out H200 sessions of recordings/heldout-h200-*/ (`gpuwatch train` reads only
recordings/sample-h200-* and recordings/h200-*; see recordings/README.md); or the sessions named, or every
session under each `--set DIR` (a blind set of benchmarks/gpu_heldout.sh: DIR/sessions). For every set (a
folder of sessions) and for all of them: the model, its estimator part without the lookahead and without the
trend (predict/ahead.py, predict/trend.py), and every baseline (predict/evaluate.py BASELINES: memory > 90 % /
95 % of the effective limit, time to full at the 5 s slope, the next-step peak alone, vramtop's rule at its
1 s refresh) - recall at least one step ahead, median lead, false alarms per healthy hour near the limit
(>= 90 %) - and, against each baseline, the model at the baseline's own near-limit false-alarm rate.

    python3 benchmarks/heldout_eval.py [--model models/risk.joblib] [--json OUT] [--set DIR ...] [SESSION ...]
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
from gpuwatch.predict.dataset import is_session, load_sessions, sessions_under  # noqa: E402
from gpuwatch.predict.features import NAMES, features  # noqa: E402
from gpuwatch.predict.model import load_model  # noqa: E402


def _line(name: str, m: E.Metrics) -> str:
    near = f"{m.near_false_alarms} in {m.near_hours * 60:.1f} min" + (
        f" ({m.near_fa_per_hour:.1f}/h)" if m.near_fa_per_hour is not None else "")
    lead = "-" if m.lead_s_median is None else f"{m.lead_s_median:.2f} s / {m.lead_steps_median:.0f} steps (p10 {m.lead_s_p10:.1f} s)"
    return (f"{name:44s} OOMs {m.caught}/{m.oom_events}  false alarms {m.false_alarms} in {m.healthy_hours * 60:.1f} "
            f"healthy min  near the limit {near}  lead {lead}")


def blanked(X: np.ndarray, *names: str) -> np.ndarray:
    x = X.copy()
    for n in names:
        x[:, NAMES.index(n)] = np.nan
    return x


def rules(model) -> dict:
    """name -> scores of a timeline, thresholded at 0.5 (the baselines' 0/1) or at the model's threshold."""
    p = model.estimator.predict_proba
    out = {"model": lambda t: p(t.X)[:, 1],
           "model without the lookahead": lambda t: p(blanked(t.X, "ahead_cross_p"))[:, 1],
           "model without the trend": lambda t: p(blanked(t.X, "trend_cross_p"))[:, 1]}
    for name, (_note, fn) in E.BASELINES.items():
        out[f"baseline: {name}"] = (lambda f: lambda t: f(t).astype(float))(fn)
    return out


def table(name: str, tls: list, model, out: dict) -> None:
    """One set's lines (and JSON): every rule, then the model at each baseline's near-limit false-alarm rate."""
    print(f"\n== {name}: {len(tls)} timelines")
    rs = rules(model)
    scored = {n: [f(t) for t in tls] for n, f in rs.items()}
    row: dict = {}
    for n, sc in scored.items():
        thr = 0.5 if n.startswith("baseline") else model.threshold
        m = E.event_metrics(tls, sc, thr)
        row[n] = m.row()
        print(_line(n, m))
    for n in (k for k in scored if k.startswith("baseline")):
        b = E.Metrics(**row[n])
        if b.near_fa_per_hour is None:
            continue
        m = E.recall_at_fa(tls, scored["model"], b.near_fa_per_hour, near=True)
        said = "no threshold" if m is None else f"{m.caught}/{m.oom_events} (threshold {m.threshold:.3f}, lead {m.lead_s_median or 0:.2f} s)"
        verdict = "" if m is None else ("beaten" if m.caught > b.caught or (m.caught == b.caught and (m.lead_s_median or 0) >= (b.lead_s_median or 0)) else "NOT beaten")
        print(f"   at {n[10:]}'s {b.near_fa_per_hour:.1f} near-limit false alarms/h ({b.caught}/{b.oom_events}): model {said} {verdict}")
        row[f"at the rate of {n}"] = None if m is None else m.row()
    out[name] = row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sessions", nargs="*", type=Path)
    ap.add_argument("--set", action="append", type=Path, default=[], help="every session under DIR, one set")
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "risk.joblib")
    ap.add_argument("--stride", type=int, default=5)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--no-prior", action="store_true", help="without the model's shape library (a session's first step unseen)")
    ap.add_argument("--per-session", action="store_true", help="the model's line for every session too")
    a = ap.parse_args()
    paths = list(a.sessions) + [p for d in a.set for p in sessions_under(d)]
    if not paths:
        paths = sorted(p for d in (ROOT / "recordings").glob("heldout-h200-*") for p in d.iterdir() if is_session(p))
    model = load_model(a.model)
    ff = None if a.no_prior or model.prior is None else functools.partial(features, prior=model.prior)
    tls, warnings = load_sessions(paths, stride=a.stride, feature_fn=ff)
    for w in warnings:
        print("warning:", w)
    out: dict = {"model": model.label, "threshold": model.threshold, "stride": a.stride, "shape_library": ff is not None,
                 "sessions": {}, "sets": {}}
    set_of = {p.name: (p.parent.parent.name if p.parent.name == "sessions" else p.parent.name) for p in paths}
    groups: dict[str, list] = {}
    for t in tls:  # a timeline's set: the folder its session lies in (a blind set's DIR/sessions: DIR's name)
        groups.setdefault(set_of.get(t.session, "sessions"), []).append(t)
        if a.per_session:
            m = E.event_metrics([t], [model.estimator.predict_proba(t.X)[:, 1]], model.threshold)
            out["sessions"][t.session] = m.row()
            print(_line(t.session, m))
    for g, part in sorted(groups.items()):
        table(g, part, model, out["sets"])
    if len(groups) > 1:
        table("all", tls, model, out["sets"])
    if a.json:
        a.json.write_text(json.dumps(out, indent=1, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
