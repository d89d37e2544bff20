"""The model card: `models/NAME.md`, written by `gpuwatch train` from what the evaluation measured.
It imports nothing from `predict/train.py` (train calls it with a Report and the numbers it needs)."""

from __future__ import annotations

import json

from gpuwatch.atomic import write_file
from gpuwatch.predict import evaluate as E
from gpuwatch.predict.composite import OVER_SCALE
from gpuwatch.predict.features import FEATURES

FEATURE_TABLE = "\n".join(f"| `{n}` | {u} | {d} |" for n, (u, d) in FEATURES.items())


def _f(v, fmt="{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def _row(name: str, m: E.Metrics | None, note: str = "") -> str:
    if m is None:
        return f"| {name} | - | - | - | - | - | - | - | - | {note} |"
    return (f"| {name} | {m.caught}/{m.oom_events} ({_f(m.recall)}) | {m.episodes_caught}/{m.episodes} ({_f(m.episode_recall)}) "
            f"| {_f(m.event_precision)} | {m.false_alarms} ({_f(m.false_alarms_per_hour, '{:.1f}')}/h) "
            f"| {m.near_false_alarms} in {m.near_hours * 60:.1f} min ({_f(m.near_fa_per_hour, '{:.1f}')}/h) "
            f"| {_f(m.lead_s_median, '{:.1f}')} / {_f(m.lead_s_p10, '{:.1f}')} "
            f"| {_f(m.lead_steps_median, '{:.0f}')} / {_f(m.lead_steps_p10, '{:.0f}')} | {_f(m.pr_auc)} | {note} |")


HEAD = ("| rule | OOMs caught (recall) | episodes caught | event precision | false alarms (per healthy h) "
        f"| false alarms at >= {E.NEAR_FRAC:.0%} of the limit | lead s median / p10 | lead steps median / p10 | PR-AUC | note |\n"
        "|---|---|---|---|---|---|---|---|---|---|")


def verdicts(rep) -> list[str]:
    """Where the model does and does not beat each baseline, at the baseline's near-limit false-alarm rate."""
    out = []
    for name, b in rep.baselines.items():
        m = rep.at_baseline_fa.get(name)
        fa = _f(b.near_fa_per_hour, "{:.1f}")
        if m is None:
            out.append(f"- **{name}**: at its {fa} near-limit false alarms/h the model has no threshold that low in "
                       f"false alarms; the baseline catches {b.caught}/{b.oom_events}. Not beaten at that rate.")
        elif m.caught > b.caught:
            out.append(f"- **{name}** ({b.caught}/{b.oom_events} at {fa}/h): the model catches {m.caught}/{m.oom_events} "
                       f"at {_f(m.near_fa_per_hour, '{:.1f}')}/h (threshold {m.threshold:.3f}). Beaten.")
        elif m.caught == b.caught:
            out.append(f"- **{name}** ({b.caught}/{b.oom_events} at {fa}/h): the model catches the same number at "
                       f"{_f(m.near_fa_per_hour, '{:.1f}')}/h. A tie, not a win.")
        else:
            out.append(f"- **{name}** ({b.caught}/{b.oom_events} at {fa}/h): the model catches only {m.caught}/{m.oom_events} "
                       f"at that rate. **The baseline is better here.**")
    return out


def write_card(rep, max_fa_per_hour: float, command: str) -> None:
    d = rep.data
    folds = rep.by_session_folds
    lines = [
        f"# Model card: {rep.model_path.name}",
        "",
        f"Predicts a CUDA out-of-memory failure of a GPU's workload within the next {rep.horizon_s:g} s, at least one",
        "step before it happens (so a guard can still act). Its backbone is an online estimate of the next",
        "step's peak memory from the steps that ran (`gpuwatch/predict/peak.py`) and the probability that the",
        "planned step crosses the effective limit; a classifier on top sees what that estimate cannot (leaks,",
        "fragmentation, other processes, telemetry gaps). Written by",
        f"`{command}` in {rep.seconds:.0f} s (seeded: the same sessions give the same model); every figure below was",
        "measured by that run.",
        "",
        "## Data",
        "",
        f"{d['sessions']} real H200 sessions recorded by gpuwatch (see `recordings/README.md` and the READMEs of",
        f"`recordings/h200-*/` for every command): {d['windows']} windows (one {'per sample' if rep.stride == 1 else f'every {rep.stride} samples'}),",
        f"{d['positives']} positive, {d['failures']} OOM events, {d['healthy_minutes']} healthy minutes. Scenarios: {', '.join(d['scenarios'])}.",
        "",
        f"For training only, {d['derived_sessions']} counterfactual-cap copies of them ({d['derived_windows']} windows,",
        f"{d['derived_failures']} virtual OOMs; `gpuwatch/predict/counterfactual.py`): each session relabeled under",
        "smaller virtual caps. They never enter an evaluation, and a held-out session's copies are held out with it.",
        "",
        *_sampled(d, rep.by_session is not None),
        f"Sessions: {', '.join(rep_sessions(rep))}.",
        "",
        "## Alarm threshold",
        "",
        f"**{rep.threshold:.3f}**: {rep.threshold_why}. The threshold was chosen on the same out-of-fold scores",
        "the session table reports, so that row is optimistic about the threshold (not about the model,",
        "which never saw the held-out session); the scenario table applies it unchanged to models that never",
        "saw the held-out kind of run.",
        "",
        "## Results (held out: never trained on the session / scenario it is scored on; real sessions only)",
        "",
        HEAD,
        _row(f"model, sessions held out ({folds} grouped folds)", rep.by_session),
        _row(f"model, leave one scenario out ({len(rep.per_scenario)} folds)", rep.by_scenario),
    ]
    for name, b in rep.baselines.items():
        note = E.BASELINES[name][0] if name in E.BASELINES else E.ESTIMATOR_RULE[1]
        lines.append(_row(f"baseline: {name}", b, note))
    lines += ["", "Against each baseline at the same false-alarm rate near the limit (model scores out of fold, by session):", ""]
    lines += verdicts(rep)
    lines += ["", "## What each part contributes (ablation, sessions held out)", "", HEAD]
    lines += [_row(name, m) for name, m in rep.ablation.items()]
    lines += ["", "Per scenario (leave one scenario out, at the chosen threshold):", "", HEAD]
    lines += [_row(sc, m) for sc, m in rep.per_scenario.items()]
    lines += counterfactual_section(rep.counterfactual)
    lines += first_step_section(rep)
    lines += [
        "",
        "## Targets and where it falls short",
        "",
        f"Target: OOM recall >= 0.95 with at least one step of warning, <= {max_fa_per_hour:g} false alarms per healthy",
        f"hour at >= {E.NEAR_FRAC:.0%} of the limit, median lead >= 3 s, better than every baseline at the same false-alarm rate. "
        + shortfalls(rep, max_fa_per_hour),
        "",
        "How to read the rates: the data holds "
        f"{_f(rep.by_session.near_hours * 60 if rep.by_session else None, '{:.1f}')} minutes of healthy running at >= {E.NEAR_FRAC:.0%} of the limit, so one",
        f"false alarm there is {_f(1 / rep.by_session.near_hours if rep.by_session and rep.by_session.near_hours else None, '{:.1f}')} per hour.",
        "",
        "Labels are strict: an alarm the guard acted on in a guarded session (it refused the step the model said",
        "would fail, so no OOM followed) counts as a false alarm. Sessions that neither training nor any design",
        "choice saw: `gpuwatch eval` scores this model on recordings/heldout-*/",
        "(docs/BENCHMARKS.md, issue 20, has its figures).",
        "",
    ]
    lines += _model_sections(rep)
    write_file(rep.card_path, "\n".join(lines))


def counterfactual_section(v: dict) -> list[str]:
    if not v:
        return []
    return [
        "",
        "## Counterfactual caps: how well the relabeling rule matches real caps",
        "",
        f"On the {v['capped_sessions']} real capped sessions (leaks left out: their failing step's peak is not a",
        f"shape that ran elsewhere): of {v['steps_under_real_caps']} steps that ran under a real cap, the rule",
        "(a step fails when its peak exceeds the cap less the fragmentation margin) would have failed",
        f"{v['false_virtual_ooms']}; their peaks reached {_f(v['step_peak_over_cap_max'], '{:.3f}')} of the cap at most.",
        f"Of {v['real_ooms_with_known_peak']} real OOMs whose failing shape ran elsewhere, the rule reproduces",
        f"{v['real_ooms_reproduced']}; those shapes' peaks were {_f(v['real_oom_peak_over_cap_min'], '{:.3f}')}",
        f"(least) and {_f(v['real_oom_peak_over_cap_median'], '{:.3f}')} (median) of the cap they failed under",
        f"({v['real_ooms_peak_unknown']} more had no twin shape). Real OOMs below the margin happen on the",
        "first step under a fresh cap (the allocator's state differs there): the relabeling misses those, which",
        "is one reason its copies train the model and never score it.",
    ]


def rep_sessions(rep) -> list[str]:
    from gpuwatch.predict.model import manifest_path

    try:
        return json.loads(manifest_path(rep.model_path).read_text())["training_sessions"]
    except (OSError, ValueError, KeyError):
        return []


def first_step_section(rep) -> list[str]:
    """A session's first step: the shape library's leave-one-session-out figures (predict/prior.py)."""
    rows = getattr(rep, "first_step", None) or []
    if not rows:
        return []
    t_e = rep.operating_point[0]
    ooms = [r for r in rows if r["outcome"] == "OOM"]
    ran = [r for r in rows if r["outcome"] == "ran"]
    warned = sum(1 for r in ooms if r["p"] is not None and r["p"] >= t_e)
    alarmed = sum(1 for r in ran if r["p"] is not None and r["p"] >= t_e)
    room = lambda rs: ", ".join(f"{r['room_over_act']:.2f}" for r in rs if r["room_over_act"] is not None)  # noqa: E731
    fail_max = max((r["room_over_act"] for r in ooms if r["room_over_act"] is not None), default=float("nan"))
    ran_min = min((r["room_over_act"] for r in ran if r["room_over_act"] is not None), default=float("nan"))
    from gpuwatch.predict.prior import FIRST_STEP_OVERHEAD
    return [
        "",
        "## A session's first step (the shape library)",
        "",
        "Before a GPU's first step no step has run, so the estimator has nothing to fit. The manifest holds a",
        f"shape library ({rep.library_entries} model/mode/precision entries, inference only: `predict/prior.py`): each",
        "shape's median activation over the training sessions' steps, and the weights. Before the first step,",
        f"`peak_cross_p` is P(weights + {FIRST_STEP_OVERHEAD:g} x the activations at the planned shape > the usable limit). Not in the",
        "tables above (they score the sessions with features made without a library: each session's own steps",
        "would speak for it). Judged here leave one session out (each attempt at a session's first step - the",
        "first and any retry its recovery planned - against the library of all the others), alarm at p >= t_e =",
        f"{t_e:g}:",
        "",
        f"- first steps that ran out of memory: **{warned}/{len(ooms)} warned** (room above the weights / activations: {room(ooms)});",
        f"- first steps that ran: **{alarmed}/{len(ran)} alarmed** (room / activations from {ran_min:.2f} up);",
        f"- {sum(r['p'] is None for r in rows)} with no estimate (a model or precision the library does not hold).",
        "",
        f"The overhead {FIRST_STEP_OVERHEAD:g} was chosen as the middle of that gap (every failure at <= {fail_max:.2f}, every",
        f"success at >= {ran_min:.2f}) on these sessions; sessions no choice saw are in docs/BENCHMARKS.md",
        "(`gpuwatch eval --first-step`).",
    ]


def shortfalls(rep, max_fa_per_hour: float) -> str:
    m = rep.by_scenario or rep.by_session
    if m is None:
        return "Not evaluated."
    out = []
    for label, mm in (("leave one scenario out", rep.by_scenario), ("sessions held out", rep.by_session)):
        if mm is None:
            continue
        if mm.recall is None or mm.recall < 0.95:
            out.append(f"recall ({label}) is {_f(mm.recall)}, below 0.95")
        if mm.near_fa_per_hour is None or mm.near_fa_per_hour > max_fa_per_hour:
            out.append(f"near-limit false alarms ({label}) are {_f(mm.near_fa_per_hour, '{:.1f}')} per healthy hour, "
                       f"above {max_fa_per_hour:g}")
        if mm.lead_s_median is None or mm.lead_s_median < 3.0:
            out.append(f"median lead ({label}) is {_f(mm.lead_s_median, '{:.1f}')} s, below 3 s")
    lost = [n for n, b in rep.baselines.items() if (rep.at_baseline_fa.get(n) is None or rep.at_baseline_fa[n].caught <= b.caught)]
    if lost:
        out.append(f"not better than {', '.join(lost)} at their near-limit false-alarm rates")
    return ("Falls short: " + "; ".join(out) + ".") if out else "All met on this data."


def _model_sections(rep) -> list[str]:
    """The card's features table and its description of the model and of loading it."""
    return [
        "## Features (the one feature function, `gpuwatch/predict/features.py`)",
        "",
        "| feature | unit | what |",
        "|---|---|---|",
        FEATURE_TABLE,
        "",
        "## Model",
        "",
        "`gpuwatch/predict/composite.py`: risk = max(p_estimator x 0.5 / t_e, p_classifier x 0.5 / t_c), alarm at 0.5,",
        f"with t_e = {_f(rep.operating_point[0], '{:g}')} and t_c = {_f(rep.operating_point[1], '{:g}')} "
        "(picked on the session-held-out scores; inf: the classifier never alarms alone).",
        "Above the alarm the estimator's part goes on rising with how far the plan's estimated peak lies over the",
        "usable limit (`over`: the larger of `next_peak_est_frac` and `ahead_peak_est_frac`, less 1): + (1 - 0.5 / t_e)",
        f"x (1 - exp(-over / {OVER_SCALE:g})). Which windows alarm is unchanged; it orders the alarms, so a threshold above the",
        "alarm keeps the steps estimated well over the limit and drops those just over it (which the cap's",
        "fragmentation margin often still holds) - without it every alarm at p ~1 scored the same 0.5 / t_e.",
        "p_estimator is the feature `peak_cross_p` (no learning; `predict/peak.py`): the planned step's peak",
        "against the usable limit, raised to 0.99 for a plan no smaller than a shape that ran out of memory",
        "earlier in the session (a censored observation), and to 0.9 for an inference plan that needs 5 % of",
        "the limit more than any step's peak and more than the room outside the allocator's full segments",
        "(fragmentation). That second rule is limited to inference after a held-out evaluation of it on",
        "training steps too (5.8 near-limit false alarms an hour; 1.5 inference-only): a choice made on",
        "held-out figures, so this card's figures are optimistic about it. Where the workload plans further",
        "than its next step (a schedule, a loader's batches drawn ahead: `predict/ahead.py`), p_estimator is",
        "`ahead_cross_p` where that is higher: the largest step planned within 4 s, its estimate and the",
        "fragmentation rule (not the failed-shape rule: applied ahead it raised 3 near-limit false alarms on",
        "a decode ramp whose failed shape ran on the next climb, in a development run of that variant, not",
        "kept in the tree - again a choice made on held-out figures). The lookahead ends where the run does",
        "(`--duration`, `--steps`), and a run's last step plans no next one: rules added after 5 of the 7",
        "false alarms on the sessions no choice had seen warned of a timed ramp's levels past its end, and one",
        "of this card's near-limit false alarms was a failed shape planned after the run's deadline - so these",
        "figures, and the held-out sessions', are optimistic about those rules (`gpuwatch backfill --refill`",
        "rewrote the recorded sessions' plan columns as the rule would have).",
        "After an OOM, a replay scores the plan the recovery recorded (or none), not the last step's. p_classifier: scikit-learn",
        "HistGradientBoostingClassifier (100 trees of at most 7 leaves, at least 200 windows a leaf) over the",
        "context features (`CONTEXT` in `predict/train.py`), monotone in the memory-pressure features (more",
        "pressure never lowers the risk), every session weighted the same, classes not re-weighted (its output",
        "stays near a frequency); missing values handled natively. An alarm, once raised, holds until the risk",
        "falls below half the threshold (the live scorer and this evaluation both). Reasons shown live are",
        "occlusion effects: each feature in turn set to its healthy median, and how far the risk falls.",
        "",
        "Loading checks the manifest beside the file (features and their order, schema version,",
        "scikit-learn version, sha256 of the file): joblib runs code when it loads, so a file whose hash",
        "does not match is refused unless `--trust-model` is given.",
        "",
    ]


def _sampled(d: dict, evaluated: bool = False) -> list[str]:
    """The fit's sample of the windows (predict/sampling.py), where the data says (older manifests do not)."""
    if "fit_windows" not in d:
        return []
    out = [f"The fits take {d['fit_windows']} of the {d['labelled_windows']} labelled windows (recorded and derived): every",
           "informative one (near the limit, before an event, around a plan change, labelled positive) and a weighted",
           "sample of the long quiet stretches (`gpuwatch/predict/sampling.py`); evaluation scores every window."]
    f = d.get("fit")
    if f:  # the final fit's budget (predict/budget.py)
        tiers = "; ".join(f"{k} {v['kept']} of {v['seen']}" for k, v in f["tiers"].items())
        out += [f"The final fit saw {f['seen']} of those windows and kept {f['kept']} (at most {f['budget']}: `--max-windows`;",
                f"{tiers}). " + (f"**{f['note']}.**" if f.get("note") else "Every one fit: none was left out.")
                + (" Each cross-validation fold's training side took the same budget over the sessions not in it."
                   if f.get("note") and evaluated else "")]
    return out + [""]
