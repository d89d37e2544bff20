"""Which sessions `train` and `score` use (predict/usable.py: one rule, one line per session left out),
how `train` finds them (folders searched, meta.json filters), its parallel jobs (the same model bytes for
any --jobs) and the threads its fits run with. Bad sessions are copies of real ones in tmp_path."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from conftest import ROOT

CAPPED = ROOT / "recordings" / "sample-h200-capped-ramp-train"  # 3 OOMs under an 80 GiB cap
ALONE = ROOT / "recordings" / "h200-oom-2026-11-30" / "ok-small-prefill-cap20"
CPU = ROOT / "recordings" / "cpu-gloo-2rank-train"  # NVML unavailable: no GPU in its samples


def _copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def _steps_renamed_and_retyped(d: Path) -> Path:
    st = pl.read_parquet(d / "steps.parquet")
    st.rename({"batch": "batchx"}).with_columns(pl.col("step_time_s").cast(pl.String)).write_parquet(d / "steps.parquet")
    return d


def _steps_renamed(d: Path) -> Path:
    pl.read_parquet(d / "steps.parquet").rename({"batch": "batchx"}).write_parquet(d / "steps.parquet")
    return d


def _meta_list(d: Path) -> Path:
    (d / "meta.json").write_text("[]")
    return d


def _no_steps(d: Path) -> Path:
    (d / "steps.parquet").unlink()
    return d


def _gpuwatch(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "gpuwatch", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def _one_error_line(r: subprocess.CompletedProcess, needle: str) -> str:
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 1, (r.returncode, r.stderr)  # a recording that cannot be used: as replay says it
    errs = [ln for ln in r.stderr.splitlines() if ln.startswith("gpuwatch: error:")]
    assert len(errs) == 1 and needle in errs[0], r.stderr
    return errs[0]


# -- defect 1: one bad session among good ones, with the counterfactual copies on ---------------------------
@pytest.mark.parametrize("make,needle", [(_steps_renamed_and_retyped, "steps table cannot be read"),
                                         (_meta_list, "meta.json: not a JSON object (a list)")])
def test_train_named_bad_session_is_one_line_and_no_model(tmp_path, make, needle):
    bad = make(_copy(ALONE, tmp_path / "bad"))
    out = tmp_path / "out" / "m.joblib"
    r = _gpuwatch("train", str(bad), str(CAPPED), "--stride", "20", "--no-eval", "-o", str(out))
    line = _one_error_line(r, needle)
    assert str(bad) in line
    assert not out.exists() and not out.with_suffix(".md").exists()
    assert not list(out.parent.glob("*")) if out.parent.exists() else True


def test_train_skips_unusable_sessions_among_good_ones_by_name(tmp_path):
    """The counterfactual copies read each session as replay does: a retyped steps table or a meta.json
    that is a list is the reader's one line, the session left out, never a traceback (defect 1); a CPU-only
    session and one whose steps.parquet is missing are left out too, by the rule `score` applies (defect 11)."""
    from gpuwatch.predict.train import train

    bad = {"bad-steps": ("steps table cannot be read", _steps_renamed_and_retyped(_copy(ALONE, tmp_path / "bad-steps"))),
           "bad-meta": ("not a JSON object", _meta_list(_copy(ALONE, tmp_path / "bad-meta"))),
           "cpu": ("no GPU in its samples", _copy(CPU, tmp_path / "cpu")),
           "no-steps": ("no steps table", _no_steps(_copy(ALONE, tmp_path / "no-steps")))}
    said: list[str] = []
    train([p for _, p in bad.values()] + [CAPPED], tmp_path / "m.joblib", progress=said.append, stride=20,
          evaluate=False)
    skipped = [m for m in said if m.startswith("skipped")]
    assert len(skipped) == len(bad), said
    for name, (why, _) in bad.items():
        assert sum(f"{name}" in m and why in m for m in skipped) == 1, (name, skipped)
    man = json.loads((tmp_path / "m.manifest.json").read_text())
    assert man["training_sessions"] == [CAPPED.name]


# -- defect 11: one rule for a usable session, the same in score and train ------------------------------------
@pytest.mark.parametrize("make,needle", [
    (lambda t: _copy(CPU, t / "cpu"), "no GPU in its samples: a CPU-only session"),
    (lambda t: _no_steps(_copy(ALONE, t / "no-steps")), "no steps table (steps.parquet missing)"),
    (lambda t: _steps_renamed_and_retyped(_copy(ALONE, t / "bad-steps")), "steps table cannot be read"),
    (lambda t: _meta_list(_copy(ALONE, t / "bad-meta")), "not a JSON object (a list)"),
])
def test_score_and_train_refuse_an_unusable_session_with_the_same_line(tmp_path, make, needle):
    from gpuwatch.predict.usable import Unusable, open_usable

    s = make(tmp_path)
    with pytest.raises(Unusable) as e:
        open_usable(s)
    assert needle in str(e.value) and str(s) in str(e.value)
    score = _one_error_line(_gpuwatch("score", str(s), "--stride", "50"), needle)
    train = _one_error_line(_gpuwatch("train", str(s), "--no-eval", "-o", str(tmp_path / "m.joblib")), needle)
    assert score == train == f"gpuwatch: error: {e.value}"
    assert not (tmp_path / "m.joblib").exists()


def test_a_session_of_no_workload_needs_no_steps(tmp_path):
    """`watch`/`record` sessions have no steps to miss: usable (the samples are all there is)."""
    from gpuwatch.predict.usable import open_usable

    s = _no_steps(_copy(ALONE, tmp_path / "watched"))
    meta = json.loads((s / "meta.json").read_text())
    meta["config"]["workloads"] = []
    (s / "meta.json").write_text(json.dumps(meta))
    assert open_usable(s).gpus


def test_counterfactual_copies_read_the_tables_as_the_reader_does(tmp_path):
    """A renamed column reads as a missing one (null), as replay reads it: relabeling copes (the KeyError
    'batch' of defect 1); validate leaves out a session whose meta.json is a list (its AttributeError)."""
    from gpuwatch.predict import counterfactual as CF

    ren = _steps_renamed(_copy(CAPPED, tmp_path / "renamed"))
    copies = CF.derive(ren, tmp_path / "cf", "ramp-train")
    assert copies and any(c.virtual_oom for c in copies)
    lst = _meta_list(_copy(ALONE, tmp_path / "list"))
    assert CF.validate([lst, ren])["capped_sessions"] == 1


def test_counterfactual_copies_held_in_memory_cut_into_the_same_timelines_as_written_ones(tmp_path):
    """Issue 31 (3): training no longer writes each counterfactual copy as a session folder and reads it back;
    the copies are held in memory (`derive_sources`). Every copy's timelines - names, labels, features of every
    window, weights - are the same as the written copy's, on a capped session with virtual OOMs, a guarded one
    and a leak (copies of each, at each cap `derive` picks)."""
    import numpy as np

    from gpuwatch.predict import counterfactual as CF
    from gpuwatch.predict.dataset import session_timelines

    sessions = [CAPPED, CAPPED.parent / "sample-h200-guard-fragment", CAPPED.parent / "sample-h200-leak-oom"]
    n = 0
    for src in sessions:
        written = CF.derive(src, tmp_path / src.name, "x")
        held = CF.derive_sources(src, "x")
        assert [r.cap_bytes for r in written] == [r.cap_bytes for r, _ in held] and written
        for r, (h, copy) in zip(written, held):
            assert (r.virtual_oom, r.oom_step, r.source) == (h.virtual_oom, h.oom_step, h.source)
            a = session_timelines(r.path, stride=3, sample=True)
            b = session_timelines(copy, stride=3, sample=True)
            assert len(a) == len(b) == 1
            for x, y in zip(a, b):
                assert (x.session, x.scenario, x.gpu, x.source, x.derived) == (y.session, y.scenario, y.gpu, y.source, y.derived)
                for f in ("ts_us", "X", "y", "w", "inf", "failures", "warn_end", "step_ts"):
                    assert np.array_equal(getattr(x, f), getattr(y, f), equal_nan=True), (r.path.name, f)
                assert x.meta == y.meta
            n += 1
    assert n >= 6


# -- defect 13: compact of a bad meta.json; train of a symbolic link loop ------------------------------------
@pytest.mark.parametrize("text,needle", [("[]", "meta.json: not a JSON object (a list)"),
                                         ('{"schema_version": 99}', "meta.json: schema version 99")])
def test_compact_of_a_bad_meta_json_is_an_error_and_changes_nothing(tmp_path, capsys, text, needle):
    from gpuwatch.cli import main

    s = _copy(ALONE, tmp_path / "s")
    (s / "meta.json").write_text(text)
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in s.iterdir()}
    assert main(["compact", str(s)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and "already compact" not in err, err
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in s.iterdir()} == before


def test_a_symbolic_link_loop_is_said_so_by_train_compact_and_score(tmp_path, capsys):
    from gpuwatch.cli import main

    loop = tmp_path / "loop"
    os.symlink(loop.name, loop)  # points at itself
    for argv in (["train", str(loop), "--no-eval", "-o", str(tmp_path / "m.joblib")], ["compact", str(loop)],
                 ["score", str(loop)], ["replay", str(loop)]):
        assert main(argv) != 0, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{loop}: symbolic link loop" in err, (argv, err)
    assert not (tmp_path / "m.joblib").exists()


# -- issue 31 (1): the fits run with the threads they were given -------------------------------------------
_SPY = """
import json, sys
from pathlib import Path
from gpuwatch.predict import train as T
assert "sklearn" not in sys.modules  # as in `gpuwatch train`: scikit-learn is first imported by the fit
seen = []
make = T.make_estimator
class Spy:
    def __init__(self, est):
        self.est, self.steps = est, getattr(est, "steps", None)
    def fit(self, X, y, **kw):
        from threadpoolctl import threadpool_info
        seen.append(sorted({i["num_threads"] for i in threadpool_info() if i["user_api"] == "openmp"}))
        self.est.fit(X, y, **kw)
        return self
    def predict_proba(self, X):
        return self.est.predict_proba(X)
