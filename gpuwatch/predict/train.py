"""`gpuwatch train`: fit the failure-risk model on recorded sessions and say honestly how well it
predicts, against the simple rules anyone could write.

Evaluation never mixes a session's windows into both sides: cross-validation is grouped by session
(leave one session out) and, separately, by scenario (leave one kind of run out: ramp, leak,
fragmentation, near-cap, ...). The alarm threshold is picked on the session-grouped out-of-fold
scores and then applied unchanged to the scenario folds.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import numpy as np

from gpuwatch.errors import UsageError
from gpuwatch.predict import evaluate as E
from gpuwatch.predict.budget import MAX_WINDOWS, FitSet, build
from gpuwatch.predict.budget import reference as budget_reference
from gpuwatch.predict.card import FEATURE_TABLE, write_card  # noqa: F401 (FEATURE_TABLE: kept importable here)
from gpuwatch.predict.composite import ALARM, RiskComposite
from gpuwatch.predict.dataset import HORIZON_S, Timeline, describe, fit_rows, load_sessions
from gpuwatch.predict.features import NAMES
from gpuwatch.predict.model import save_model

MAX_FA_PER_HOUR = 2.0  # false alarms per healthy hour at >= 90 % of the limit (evaluate.NEAR_FRAC)
SESSION_FOLDS = 5
SEED = 0


# More memory pressure never lowers the risk, more room never raises it: monotone constraints keep
# the trees from learning a session's quirks (+1 rising, -1 falling, 0 free).
MONOTONE = {"mem_used_frac": 1, "mem_max_frac_30s": 1, "mem_slope_5s": 1, "mem_slope_30s": 1, "mem_accel": 1,
            "torch_peak_frac": 1, "torch_peak_max_frac": 1, "alloc_growth_frac_per_step": 1,
            "next_peak_est_frac": 1, "peak_cross_p": 1, "ahead_cross_p": 1, "ahead_peak_est_frac": 1, "peak_margin_sigmas": -1, "plan_vs_max_fit": 1,
            "plan_growth": 1, "ooms_60s": 1, "others_mem_frac": 1, "torch_reserved_gap_frac": 1,
            "torch_reserved_frac": 1, "frag_need_frac": 1,
            "mem_headroom_gib": -1, "time_to_full_s": -1, "secs_since_oom": -1}

# The estimator's own figures (predict/peak.py): the backbone of the risk.
ESTIMATOR = ("peak_cross_p", "ahead_cross_p", "next_peak_est_frac", "peak_margin_sigmas", "ahead_peak_est_frac")
# What the estimator cannot see - leaks and slow growth, fragmentation, other processes, gaps - for
# the classifier on top of it.
CONTEXT = ("mem_used_frac", "mem_slope_5s", "time_to_full_s", "alloc_growth_frac_per_step",
           "torch_reserved_gap_frac", "torch_reserved_frac", "frag_need_frac", "others_mem_frac", "plan_growth",
           "plan_vs_max_fit",
           "secs_since_oom", "missing_frac")
CORE = ESTIMATOR + CONTEXT
# "hgb-context": the composite's classifier (predict/composite.py); "hgb-core": one classifier over the
# estimator's figures and the context together (measured against it in the card's ablation).
KINDS = {"hgb-context": CONTEXT, "hgb-core": CORE}
T_ESTIMATOR = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
# 1.0: the classifier never raises the alarm alone (its probability stays under 1), but its half-scaled
# probability still shows in the risk - where the estimator has nothing to go on (no step has run, a
# workload without allocator figures, `watch` of other processes) and for a lowered --risk-threshold.
# 2.0: the same at a quarter of its probability, which can neither raise an alarm nor hold one the estimator
# raised (the alarm clears below half the threshold): held alarms count as new false alarms every horizon.
T_CLASSIFIER = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98, 1.0, 2.0)


def make_estimator(seed: int = SEED, kind: str | None = None):
    import os

    kind = kind or os.environ.get("GPUWATCH_MODEL_KIND", "hgb-context")
    if kind in KINDS:  # the trees over a physical core of the features only
        from sklearn.compose import ColumnTransformer
        from sklearn.ensemble import HistGradientBoostingClassifier
        from sklearn.pipeline import make_pipeline

        names = KINDS[kind]
        cols = [NAMES.index(n) for n in names]
        return make_pipeline(ColumnTransformer([("core", "passthrough", cols)]),
                             HistGradientBoostingClassifier(max_iter=100, learning_rate=0.1, max_leaf_nodes=7,
                                                            max_bins=63, min_samples_leaf=200, l2_regularization=1.0,
                                                            monotonic_cst=[MONOTONE.get(n, 0) for n in names],
                                                            random_state=seed))
    if kind == "logistic":
        from sklearn.impute import SimpleImputer
        from sklearn.linear_model import LogisticRegression
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler

        return make_pipeline(SimpleImputer(strategy="median", add_indicator=False), StandardScaler(),
                             LogisticRegression(C=0.3, max_iter=2000))
    return _hgb(seed)


def _hgb(seed: int = 0):
    """Gradient-boosted trees: handle NaN (missing telemetry) natively, fast to score one row,
    monotone where physics says so; large leaves so that no single session can be memorized."""
    from sklearn.ensemble import HistGradientBoostingClassifier

    return HistGradientBoostingClassifier(max_iter=120, learning_rate=0.1, max_leaf_nodes=15, max_bins=63,
                                          min_samples_leaf=100, l2_regularization=1.0,
                                          monotonic_cst=[MONOTONE.get(n, 0) for n in NAMES], random_state=seed)


def _fit(est, X, y, w) -> None:
    steps = getattr(est, "steps", None)
    if steps:  # a Pipeline: the weights go to its last step
        est.fit(X, y, **{f"{steps[-1][0]}__sample_weight": w})
    else:
        est.fit(X, y, sample_weight=w)


def weights(tls: list[Timeline], balance: bool = True) -> np.ndarray:
    """Every session weighs the same (a long one must not drown the rest), and, with `balance`,
    positives as much as negatives in total (they are a few % of windows; without it the
    probabilities stay close to the real frequencies, as a part meant to be calibrated needs)."""
    parts = []
    for t in tls:
        m = fit_rows(t)
        if t.w is None:
            parts.append(np.full(int(m.sum()), 1.0 / max(1, int(m.sum()))))
        else:  # sampled (predict/sampling.py): each kept window for the windows it stands for
            parts.append(t.w[m] / max(1.0, float(t.w[m].sum())))
    w = np.concatenate(parts) if parts else np.array([])
    y = np.concatenate([t.y[fit_rows(t)] for t in tls]) if tls else np.array([])
    pos, neg = w[y == 1].sum(), w[y == 0].sum()
    if balance and pos > 0 and neg > 0:
        w[y == 1] *= neg / pos
    return w / w.mean() if w.size else w


# OpenMP threads per fit. 2, not 1: the trees' bits depend on it - one thread sums the gradients in
# another order (the then shipped model, every window in the fit - now `--no-sample` - from one thread hashes
# 461b7ec8..., not 614e14a9...), while 2, 3, 4 and 16 threads all gave its bytes (measured on the shipped
# sessions' windows, the final fit; not measured again for the sampled fit).
# The shipped model was fit with 2: the old one-thread limit never held (scikit-learn's libgomp was not
# loaded yet when it was applied), so every fit ran with the 2 cores of the machine that made it.
FIT_THREADS = 2


def fit_threads(n: int = FIT_THREADS):
    """A context in which scikit-learn's fits use `n` OpenMP threads. threadpoolctl limits only the
    runtimes already loaded, so scikit-learn's (libgomp, loaded by its gradient-boosting module) is
    imported first - without it the limit held for nothing and each fit took every core."""
    import sklearn.ensemble  # noqa: F401 - loads the OpenMP runtime the limit must reach
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=n, user_api="openmp")


def _xy(tls: list[Timeline]) -> tuple[np.ndarray, np.ndarray]:
    X = np.concatenate([t.X[fit_rows(t)] for t in tls])
    y = np.concatenate([t.y[fit_rows(t)] for t in tls])
    return X, y


def fit(tls: list[Timeline], seed: int = SEED, kind: str = "hgb-context", balance: bool = False):
    """The classifier on every timeline given (recorded and derived). Unbalanced by default: the
    composite reads its output as a probability."""
    X, y = _xy(tls)
    if len(set(y.tolist())) < 2:
        raise UsageError("training data needs both failures and healthy running (found one class only)")
    est = make_estimator(seed, kind)
    _fit(est, X, y, weights(tls, balance))
    return est


def fit_set(fs: FitSet, seed: int = SEED, kind: str = "hgb-context", balance: bool = False):
    """`fit` on a budget's rows (predict/budget.py): the same classifier as `fit` of the timelines they
    come from, where every row was kept."""
    if len(set(np.unique(fs.y).tolist())) < 2:
        raise UsageError("training data needs both failures and healthy running (found one class only)")
    est = make_estimator(seed, kind)
    _fit(est, fs.X, fs.y, fs.weights(balance))
    return est


def estimator_scores(tls: list[Timeline], lookahead: bool = True) -> list[np.ndarray]:
    """The estimator's own probability per window (no learning): the composite's estimator part
    (`peak_cross_p`, or `ahead_cross_p` where higher); with `lookahead` False, the next step's only."""
    return [E.ESTIMATOR_RULE[2](t) if lookahead else np.nan_to_num(E.column(t, "peak_cross_p"), nan=0.0)
            for t in tls]


