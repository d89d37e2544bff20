"""`gpuwatch eval`: a risk model scored on sessions it never trained on and no design choice looked at - by
default the held-out sessions (H200; blind sets 2905, 2907 and 2908 recorded on an H100) of recordings/heldout-*/ (`gpuwatch train` reads only
recordings/sample-h200-* and recordings/h200-*; see recordings/README.md); or the sessions named, or every
session under each `--set DIR` (a blind set of benchmarks/gpu_heldout.sh). The model's line for every
session, then for every set (the folder a session lies in; a blind set's DIR/sessions is named by DIR) and,
with more than one, for all of them: the model, the model without the lookahead and without the trend (the
features ahead_cross_p / trend_cross_p blanked: predict/ahead.py, predict/trend.py), and every baseline
(predict/evaluate.py BASELINES) - recall at least one step ahead, median lead, false alarms per healthy hour
near the limit (>= 90 %) - and, against each baseline, the model at the baseline's own near-limit false-alarm
rate."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable

import numpy as np

from gpuwatch.predict import evaluate as E
from gpuwatch.predict.ahead import FEATURES as LOOKAHEAD_FEATURES

__all__ = ["evaluate", "heldout_sessions", "line", "rules", "set_name"]

MODEL = "model"
BASELINE = "baseline: "


def heldout_sessions(root: Path) -> list[Path]:
    """Every session folder under root/recordings/heldout-*/, sorted (none outside a checkout)."""
    from gpuwatch.predict.dataset import is_session

    return sorted(p for d in (root / "recordings").glob("heldout-*") for p in d.iterdir() if is_session(p))


def set_name(session: Path) -> str:
    """The set a session belongs to: the folder it lies in (a blind set's DIR/sessions: DIR's name)."""
    return session.parent.parent.name if session.parent.name == "sessions" else session.parent.name


def line(name: str, m: E.Metrics) -> str:
    near = f"{m.near_false_alarms} in {m.near_hours * 60:.1f} min" + (
        f" ({m.near_fa_per_hour:.1f}/h)" if m.near_fa_per_hour is not None else "")
    lead = "-" if m.lead_s_median is None else f"{m.lead_s_median:.2f} s / {m.lead_steps_median:.0f} steps (p10 {m.lead_s_p10:.1f} s)"
    first = f" ({m.first_step_caught}/{m.first_step_ooms} before any step)" if m.first_step_ooms else ""
    return (f"{name:44s} OOMs {m.caught}/{m.oom_events}{first}  false alarms {m.false_alarms} in {m.healthy_hours * 60:.1f} "
            f"healthy min  near the limit {near}  lead {lead}")


def _blanked(X: np.ndarray, *names: str) -> np.ndarray:
    from gpuwatch.predict.features import NAMES

    x = X.copy()
    for n in names:
        x[:, NAMES.index(n)] = np.nan
    return x


def rules(model) -> dict[str, tuple[float, Callable[[Any], np.ndarray]]]:
    """name -> (threshold, the scores of a timeline): the model and its two ablations at the model's
    threshold, every baseline's 0/1 at 0.5."""
    p = model.estimator.predict_proba
    out: dict[str, tuple[float, Callable[[Any], np.ndarray]]] = {
        MODEL: (model.threshold, lambda t: p(t.X)[:, 1]),
        "model without the lookahead": (model.threshold, lambda t: p(_blanked(t.X, *LOOKAHEAD_FEATURES))[:, 1]),
        "model without the trend": (model.threshold, lambda t: p(_blanked(t.X, "trend_cross_p"))[:, 1])}
    for name, (_note, fn) in E.BASELINES.items():
        out[BASELINE + name] = (0.5, (lambda f: lambda t: f(t).astype(float))(fn))
    return out