T.make_estimator = lambda *a, **k: Spy(make(*a, **k))
kw = json.loads(sys.argv[3])
T.train([Path(sys.argv[1])], Path(sys.argv[2]), progress=lambda m: None, stride=20, evaluate=False, **kw)
print(json.dumps(seen))
"""


def _threads_in_fit(tmp_path, **kw) -> list[list[int]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OMP_NUM_THREADS", None)
    r = subprocess.run([sys.executable, "-c", _SPY, str(CAPPED), str(tmp_path / "m.joblib"), json.dumps(kw)],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_fit_runs_with_the_threads_it_was_given(tmp_path):
    """threadpoolctl limits only the OpenMP runtimes already loaded: scikit-learn's libgomp, first loaded by
    the fit, ran every fit with all the cores (issue 31 item 1). The default is 2 (train.FIT_THREADS: the
    shipped model's bytes; one thread gives other bits)."""
    from gpuwatch.predict.train import FIT_THREADS

    assert FIT_THREADS == 2 and _threads_in_fit(tmp_path) == [[FIT_THREADS]]
    assert _threads_in_fit(tmp_path, threads=1) == [[1]]
    assert _threads_in_fit(tmp_path, threads=3) == [[3]]


# -- issue 31 (2): --jobs N, the same model bytes for any N --------------------------------------------------
LEAK = ROOT / "recordings" / "sample-h200-leak-oom"


def test_jobs_and_a_dask_cluster_give_the_same_model_bytes_and_figures(tmp_path):
    """Sessions cut into windows and the cross-validation folds fit in N processes, or on a local Dask
    cluster of two workers (issue 31 item 5: joblib's Dask backend): results in order, the same model file
    byte for byte, the same card figures and progress lines as one process."""
    pytest.importorskip("dask.distributed", reason="the test extra installs dask[distributed]")
    from gpuwatch.predict.train import train

    runs = {}
    for name, how in (("one", {"jobs": 1}), ("two", {"jobs": 2}), ("dask", {"dask": "local:2"})):
        said: list[str] = []
        rep = train([CAPPED, ALONE, LEAK], tmp_path / name / "m.joblib", progress=said.append, stride=20, **how)
        runs[name] = (hashlib.sha256(rep.model_path.read_bytes()).hexdigest(), rep.by_session.row(),
                      rep.by_scenario.row(), rep.operating_point, [m for m in said if not m.startswith("wrote")])
    assert runs["one"] == runs["two"] == runs["dask"]
    assert any("fold 3/3" in m for m in runs["one"][4])


# -- issue 31 (4): sessions found under folders, filtered by what meta.json says --------------------------------
def _meta_edit(d: Path, **change) -> Path:
    meta = json.loads((d / "meta.json").read_text())
    meta.update(change)
    (d / "meta.json").write_text(json.dumps(meta))
    return d


@pytest.fixture
def tree(tmp_path):
    """root/a/capped (ramp-train, host h1, 2026-11-30), root/b/c/alone (nearcap-prefill, host h2,
    2026-12-02), root/b/cpu (CPU-only), root/notes (no session), root/b/c/alone/sub (never searched)."""
    root = tmp_path / "root"
    _meta_edit(_copy(CAPPED, root / "a" / "capped"), host="h1", start="2026-11-30T10:58:15+00:00")
    alone = _meta_edit(_copy(ALONE, root / "b" / "c" / "alone"), host="h2", start="2026-12-02T17:32:19+00:00")
    _copy(ALONE, alone / "sub")  # inside a session: not another one
    _copy(CPU, root / "b" / "cpu")
    (root / "notes").mkdir()
    (root / "notes" / "README.md").write_text("no session here")
    return root


def test_sessions_are_found_under_folders_in_order(tree):
    from gpuwatch.predict.dataset import Filters, find_sessions

    found = find_sessions([tree], Filters())
    assert found.sessions == [tree / "a" / "capped", tree / "b" / "c" / "alone", tree / "b" / "cpu"]
    assert found.named == []
    named = find_sessions([tree / "b" / "c" / "alone", tree], Filters())  # named first, then found, once each
    assert named.sessions == [tree / "b" / "c" / "alone", tree / "a" / "capped", tree / "b" / "cpu"]
    assert named.named == [tree / "b" / "c" / "alone"]


@pytest.mark.parametrize("filters,want", [
    (dict(host=["h1"]), ["capped"]),
    (dict(host=["h*"]), ["capped", "alone"]),
    (dict(scenario=["nearcap-*"]), ["alone"]),
    (dict(scenario=["ramp-train", "steady-train"]), ["capped", "cpu"]),
    (dict(since="2026-12-01"), ["alone", "cpu"]),
    (dict(until="2026-11-30"), ["capped"]),  # a bare date: through that day
    (dict(since="2026-11-30T11:00:00", until="2026-12-02T00:00:00Z"), ["cpu"]),
])
def test_filters_from_meta_json(tree, filters, want):
    from gpuwatch.cli.parser import parse_when
    from gpuwatch.predict.dataset import Filters, find_sessions

    kw = {k: (parse_when(v, end=k == "until") if k in ("since", "until") else v) for k, v in filters.items()}
    found = find_sessions([tree], Filters(**kw))
    assert [p.name for p in found.sessions] == want
    assert any("left out by the filters" in m for m in found.said)


def test_train_of_a_folder_skips_what_is_unusable_and_names_it(tree, tmp_path):
    r = _gpuwatch("train", str(tree), "--stride", "20", "--no-eval", "--jobs", "2", "-o", str(tmp_path / "m.joblib"))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    skipped = [ln for ln in r.stderr.splitlines() if "skipped:" in ln]
    assert len(skipped) == 1 and "cpu" in skipped[0] and "no GPU in its samples" in skipped[0], r.stderr
    man = json.loads((tmp_path / "m.manifest.json").read_text())
    assert man["training_sessions"] == ["alone", "capped"]


@pytest.mark.parametrize("args,needle", [
    (["--host", "nowhere"], "no session matches the filters"),
    (["--since", "yesterday"], "--since: not a date or time"),
])
def test_train_of_a_folder_with_nothing_to_train_on_is_one_line(tree, tmp_path, args, needle):
    r = _gpuwatch("train", str(tree), *args, "-o", str(tmp_path / "m.joblib"))
    assert r.returncode == 2 and "Traceback" not in r.stderr and needle in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = _gpuwatch("train", str(tree / "notes"), "-o", str(tmp_path / "m.joblib"))
    assert r.returncode == 2 and "no session under it" in r.stderr, r.stderr
    assert not (tmp_path / "m.joblib").exists()


def test_a_counterfactual_copy_clips_the_allocator_figures_and_keeps_their_nulls(tmp_path):
    """The v6/v7 figures of a real session (one of the shipped capped ramps, the columns written in: half the
    steps read the blocks, as `mechanics.blocks` does every 0.5 s) under a virtual cap: none exceeds what the
    clipped cache (or reserve) holds, and a step with no figure keeps none (a null filled with the cache would
    say a fragmentation the run never had)."""
    from gpuwatch.predict import counterfactual as C

    meta, t = C._read(CAPPED)  # noqa: SLF001 - the tables as relabel reads them
    st = t["steps"]
    n = st.height
    big = pl.Series([None if i % 2 else 2**62 for i in range(n)], dtype=pl.UInt64)
    t = {**t, "steps": st.with_columns(torch_inactive_split_bytes=big, torch_largest_free_bytes=big,
                                       torch_largest_segment_bytes=big)}
    t["steps"] = t["steps"].with_columns(pl.when(pl.int_range(pl.len()) == 0).then(None)
                                         .otherwise(pl.col("torch_reserved_bytes")).alias("torch_reserved_bytes"))
    cap = int(st["torch_peak_bytes"].max() * 0.9)
    _r, _meta, out = C.relabeled(meta, t, cap, tmp_path / "copy", str(CAPPED))
    s = out["steps"]
    cache = (s["torch_reserved_bytes"].cast(pl.Int64) - s["torch_allocated_bytes"].cast(pl.Int64)).clip(0)
    for c, bound in (("torch_inactive_split_bytes", cache), ("torch_largest_free_bytes", cache),
                     ("torch_largest_segment_bytes", s["torch_reserved_bytes"].cast(pl.Int64))):
        v = s[c].cast(pl.Int64)
        assert (v.is_null() == pl.Series([bool(i % 2) for i in range(s.height)])).all(), c
        ok = v.drop_nulls() <= bound.filter(v.is_not_null())
        assert ok.all() and v.drop_nulls().len() > 0, c
    assert s["torch_reserved_bytes"].max() <= cap and s["torch_reserved_bytes"][0] is None  # not filled with the cap