def estimator_over(tls: list[Timeline], lookahead: bool = True) -> list[np.ndarray]:
    """The estimate's excess over the usable limit per window (the composite's `over_limit`): the next
    step's and, with `lookahead`, the lookahead's largest step's."""
    from gpuwatch.predict.composite import RiskComposite

    nxt, ahead = RiskComposite.OVER
    return [RiskComposite.over_limit(E.column(t, nxt), E.column(t, ahead) if lookahead else np.full(len(t.ts_us), np.nan))
            for t in tls]


def composite_scores(p_est: list[np.ndarray], p_clf: list[np.ndarray], t_e: float, t_c: float,
                     over: list[np.ndarray] | None = None) -> list[np.ndarray]:
    """The composite's risk per window; `over` (estimator_over) ranks the alarms above the alarm level -
    which windows alarm is the same without it (pick_operating_point leaves it out)."""
    from gpuwatch.predict.composite import RiskComposite

    c = RiskComposite(None, t_e, t_c)
    overs: list[np.ndarray | None] = list(over) if over is not None else [None] * len(p_est)
    return [c.combine(a, b, o)[:, 1] for a, b, o in zip(p_est, p_clf, overs)]


def pick_operating_point(tls: list[Timeline], p_est: list[np.ndarray], p_clf: list[np.ndarray], horizon_s: float
                         ) -> tuple[float, float, E.Metrics, str]:
    """(t_e, t_c): the pair that catches the most OOMs with at most MAX_FA_PER_HOUR false alarms per
    healthy hour near the limit (on a tie, `preference`: fewest false alarms in all, then the earlier warning);
    where no pair meets the budget, the pair with the fewest near-limit false alarms."""
    from gpuwatch.predict.composite import ALARM

    rows = []
    for te in T_ESTIMATOR:
        for tc in T_CLASSIFIER:
            m = E.event_metrics(tls, composite_scores(p_est, p_clf, te, tc), ALARM, horizon_s)
            rows.append((te, tc, m))
    ok = [r for r in rows if r[2].near_fa_per_hour is not None and r[2].near_fa_per_hour <= MAX_FA_PER_HOUR]
    if ok:
        te, tc, m = max(ok, key=preference)
        return te, tc, m, (_parts(te, tc) + f": the most OOMs caught with at most {MAX_FA_PER_HOUR:g} false alarms per healthy hour "
                           f"at >= {E.NEAR_FRAC:.0%} of the limit, on out-of-fold scores")
    te, tc, m = min(rows, key=lambda r: (r[2].near_false_alarms, -r[2].caught, r[2].false_alarms, -r[0], -r[1]))
    return te, tc, m, (f"no operating point kept the near-limit false alarms within {MAX_FA_PER_HOUR:g} per healthy "
                       f"hour; this one has the fewest, then catches the most, then raises the fewest false alarms in "
                       f"all ({_parts(te, tc)})")


