"""The model card: `models/NAME.md`, written by `gpuwatch train` from what the evaluation measured."""

from __future__ import annotations

from gpuwatch.predict import evaluate as E


def _f(v, fmt="{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def _row(name: str, m: E.Metrics | None, note: str = "") -> str:
    if m is None:
        return f"| {name} | - | - | - | - | - | - | - | {note} |"
    return (f"| {name} | {m.caught}/{m.oom_events} ({_f(m.recall)}) | {m.episodes_caught}/{m.episodes} ({_f(m.episode_recall)}) "
            f"| {_f(m.event_precision)} | {m.false_alarms} ({_f(m.false_alarms_per_hour, '{:.1f}')}/h) "
            f"| {_f(m.lead_s_median, '{:.1f}')} / {_f(m.lead_s_p10, '{:.1f}')} "
            f"| {_f(m.lead_steps_median, '{:.0f}')} / {_f(m.lead_steps_p10, '{:.0f}')} | {_f(m.pr_auc)} | {note} |")


HEAD = ("| rule | OOMs caught (recall) | episodes caught | event precision | false alarms (per healthy h) "
        "| lead s median / p10 | lead steps median / p10 | PR-AUC | note |\n|---|---|---|---|---|---|---|---|---|")


def verdicts(rep) -> list[str]:
    """Where the model does and does not beat each baseline, at the baseline's false-alarm rate."""
    out = []
    for name, b in rep.baselines.items():
        m = rep.at_baseline_fa.get(name)
        fa = _f(b.false_alarms_per_hour, "{:.1f}")
        if m is None:
            out.append(f"- **{name}**: at its {fa} false alarms/h the model has no threshold that low in false "
                       f"alarms; the baseline catches {b.caught}/{b.oom_events}. Not beaten at that rate.")
        elif m.caught > b.caught:
            out.append(f"- **{name}** ({b.caught}/{b.oom_events} at {fa}/h): the model catches {m.caught}/{m.oom_events} "
                       f"at {_f(m.false_alarms_per_hour, '{:.1f}')}/h (threshold {m.threshold:.3f}). Beaten.")
        elif m.caught == b.caught:
            out.append(f"- **{name}** ({b.caught}/{b.oom_events} at {fa}/h): the model catches the same number at "
                       f"{_f(m.false_alarms_per_hour, '{:.1f}')}/h. A tie, not a win.")
        else:
            out.append(f"- **{name}** ({b.caught}/{b.oom_events} at {fa}/h): the model catches only {m.caught}/{m.oom_events} "
                       f"at that rate. **The baseline is better here.**")
    return out


def write_card(rep) -> None:
    from gpuwatch.predict.train import FEATURE_TABLE, MAX_FA_PER_HOUR

    d = rep.data
    lines = [
        f"# Model card: {rep.model_path.name}",
        "",
        f"Predicts a CUDA out-of-memory failure of a GPU's workload within the next {rep.horizon_s:g} s, at least one",
        "step before it happens (so a guard can still act), from a 30 s window of that GPU's telemetry, its",
        "recent workload steps, its events and the workload's plan for its next step. Written by",
        f"`gpuwatch train` in {rep.seconds:.0f} s; every figure below was measured by that run.",
        "",
        "## Data",
        "",
        f"{d['sessions']} real H200 sessions recorded by gpuwatch (`gpuwatch stress` and the benchmark scripts; see",
        f"`recordings/README.md` and `recordings/h200-oom-2026-11-30/README.md` for every command): {d['windows']}",
        f"windows (one {'per sample' if rep.stride == 1 else f'every {rep.stride} samples'}), {d['positives']} positive,",
        f"{d['failures']} OOM events. Scenarios: {', '.join(d['scenarios'])}.",
        "",
        f"Sessions: {', '.join(rep_sessions(rep))}.",
        "",
        "## Alarm threshold",
        "",
        f"**{rep.threshold:.3f}**: {rep.threshold_why}. The threshold was chosen on the same out-of-fold scores",
        "the session table reports, so that row is optimistic about the threshold (not about the model,",
        "which never saw the held-out session); the scenario table applies it unchanged to models that never",
        "saw the held-out kind of run.",
        "",
        "## Results (held out: never trained on the session / scenario it is scored on)",
        "",
        HEAD,
        _row("model, sessions held out (5 grouped folds)", rep.by_session),
        _row("model, leave one scenario out", rep.by_scenario),
    ]
    for name, b in rep.baselines.items():
        lines.append(_row(f"baseline: {name}", b, E.BASELINES[name][0]))
    lines += ["", "Against each baseline at the same false-alarm rate (model scores out of fold, by session):", ""]
    lines += verdicts(rep)
    lines += ["", "Per scenario (leave one scenario out, at the chosen threshold):", "", HEAD]
    lines += [_row(sc, m) for sc, m in rep.per_scenario.items()]
    lines += [
        "",
        "## Targets and where it falls short",
        "",
        f"Target: OOM recall >= 0.95 with at least one step of warning, <= {MAX_FA_PER_HOUR:g} false alarm per healthy",
        "hour, better than every baseline at the same false-alarm rate. " + shortfalls(rep),
        "",
        "How to read the rates: the data holds only "
        f"{_f(rep.by_session.healthy_hours * 60 if rep.by_session else None, '{:.1f}')} minutes of healthy running, so one false alarm",
        f"is {_f(1 / rep.by_session.healthy_hours if rep.by_session and rep.by_session.healthy_hours else None, '{:.1f}')} per hour: "
        "the false-alarm rate is known only coarsely until more healthy near-limit hours are recorded.",
        "",
        "## Features (the one feature function, `gpuwatch/predict/features.py`)",
        "",
        "| feature | unit | what |",
        "|---|---|---|",
        FEATURE_TABLE,
        "",
        "## Model",
        "",
        "scikit-learn HistGradientBoostingClassifier (120 trees of at most 15 leaves, at least 100 windows a",
        "leaf, monotone in the memory-pressure features: more pressure never lowers the risk), every session",
        "weighted the same and positives as much as negatives in total; missing values handled natively.",
        "An alarm, once raised, holds until the risk falls below half the threshold (the live scorer and",
        "this evaluation both). Reasons shown live are occlusion effects: each feature in turn set to its",
        "healthy median, and how far the risk falls.",
        "",
        "Loading checks the manifest beside the file (features and their order, schema version,",
        "scikit-learn version, sha256 of the file): joblib runs code when it loads, so a file whose hash",
        "does not match is refused unless `--trust-model` is given.",
        "",
    ]
    rep.card_path.write_text("\n".join(lines))


def rep_sessions(rep) -> list[str]:
    import json

    from gpuwatch.predict.model import manifest_path

    try:
        return json.loads(manifest_path(rep.model_path).read_text())["training_sessions"]
    except (OSError, ValueError, KeyError):
        return []


def shortfalls(rep) -> str:
    m = rep.by_scenario or rep.by_session
    if m is None:
        return "Not evaluated."
    out = []
    if m.recall is None or m.recall < 0.95:
        out.append(f"recall (leave one scenario out) is {_f(m.recall)}, below 0.95")
    if m.false_alarms_per_hour is None or m.false_alarms_per_hour > 1.0:
        out.append(f"false alarms are {_f(m.false_alarms_per_hour, '{:.1f}')} per healthy hour, above 1")
    lost = [n for n, b in rep.baselines.items() if (rep.at_baseline_fa.get(n) is None or rep.at_baseline_fa[n].caught <= b.caught)]
    if lost:
        out.append(f"not better than {', '.join(lost)} at their false-alarm rates")
    return ("Falls short: " + "; ".join(out) + ".") if out else "All met on this data."
