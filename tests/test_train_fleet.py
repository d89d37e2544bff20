"""Issue 31 (2, 3, 5): training and scoring a fleet's recordings - the fit's sample of the windows
(predict/sampling.py), the timelines compacted to it and the features kept as Parquet (predict/shards.py),
`score` in several processes, and the Dask cluster's address checked."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from conftest import ROOT

LONG = ROOT / "recordings" / "h200-oom-2026-11-30" / "ok-long-train-b13-soak"  # 4 min, quiet stretches
DECODE = ROOT / "recordings" / "h200-oom-2026-11-30" / "ok-decode-v2lite"
CAPPED = ROOT / "recordings" / "sample-h200-capped-ramp-train"


def _quiet(n: int, X_near: float = 0.1):
    from gpuwatch.predict.features import NAMES

    X = np.full((n, len(NAMES)), np.nan)
    X[:, NAMES.index("mem_used_frac")] = X_near
    return (np.arange(n, dtype=np.int64) * 1_000_000, X, np.zeros(n, dtype=np.int8))  # 1 window a second


def test_informative_windows_are_all_kept():
    from gpuwatch.predict.features import NAMES
    from gpuwatch.predict.sampling import informative

    ts, X, y = _quiet(1000)
    y[100] = 1
    y[101] = -1
    X[300, NAMES.index("mem_used_frac")] = 0.85
    X[400, NAMES.index("peak_cross_p")] = 0.01
    keep = informative(ts, X, y, np.array([700_000_000]), np.array([900_000_000]))
    want = {100, 101, 300, 400} | set(range(640, 701)) | set(range(870, 931))
    assert set(np.where(keep)[0]) == want


def test_a_long_quiet_stretch_is_sampled_and_weighs_what_it_weighed_whole():
    from gpuwatch.predict.sampling import QUIET_EDGE_S, QUIET_EVERY, fit_weights

    n = 1000
    keep = np.zeros(n, dtype=bool)
    keep[500] = True  # two quiet runs: 500 and 499 windows
    w = fit_weights(np.arange(n) * 1_000_000, keep, 1.0)
    edge = int(QUIET_EDGE_S)
    assert w[:500].sum() == 500 and w[501:].sum() == 499 and w[500] == 1
    assert (w[:edge] == 1).all() and (w[500 - edge:500] == 1).all()  # the way in and out: whole
    inner = w[edge:500 - edge]
    assert (inner > 0).sum() == -(-inner.size // QUIET_EVERY) and set(inner[inner > 0][:-1]) == {QUIET_EVERY}
    short = fit_weights(np.arange(100) * 1_000_000, np.zeros(100, dtype=bool), 1.0)
    assert (short == 1).all()  # a stretch within twice the edge is not sampled


def test_a_shipped_session_is_sampled_and_the_fit_takes_only_its_sample():
    """The soak session's quiet middle is sampled (fewer rows, the same total weight), and the fit's
    weights come from that sample (train.weights: each session still weighs the same)."""
    from gpuwatch.predict.dataset import session_timelines
    from gpuwatch.predict.train import fit_rows, weights

    (t,) = session_timelines(LONG, stride=1, sample=True)
    m = t.y != -1
    assert 0 < (t.w[m] > 0).sum() < m.sum() * 0.8 and t.w[m].sum() == m.sum()
    (whole,) = session_timelines(LONG, stride=1)
    assert np.array_equal(whole.X, t.X, equal_nan=True) and whole.w is None  # the windows themselves do not change
    w = weights([t], balance=False)
    assert w.size == fit_rows(t).sum() < whole.y.size


def test_compacted_timelines_give_the_same_fit_and_figures(tmp_path):
    """Without evaluation each timeline keeps only the rows the fit takes: the same classifier byte for
    byte, the same description of the data, and every window still on disk in the Parquet shards."""
    from gpuwatch.predict import shards
    from gpuwatch.predict.dataset import describe, load_sessions
    from gpuwatch.predict.train import fit, fit_threads

    full, _ = load_sessions([CAPPED, LONG], stride=10, counterfactual=tmp_path / "cf1", sample=True)
    small, _ = load_sessions([CAPPED, LONG], stride=10, counterfactual=tmp_path / "cf2", compact=True,
                             features_dir=tmp_path / "feat")
    assert sum(t.y.size for t in small) < sum(t.y.size for t in full)
    assert describe(small) == describe(full)
    with fit_threads(2):
        assert pickle.dumps(fit(small)) == pickle.dumps(fit(full))
    files = sorted((tmp_path / "feat").rglob("*.parquet"))
    assert len(files) == len(full)
    by_name = {t.session: t for t in full}
    for f in files:
        meta, ts, y, w, X = shards.read(f)
        t = by_name[meta["session"]]
        assert meta["derived"] == t.derived and np.array_equal(ts, t.ts_us) and np.array_equal(y, t.y)
        assert np.array_equal(w, t.w) and np.array_equal(X, t.X, equal_nan=True)
    assert not any((tmp_path / "cf2").rglob("meta.json"))  # the copies' files removed once cut


def test_with_evaluation_the_folds_score_from_disk_the_same_and_no_feature_matrix_comes_back(tmp_path):
    """With evaluation and a fit folder, no timeline holds its feature matrix: every window of a recorded one
    waits on disk for the folds to score, and it keeps only its times, labels and the few features evaluation
    reads; the counterfactual copies keep nothing per window. The out-of-fold scores (one and two processes),
    the estimator's and the baselines' figures are those of the timelines held whole."""
    from gpuwatch.predict import evaluate as E
    from gpuwatch.predict.dataset import describe, load_sessions
    from gpuwatch.predict.train import estimator_scores, out_of_fold

    held, _ = load_sessions([CAPPED, LONG], stride=10, counterfactual=tmp_path / "cf1", sample=True)
    disk, _ = load_sessions([CAPPED, LONG], stride=10, counterfactual=tmp_path / "cf2", sample=True,
                            fit_dir=tmp_path / "fit")
    assert len(disk) == len(held) and sum(t.X.size for t in disk) == 0
    assert describe(disk) == describe(held)
    real = [(a, b) for a, b in zip(held, disk) if not a.derived]
    assert len(real) == 2 and all(b.derived for a, b in zip(held, disk) if a.derived)
    for a, b in real:
        assert b.windows is not None and b.windows.exists() and set(b.cols) == set(E.COLUMNS)
        assert np.array_equal(a.ts_us, b.ts_us) and np.array_equal(a.y, b.y) and np.array_equal(a.step_ts, b.step_ts)
    assert all(t.y.size == 0 and t.cols is None for t in disk if t.derived)
    want = out_of_fold(held, lambda t: t.source, balance=False)
    assert sum(w.size for w in want) == sum(a.y.size for a, _ in real) > 300
    for jobs in (1, 2):
        got = out_of_fold(disk, lambda t: t.source, balance=False, jobs=jobs)
        assert all(np.array_equal(a, b) for a, b in zip(want, got))
    # over the budget each fold's training side is sampled (predict/budget.py): the same scores in any process
    small = [out_of_fold(disk, lambda t: t.source, balance=False, jobs=jobs, max_windows=150) for jobs in (1, 2)]
    assert all(np.array_equal(a, b) for a, b in zip(*small))
    assert not all(np.array_equal(a, b) for a, b in zip(want, small[0]))
    assert [a.size for a in small[0]] == [a.size for a in want]  # every window still scored
    h, d = [a for a, _ in real], [b for _, b in real]
    assert all(np.array_equal(a, b) for a, b in zip(estimator_scores(h), estimator_scores(d)))
    assert all(np.array_equal(a, b) for a, b in zip(estimator_scores(h, False), estimator_scores(d, False)))
    assert E.baseline_metrics(h) == E.baseline_metrics(d)


def test_train_with_evaluation_keeps_no_feature_matrix_and_gives_the_same_model_and_figures(tmp_path, monkeypatch):
    """`train` with evaluation: the timelines evaluation gets hold no feature matrix (the windows wait on disk);
    the model's bytes and the card's figures are those of the timelines held whole (what a remote Dask
    cluster still gives)."""
    import hashlib

    from gpuwatch.predict import train as T

    seen = []
    real_train = T._train

    def spy(tls, *a, **k):
        seen.append(tls)
        return real_train(tls, *a, **k)

    monkeypatch.setattr(T, "_train", spy)
    reps = {}
    for name, fit_dir in (("held", None), ("disk", tmp_path / "fit")):
        if fit_dir is not None:
            fit_dir.mkdir()
        reps[name] = T._run([CAPPED, LONG], tmp_path / name / "m.joblib", lambda _s: None, 10, T.HORIZON_S, True,
                            None, True, "c", 2, 1, True, None, T.MAX_WINDOWS, fit_dir)
    held, disk = seen
    assert sum(t.X.shape[0] for t in held) > 0 and sum(t.X.shape[0] for t in disk) == 0
    a, b = reps["held"], reps["disk"]
    assert hashlib.sha256(a.model_path.read_bytes()).digest() == hashlib.sha256(b.model_path.read_bytes()).digest()
    assert a.by_session == b.by_session and a.by_scenario == b.by_scenario and a.ablation == b.ablation
    assert a.baselines == b.baselines and a.at_baseline_fa == b.at_baseline_fa and a.per_scenario == b.per_scenario
    seen.clear()
    T.train([CAPPED, LONG], tmp_path / "t" / "m.joblib", progress=lambda _s: None, stride=10, jobs=1)
    assert seen and all(t.X.shape[0] == 0 for t in seen[0])  # what `gpuwatch train` does


def test_score_in_processes_gives_the_same_timeline(monkeypatch):
    from gpuwatch.predict import scorer
    from gpuwatch.predict.model import load_model
    from gpuwatch.recording.source import ReplaySource

    monkeypatch.setattr(scorer, "MIN_STRETCH", 100)  # 471 windows: 4 stretches
    model, src = load_model(), ReplaySource(DECODE)
    one = scorer.score_source(src, model)
    two = scorer.score_source(src, model, jobs=2)
    assert one.height > 400 and one.equals(two)


@pytest.mark.parametrize("text, ok", [("local:2", "local:2"), ("tcp://10.0.0.5:8786", "tcp://10.0.0.5:8786"),
                                      ("local:0", None), ("local:x", None), ("a b", None), ("", None)])
def test_dask_address_is_checked(text, ok):
    from gpuwatch.predict.parallel import parse_dask

    if ok:
        assert parse_dask(text) == ok
    else:
        with pytest.raises(ValueError):
            parse_dask(text)


def test_no_scheduler_at_the_address_is_one_line():
    pytest.importorskip("dask.distributed", reason="the test extra installs dask[distributed]")
    from gpuwatch.errors import UsageError
    from gpuwatch.predict.parallel import cluster

    with pytest.raises(UsageError, match="no Dask scheduler there"):
        with cluster("tcp://127.0.0.1:9", timeout_s=2):
            pass


def test_sessions_in_object_storage_are_copied_and_found_as_local_ones(tmp_path):
    """s3:// goes through fsspec like any other store; fsspec's in-memory store stands in for a bucket
    (s3fs itself and real credentials are not tested here): the sessions under the URL, not what is beside
    them, byte for byte, found in their places."""
    fsspec = pytest.importorskip("fsspec")
    from gpuwatch.predict.dataset import find_sessions
    from gpuwatch.predict.remote import is_url, local_copies

    fs = fsspec.filesystem("memory")
    for name, src in (("a/capped", CAPPED), ("b/c/decode", DECODE)):
        for f in src.iterdir():
            fs.pipe(f"/bucket/fleet/{name}/{f.name}", f.read_bytes())
    fs.pipe("/bucket/fleet/notes.txt", b"not a session")
    assert is_url("s3://bucket/x") and is_url("memory://bucket/fleet") and not is_url("recordings/x")
    try:
        with local_copies(["memory://bucket/fleet", CAPPED]) as given:
            assert given[1] == CAPPED
            found = find_sessions(given).sessions
            assert [p.relative_to(given[0]).as_posix() for p in found[:2]] == ["a/capped", "b/c/decode"]
            assert found[2] == CAPPED
            for f in DECODE.iterdir():
                assert (found[1] / f.name).read_bytes() == f.read_bytes()
            assert not (given[0] / "notes.txt").exists()
            local = given[0]
        assert not local.exists()  # the copy lives as long as the run
        from gpuwatch.errors import UsageError

        with pytest.raises(UsageError, match="no session under it"):
            with local_copies(["memory://bucket/empty"]):
                pass
    finally:
        fs.rm("/bucket", recursive=True)