def preference(row: tuple[float, float, E.Metrics]) -> tuple:
    """The order of (t_e, t_c, metrics) rows within the false-alarm budget: the most OOMs caught, then the fewest
    false alarms in all, then the earlier warning - the longer median lead, then the longer 10th-percentile lead,
    then the lower estimator threshold (which alarms no later at any moment) - then the higher classifier
    threshold (the classifier alarms alone only where that pays). A guard acts on the warning, and the issue asks
    for lead. Before session 51 a tie on the first two went to the higher thresholds: retrained on the same sessions
    after two estimator changes, t_e 0.7 and 0.9 caught the same 272 OOMs with the same 8 false alarms out of
    fold, and 0.9 was taken though it warned later (10th-percentile lead 2.8 s against 3.2); on the (seen) held-out
    sets it lost 6 catches more than 0.7 (docs/BENCHMARKS.md, issue 29, session 51: a rule chosen after that look)."""
    te, tc, m = row
    return (m.caught, -m.false_alarms, _lead(m.lead_s_median), _lead(m.lead_s_p10), -te, tc)


def _lead(s: float | None) -> float:
    """A lead for ordering (none: the shortest)."""
    return s if s is not None and s == s else -math.inf


def _parts(te: float, tc: float) -> str:
    if tc < 1.0:
        return f"the estimator alarms at p >= {te:g}, the classifier at p >= {tc:g}"
    return (f"the estimator alarms at p >= {te:g}; the classifier never alarms on its own (no threshold of its kept "
            f"the near-limit false alarms within budget while catching more) but shows in the risk at "
            f"{0.5 / tc:.0%} of its probability" + ("" if tc <= 1.0 else ", too little to hold an alarm either"))


