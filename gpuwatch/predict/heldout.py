"""`gpuwatch eval`: a risk model scored on sessions it never trained on and no design choice looked at - by
default the held-out H200 sessions of recordings/heldout-h200-*/ (`gpuwatch train` reads only
recordings/sample-h200-* and recordings/h200-*; see recordings/README.md). Per session and in all, what
the model card reports (recall, false alarms per healthy hour, near the limit, lead time in seconds and
steps), and the same without the lookahead (predict/ahead.py: the feature ahead_cross_p blanked, the
next step only)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable

import numpy as np

from gpuwatch.predict import evaluate as E

__all__ = ["evaluate", "heldout_sessions", "line"]


def heldout_sessions(root: Path) -> list[Path]:
    """Every session folder under root/recordings/heldout-h200-*/, sorted (none outside a checkout)."""
    return sorted(p for d in (root / "recordings").glob("heldout-h200-*") for p in d.iterdir()
                  if p.is_dir() and (p / "meta.json").exists())


def line(name: str, m: E.Metrics) -> str:
    near = f"{m.near_false_alarms} in {m.near_hours * 60:.1f} min" + (
        f" ({m.near_fa_per_hour:.1f}/h)" if m.near_fa_per_hour is not None else "")
    lead = "-" if m.lead_s_median is None else f"{m.lead_s_median:.1f} s / {m.lead_steps_median:.0f} steps (p10 {m.lead_s_p10:.1f} s)"
    return (f"{name:44s} OOMs {m.caught}/{m.oom_events}  false alarms {m.false_alarms} in {m.healthy_hours * 60:.1f} "
            f"healthy min  near the limit {near}  lead {lead}")


def evaluate(paths: list[Path], model_path: Path, stride: int = 5, use_prior: bool = True,
             say: Callable[[str], None] = print, warn: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Score `model_path`'s model (loaded with its manifest checked) on `paths`; one line per session and
    two in all go to `say`, what a session could not give to `warn`; the figures are returned."""
    from gpuwatch.predict.dataset import load_sessions
    from gpuwatch.predict.features import NAMES, features
    from gpuwatch.predict.model import load_model

    model = load_model(model_path)
    ff = None if not use_prior or model.prior is None else functools.partial(features, prior=model.prior)
    tls, warnings = load_sessions(paths, stride=stride, feature_fn=ff)
    for w in warnings:
        (warn or say)(w)
    j = NAMES.index("ahead_cross_p")
    out: dict[str, Any] = {"model": model.label, "threshold": model.threshold, "stride": stride, "sessions": {},
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
        say(line(t.session, m))
    for name, sc in (("all (shipped model)", scores), ("all, without the lookahead", blind)):
        m = E.event_metrics(tls, sc, model.threshold)
        out[name] = m.row()
        say(line(name, m))
    return out