def _at_rate(n: str, b: E.Metrics, tls: list, model_scores: list[np.ndarray]) -> tuple[str, E.Metrics | None]:
    """The model at baseline `n`'s near-limit false-alarm rate, and its line."""
    assert b.near_fa_per_hour is not None
    m = E.recall_at_fa(tls, model_scores, b.near_fa_per_hour, near=True)
    said = "no threshold" if m is None else (f"{m.caught}/{m.oom_events} (threshold {m.threshold:.3f}, "
                                             f"lead {m.lead_s_median or 0:.2f} s)")
    verdict = "" if m is None else _verdict(m, b)
    return (f"   at {n[len(BASELINE):]}'s {b.near_fa_per_hour:.1f} near-limit false alarms/h "
            f"({b.caught}/{b.oom_events}): model {said} {verdict}"), m


def _verdict(m: E.Metrics, b: E.Metrics) -> str:
    """Beaten: more OOMs caught, or as many (some) with a longer median lead; tied: as many and as early (both
    catching none is a tie, not a win - `eval` said "0/9 ... beaten"); else not beaten."""
    lm, lb = m.lead_s_median or 0.0, b.lead_s_median or 0.0
    if m.caught > b.caught or (m.caught == b.caught > 0 and lm > lb):
        return "beaten"
    if m.caught == b.caught and (m.caught == 0 or lm == lb):
        return "tied"
    return "NOT beaten"


def table(name: str, tls: list, scored: dict[str, list[np.ndarray]], thresholds: dict[str, float],
          say: Callable[[str], None]) -> dict[str, Any]:
    """One set's lines (and JSON row): every rule, then the model at each baseline's near-limit false-alarm
    rate. `scored`: rule -> the scores of each timeline of `tls`."""
    say(f"\n== {name}: {len(tls)} timelines")
    row: dict[str, Any] = {}
    metrics = {}
    for n, sc in scored.items():
        metrics[n] = m = E.event_metrics(tls, sc, thresholds[n])
        row[n] = m.row()
        say(line(n, m))
    for n, b in metrics.items():
        if not n.startswith(BASELINE) or b.near_fa_per_hour is None:
            continue
        text, at = _at_rate(n, b, tls, scored[MODEL])
        say(text)
        row[f"at the rate of {n}"] = None if at is None else at.row()
    return row


def evaluate(paths: list[Path], model_path: Path, stride: int = 5, use_prior: bool = True,
             say: Callable[[str], None] = print, warn: Callable[[str], None] | None = None,
             per_session: bool = True) -> dict[str, Any]:
    """Score `model_path`'s model (loaded with its manifest checked) on `paths`: the model's line per session
    (with `per_session`), then a table per set and one for all of them (more than one set) go to `say`, what a
    session could not give to `warn`; the figures are returned."""
    from gpuwatch.predict.dataset import load_sessions
    from gpuwatch.predict.features import features
    from gpuwatch.predict.model import load_model

    model = load_model(model_path)
    ff = None if not use_prior or model.prior is None else functools.partial(features, prior=model.prior)
    tls, warnings = load_sessions(paths, stride=stride, feature_fn=ff)
    for w in warnings:
        (warn or say)(w)
    if not tls:  # nothing to score: an error, not figures of nothing and exit 0 (a new user's `eval bad/trunc`)
        from gpuwatch.errors import UsageError

        raise UsageError(f"no usable session among the {len(paths)} given: nothing to evaluate")
    out: dict[str, Any] = {"model": model.label, "threshold": model.threshold, "stride": stride,
                           "shape_library": ff is not None, "sessions": {}, "sets": {}}
    rs = rules(model)
    thresholds = {n: thr for n, (thr, _f) in rs.items()}
    per_tl = [{n: f(t) for n, (_thr, f) in rs.items()} for t in tls]  # each rule scored once per timeline
    set_of = {p.name: set_name(p) for p in paths}
    groups: dict[str, list[int]] = {}
    for i, t in enumerate(tls):
        groups.setdefault(set_of.get(t.session, "sessions"), []).append(i)
        m = E.event_metrics([t], [per_tl[i][MODEL]], model.threshold)
        out["sessions"][t.session] = m.row()
        if per_session:
            say(line(t.session, m))
    parts = sorted(groups.items()) + ([("all", list(range(len(tls))))] if len(groups) > 1 else [])
    for g, idx in parts:
        out["sets"][g] = table(g, [tls[i] for i in idx], {n: [per_tl[i][n] for i in idx] for n in rs},
                               thresholds, say)
    return out