def scores_of(est, tls: list[Timeline]) -> list[np.ndarray]:
    return [est.predict_proba(t.X)[:, 1] if t.X.size else np.array([]) for t in tls]


def out_of_fold(tls: list[Timeline], key: Callable[[Timeline], str], progress=None, folds: int | None = None,
                kind: str | None = None, balance: bool = True, jobs: int = 1, threads: int = FIT_THREADS,
                max_windows: int = MAX_WINDOWS) -> list[np.ndarray]:
    """Scores of each *recorded* timeline by a model that never saw its group (session or scenario):
    counterfactual copies train alongside their source, so a held-out session's copies are held out
    with it. With `folds`, groups are dealt round-robin into that many folds (grouped k-fold), else
    one fold each. Returns one array per timeline (empty for derived ones: never scored). `jobs` > 1:
    the folds fit in that many processes, `threads` OpenMP threads each - the same scores as one.
    Each fold's training rows are the final fit's budget (predict/budget.py: at most `max_windows`) over the
    timelines not in it, built where the fold runs; timelines on disk (dataset.on_disk) travel as their
    files, and a held-out one is scored there from its windows' file - only the scores come back."""
    from gpuwatch.predict.dataset import stub

    groups = sorted({key(t) for t in tls if not t.derived})
    if folds and folds < len(groups):
        fold_of = {g: i % folds for i, g in enumerate(groups)}
        k0 = key
        key = lambda t: f"fold {fold_of.get(k0(t), -1) + 1}"  # noqa: E731
        groups = sorted({key(t) for t in tls if not t.derived})
    out: list[np.ndarray] = [np.zeros(0)] * len(tls)
    keys = [key(t) for t in tls]
    held = [[j for j, t in enumerate(tls) if keys[j] == g and not t.derived] for g in groups]
    light = [stub(t) for t in tls]  # what a fold's training side needs: on-disk timelines as their files

    def work():  # one fold at a time (a generator: joblib takes them as workers free up)
        for g, h in zip(groups, held):
            train = [t for t, k in zip(light, keys) if k != g]
            yield (train, [tls[j].X if tls[j].windows is None else tls[j].windows for j in h], kind, threads,
                   balance, max_windows)

    from gpuwatch.predict.parallel import in_order

    for i, (g, h, scores) in enumerate(zip(groups, held, in_order(fold_scores, work(), jobs))):
        for j, sc in zip(h, scores if scores is not None else [np.zeros(tls[j].y.size) for j in h]):
            out[j] = sc
        if progress and scores is not None:
            progress(f"  fold {i + 1}/{len(groups)}: held out {g}")
    return out


def fold_scores(train: list[Timeline], held: list[np.ndarray | Path], kind: str | None, threads: int = FIT_THREADS,
                balance: bool = True, max_windows: int = MAX_WINDOWS) -> list[np.ndarray] | None:
    """One fold: the classifier fit on the budget's rows of `train` (predict/budget.py; `balance`: positives
    weigh as much as negatives), its scores of each held-out timeline's windows (their features, or the file
    that holds them: predict/shards.py, read one at a time); None where the training side has one class only.
    Run here or in a worker process alike."""
    fs = build(train, max_windows, SEED)
    if len(set(np.unique(fs.y).tolist())) < 2:
        return None
    with fit_threads(threads):
        est = make_estimator(kind=kind)
        _fit(est, fs.X, fs.y, fs.weights(balance))
        del fs
        return [est.predict_proba(_windows(x))[:, 1] for x in held]


def _windows(x: np.ndarray | Path) -> np.ndarray:
    """A held-out timeline's features: given, or read from its file (predict/shards.py)."""
    if isinstance(x, np.ndarray):
        return x
    from gpuwatch.predict.shards import read

    return read(x)[4]


@dataclass
class Report:
    model_path: Path
    card_path: Path
    data: dict[str, Any]
    threshold: float
    threshold_why: str
    by_session: E.Metrics | None  # None: no evaluation was run (`train --no-eval`)
    by_scenario: E.Metrics | None
    baselines: dict[str, E.Metrics]
    at_baseline_fa: dict[str, E.Metrics | None]
    per_scenario: dict[str, E.Metrics]
    ablation: dict[str, E.Metrics]
    counterfactual: dict[str, Any]
    by_session_folds: int
    operating_point: tuple[float, float | None]
    seconds: float
    warnings: list[str]
    horizon_s: float = HORIZON_S
    stride: int = 1
    first_step: list = field(default_factory=list)  # prior.leave_one_out's rows (p of each first attempt)
    library_entries: int = 0


def train(sessions: list[Path], out: Path, progress: Callable[[str], None] = print, stride: int = 1,
          horizon_s: float = HORIZON_S, evaluate: bool = True, threshold: float | None = None,
          counterfactual: bool = True, command: str | None = None, threads: int = FIT_THREADS, jobs: int = 1,
          dask: str | None = None, sample: bool = True, features_dir: Path | None = None,
          max_windows: int = MAX_WINDOWS) -> Report:
    """Fit on `sessions` (each usable one: predict/usable.py; the others skipped, one line each) and write the
    model, its manifest and card at `out`. `jobs`: processes for cutting windows and for the cross-validation
    folds; `dask`: a Dask scheduler's address (or local:N) to run them on instead (predict/parallel.py);
    `threads`: OpenMP threads per fit. The model's bytes are the same for any `jobs` or cluster. `sample`:
    the fits take the informative windows and a weighted sample of long quiet stretches
    (predict/sampling.py; evaluation scores every window). `features_dir`: every window's features kept there
    as Parquet (predict/shards.py). `max_windows`: the final fit, and each cross-validation fold's, takes at
    most that many rows (predict/budget.py); the windows wait on disk for them, not in this process - with
    evaluation the folds score the recorded timelines' windows from disk too, and this process keeps of each
    window only its time, label, score and the few features evaluation reads (on a remote Dask cluster, whose
    workers' disks this process cannot read, the timelines come back whole instead, compacted without
    evaluation)."""
    import tempfile

    from gpuwatch.predict.parallel import cluster

    with cluster(dask), tempfile.TemporaryDirectory(prefix="gpuwatch-fit-") as fit_dir:
        on_disk = not dask or dask.startswith("local:")
        return _run(sessions, out, progress, stride, horizon_s, evaluate, threshold, counterfactual, command,
                    threads, jobs, sample, features_dir, max_windows, Path(fit_dir) if on_disk else None)


def _run(sessions, out, progress, stride, horizon_s, evaluate, threshold, counterfactual, command, threads, jobs,
         sample, features_dir, max_windows: int = MAX_WINDOWS, fit_dir: Path | None = None) -> Report:
    import tempfile

    from gpuwatch.predict.counterfactual import validate

    t0 = time.perf_counter()
    progress(f"reading {len(sessions)} session(s) and cutting windows (every {stride} sample(s))"
             + (", with counterfactual-cap copies" if counterfactual else "") + "...")
    with tempfile.TemporaryDirectory(prefix="gpuwatch-cf-") as cf:
        tls, warnings = load_sessions(sessions, stride, progress, horizon_s, Path(cf) if counterfactual else None,
                                      jobs=jobs, sample=sample, compact=not evaluate, features_dir=features_dir,
                                      fit_dir=fit_dir)
    for w in warnings:  # a session left out: "skipped: <session>: why", one line each
        progress(w if w.startswith("skipped: ") else f"warning: {w}")
    if not [t for t in tls if not t.derived]:
        raise UsageError(f"no usable session to train on ({len(sessions)} given, every one skipped)")
    data = describe(tls)
    progress(f"{data['windows']} windows, {data['positives']} positive, {data['failures']} OOM events, "
             f"{data['sessions']} sessions ({data['healthy_minutes']} healthy minutes); "
             f"{data['derived_sessions']} counterfactual copies ({data['derived_windows']} windows, "
             f"{data['derived_failures']} virtual OOMs) for training only; scenarios: {', '.join(data['scenarios'])}")
    from gpuwatch.predict.first_step import leave_one_out
    from gpuwatch.predict.prior import from_parts, read_parts

    read = [Path(p) for p in sessions if Path(p).name in {t.session for t in tls if not t.derived}]
    cfv = validate(read) if counterfactual else {}  # the sessions read: none that was skipped
    parts = read_parts(read)
    library = from_parts(parts.values())  # the first step's a-priori estimate (predict/prior.py)
    progress(f"shape library for a session's first step: {len(library)} model/mode/precision entries"
             + ("; each session's first step judged by the others' library..." if evaluate else ""))
    first = leave_one_out(read, 1.0, parts) if evaluate else []  # p only: the alarm is counted at the operating point
    with fit_threads(threads):
        rep = _train(tls, data, warnings, out, progress, horizon_s, evaluate, t0, threshold, stride, cfv, command,
                     library, first, par={"jobs": jobs, "threads": threads}, max_windows=max_windows)
    return rep


def _train(tls, data, warnings, out, progress, horizon_s, evaluate, t0, given=None, stride: int = 1,
           cfv: dict | None = None, command: str | None = None, library=None, first: list | None = None,
           par: dict | None = None, max_windows: int = MAX_WINDOWS) -> Report:
    par = {**(par or {}), "max_windows": max_windows}  # each fold's training rows: the final fit's budget
    by_session: E.Metrics | None = None
    by_scenario: E.Metrics | None = None
    threshold, why = (given, "given on the command line (no evaluation run)") if given else (0.5, "no evaluation run")
    baselines: dict[str, E.Metrics] = {}
    at_fa: dict[str, E.Metrics | None] = {}
    per_scen: dict[str, E.Metrics] = {}
    ablation: dict[str, E.Metrics] = {}
    real_idx = [i for i, t in enumerate(tls) if not t.derived]
    real = [tls[i] for i in real_idx]
    folds = 0
    t_e, t_c = 0.5, float("inf")
    if evaluate:
        n_groups = len({t.source for t in real})
        folds = min(SESSION_FOLDS, n_groups)
        progress(f"cross-validation grouped by session ({folds} folds of {n_groups} sessions; "
                 "no session, nor its counterfactual copies, on both sides)...")
        p_est, over = estimator_scores(real), estimator_over(real)
        oof = _real(out_of_fold(tls, lambda t: t.source, progress, folds, kind="hgb-context", balance=False, **par), real_idx)
        t_e, t_c, by_session, why = pick_operating_point(real, p_est, oof, horizon_s)
        threshold = ALARM
        by_session = E.event_metrics(real, composite_scores(p_est, oof, t_e, t_c, over), ALARM, horizon_s, with_auc=True)
        scen = sorted({t.scenario for t in real})
        progress(f"cross-validation grouped by scenario ({len(scen)} folds: leave one scenario out)...")
        oos = _real(out_of_fold(tls, lambda t: t.scenario, progress, kind="hgb-context", balance=False, **par), real_idx)
        comp_s = composite_scores(p_est, oos, t_e, t_c, over)
        by_scenario = E.event_metrics(real, comp_s, ALARM, horizon_s, with_auc=True)
        for sc in scen:
            idx = [i for i, t in enumerate(real) if t.scenario == sc]
            per_scen[sc] = E.event_metrics([real[i] for i in idx], [comp_s[i] for i in idx], ALARM, horizon_s)
        comp = composite_scores(p_est, oof, t_e, t_c, over)
        baselines = E.baseline_metrics(real, horizon_s)
        for name, m in baselines.items():
            fa = m.near_fa_per_hour if m.near_fa_per_hour is not None else 0.0
            at_fa[name] = E.recall_at_fa(real, comp, fa, horizon_s, near=True)
        progress("ablation: each part alone, and one classifier over both (grouped by session)...")
        te_only, _, _, _ = pick_operating_point(real, p_est, [np.zeros_like(x) for x in p_est], horizon_s)
        oof_core = _real(out_of_fold(tls, lambda t: t.source, None, folds, kind="hgb-core", **par), real_idx)
        t_core, _ = E.pick_threshold(real, oof_core, MAX_FA_PER_HOUR, horizon_s, near=True)
        t_ctx, _ = E.pick_threshold(real, oof, MAX_FA_PER_HOUR, horizon_s, near=True)
        ablation = {
            f"estimator alone (alarm at p >= {te_only:g})": E.event_metrics(
                real, composite_scores(p_est, oof, te_only, float("inf"), over), ALARM, horizon_s, with_auc=True),
            f"classifier alone, context features (alarm at p >= {t_ctx:.3f})": E.event_metrics(
                real, oof, t_ctx, horizon_s, with_auc=True),
            f"one classifier over the estimator's figures and the context (balanced; alarm at {t_core:.3f})":
                E.event_metrics(real, oof_core, t_core, horizon_s, with_auc=True),
            "estimator + classifier, each at its operating point (shipped)": by_session,
        }
        if any(np.isfinite(E.column(t, "ahead_cross_p")).any() for t in real):
            ablation["the same without the lookahead (next step only; predict/ahead.py)"] = E.event_metrics(
                real, composite_scores(estimator_scores(real, lookahead=False), oof, t_e, t_c,
                                       estimator_over(real, lookahead=False)), ALARM, horizon_s,
                with_auc=True)
    progress("fitting the final model on every session and its counterfactual copies...")
    clf, reference, data["fit"] = _final_fit(tls, max_windows, progress)
    est = RiskComposite(clf, t_e, t_c)
    manifest = {
        "horizon_s": horizon_s, "threshold": threshold, "threshold_why": why, "window_s": 30.0,
        "operating_point": {"estimator": t_e, "classifier": None if t_c == float("inf") else t_c},
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "seed": SEED, "stride": stride,
        "training_sessions": sorted({t.session for t in real}), "data": data,
        "reference": [None if not np.isfinite(v) else float(v) for v in reference],
        "metrics": {"by_session": by_session.row() if by_session else None,
                    "by_scenario": by_scenario.row() if by_scenario else None},
    }
    if library is not None and len(library):
        manifest["first_step"] = library.to_json()
    path = save_model(est, manifest, out)
    rep = Report(path, path.with_suffix(".md"), data, threshold, why, by_session, by_scenario, baselines, at_fa,
                 per_scen, ablation, cfv or {}, folds if evaluate else 0,
                 (t_e, None if t_c == float("inf") else t_c), time.perf_counter() - t0, warnings,
                 horizon_s, stride, first or [], len(library) if library is not None else 0)
    write_card(rep, MAX_FA_PER_HOUR, command or f"gpuwatch train -o {out}")
    progress(f"wrote {path} and {rep.card_path} in {rep.seconds:.0f} s")
    return rep


def _final_fit(tls: list[Timeline], max_windows: int, progress: Callable[[str], None]):
    """(the classifier, the healthy reference values, what the fit saw and kept) on at most `max_windows`
    rows of `tls` (predict/budget.py)."""
    fs = build(tls, max_windows, SEED)
    s = fs.summary
    progress(f"the final fit: {s['kept']} of {s['seen']} windows (budget {max_windows}"
             + (f"; {s['note']})" if s["note"] else ": every one)"))
    return fit_set(fs), budget_reference(fs.X, fs.y), s


def _real(scores: list[np.ndarray], idx: list[int]) -> list[np.ndarray]:
    return [scores[i] for i in idx]
