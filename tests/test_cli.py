"""The command line as a user meets it: one-line errors, exit codes, headless recording."""

from __future__ import annotations

import subprocess

import pytest

from gpuwatch.recording.reader import open_recording

from conftest import RAMP, ROOT


def run(py, env, *args, timeout=120):
    return subprocess.run([py, "-m", "gpuwatch", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("args, needle", [
    (["record", "--interval", "fast"], "bad duration 'fast'"),
    (["record", "--interval", "1ms"], "out of range"),
    (["record", "--duration", "0s"], "must be > 0"),
    (["record", "--bogus"], "unrecognized arguments: --bogus"),
    (["record", "--gpus", "0,x"], "not a list of GPU indices like 0,2: '0,x'"),
    (["watch", "--gpus", "-1"], "a GPU index is >= 0: '-1'"),
    (["stress", "--mode", "nope"], "invalid choice: 'nope'"),
    (["stress", "--batch", "0"], "must be > 0"),
    (["stress", "--gpu-memory-limit", "lots"], "bad size 'lots'"),
    (["stress", "--set", "oops"], "bad --set 'oops'"),
    (["stress", "--preset", "tiny", "--no-record", "--set", "n_routed_experts=4", "--set", "num_experts_per_tok=8"],
     "num_experts_per_tok (8) must be at most n_routed_experts (4)"),
    (["stress", "--device", "cuda:7", "--steps", "1", "--no-record"], "--device cuda:7"),
    (["stress", "--gpus", "all", "--no-record"], "--gpus"),
    (["nonsense"], "invalid choice: 'nonsense'"),
    (["stress", "--new-tokens", "0"], "must be > 0"),
    (["stress", "--guard-plan", "maybe"], "invalid choice: 'maybe'"),
    (["stress", "--mode", "train", "--new-tokens", "8", "--no-record"], "--new-tokens is for --mode decode"),
    (["stress", "--preset", "tiny", "--device", "cpu", "--mode", "decode", "--new-tokens", "20000", "--no-record",
      "--no-model"], "longer than tiny's max_position_embeddings (4096)"),
    (["compact"], "the following arguments are required: session"),
    (["report", "--bogus", "x"], "error: unrecognized arguments: --bogus"),  # not "gpuwatch: error: gpuwatch: ..."
])
def test_bad_flags_one_line_exit_2(py, env, args, needle):
    r = run(py, env, *args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("gpuwatch: error:"), r.stderr
    assert "Traceback" not in r.stderr


def test_info_without_a_gpu_says_so_once(py, env):
    r = run(py, env, "info")
    assert r.returncode == 0
    assert r.stdout.count("CPU-only") == 1 or "GPU(s)" in r.stdout


def test_record_headless_from_a_replayed_source(py, env, tmp_path):
    r = run(py, env, "record", "--duration", "2s", "--source", str(RAMP), "-o", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "REPLAY" in r.stderr  # a replayed source is labelled as such
    session = next(tmp_path.iterdir())
    rec = open_recording(session)
    assert rec.complete and 15 <= rec.samples.height <= 25
    assert rec.meta["gpu_note"].endswith("(not live)")
    assert rec.samples["sampler_interval_us"].drop_nulls().median() == pytest.approx(100_000, rel=0.05)


@pytest.mark.parametrize("sampler", ["process", "thread"])
def test_record_of_a_gpu_that_is_not_there_is_one_line_exit_2(py, env, tmp_path, sampler):
    """Whether GPU 3 exists is known once the backend opens (for the process sampler: in its child), still
    a user error in one line, and nothing is recorded."""
    r = run(py, env, "record", "--gpus", "0,3", "--sampler", sampler, "--source", str(RAMP), "--no-model",
            "--duration", "1s", "-o", str(tmp_path))
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == "gpuwatch: error: no GPU 3 here (GPU indices present: 0)"
    assert list(tmp_path.iterdir()) == []


def test_record_into_an_unwritable_place_fails_cleanly(py, env, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = run(py, env, "record", "--duration", "1s", "-o", str(blocker / "sub"))
    assert r.returncode == 2  # checked before anything starts: a user error, one line
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Not a directory" in lines[0] and "Traceback" not in r.stderr
    assert r.stdout == "" and not (tmp_path / "file" / "sub").exists()


def test_replay_of_a_bad_file_is_one_line(py, env, tmp_path):
    bad = tmp_path / "x.parquet"
    bad.write_text("nope")
    r = run(py, env, "replay", str(bad))
    assert r.returncode == 1
    assert r.stderr.strip() == f"gpuwatch: error: {bad}: not a Parquet file"


def test_stress_headless_on_the_cpu(py, env, tmp_path):
    r = run(py, env, "stress", "--preset", "tiny", "--schedule", "sweep", "--max-batch", "4", "--seq-len", "16",
            "-o", str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stderr
    assert "tiny prefill on CPU: finished, 18 steps" in r.stdout
    assert "batch  seq  latency_s  tokens/s" in r.stdout
    rec = open_recording(next(tmp_path.iterdir()))
    assert rec.steps["batch"].to_list() == [1] * 6 + [2] * 6 + [4] * 6
    assert rec.meta["config"]["workloads"][0]["preset"] == "tiny"


def test_stress_exit_code_is_1_when_a_failure_was_not_recovered(py, env):
    # every step fails the same way (an impossible config, the old way to get here, is now refused up front)
    r = subprocess.run([py, str(ROOT / "tests" / "support" / "failing_step.py"), "stress", "--preset", "tiny",
                        "--steps", "3", "--no-record"], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=300, stdin=subprocess.DEVNULL)
    assert r.returncode == 1
    assert "UNRECOVERED" in r.stdout and "Traceback" not in r.stderr


@pytest.mark.parametrize("flag,plan,label", [([], True, "model"), (["--guard-plan", "off"], False, "model-thresholds"),
                                             (["--guard-plan", "off", "--guard-rule", "fixed"], False, "fixed")])
def test_guard_plan_flag_reaches_the_guard(flag, plan, label, tmp_path):
    """`--guard-plan off` keeps the guard to the risk threshold and its timer (issue 28's comparison arm):
    the flag reaches GuardConfig, and the panels name the rule so a replay says which one ran."""
    from gpuwatch.cli.configs import session_config
    from gpuwatch.cli.parser import build_parser

    args = build_parser().parse_args(["stress", "--preset", "tiny", "--device", "cpu", "-o", str(tmp_path), *flag])
    g = session_config(args, workload=True).guard
    assert g.plan is plan and g.label == label


def test_record_no_record_is_refused(capsys):
    """Issue 17 (14): `record --no-record` was accepted and did nothing."""
    from gpuwatch.cli import main

    assert main(["record", "--no-record", "--duration", "1s"]) == 2
    assert "--no-record" in capsys.readouterr().err


def test_score_warns_when_steps_are_missing(tmp_path, capsys):
    """Issue 17 (5): `score` of a folder holding only samples.parquet gave fewer alarms, no warning. Since
    defect 11 (predict/usable.py, the rule `train` applies too): a session that ran a workload without its
    steps table is refused in one line; one file alone is scored from what it holds, with a warning."""
    import shutil

    from gpuwatch.cli import main
    from conftest import RAMP

    shutil.copy(RAMP / "samples.parquet", tmp_path / "samples.parquet")
    shutil.copy(RAMP / "meta.json", tmp_path / "meta.json")
    assert main(["score", str(tmp_path), "--stride", "20"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error" in err and "no steps table" in err, err
    assert main(["score", str(tmp_path / "samples.parquet"), "--stride", "20"]) == 0
    err = capsys.readouterr().err
    assert "warning" in err and "no steps" in err, err


def test_score_of_nothing_scored_says_dash_not_none(tmp_path, capsys, monkeypatch):
    """Issue 17 (12): `max risk None`."""
    from gpuwatch import cli
    from gpuwatch.predict import scorer
    from gpuwatch.recording import schema
    from conftest import RAMP

    monkeypatch.setattr(scorer, "score_source", lambda *a, **k: schema.empty("risk"))
    assert cli.main(["score", str(RAMP)]) == 0
    out = capsys.readouterr().out
    assert "max risk -" in out and "None" not in out, out


def test_busy_prometheus_port_is_refused_before_anything_is_written(tmp_path, capsys):
    """Issue 17 (6): a busy port left a session folder with only meta.json and the lock behind."""
    import socket

    from gpuwatch.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["record", "--duration", "1s", "--prometheus", str(port), "-o", str(tmp_path / "rec")]) == 2
    assert "already in use" in capsys.readouterr().err
    assert not (tmp_path / "rec").exists() or not any((tmp_path / "rec").iterdir())


def test_prometheus_on_every_interface_warns(capsys):
    """Issue 17 (6): `--prometheus 0.0.0.0:PORT` printed http://127.0.0.1:PORT and said nothing."""
    from gpuwatch.cli.configs import check_prometheus

    check_prometheus("0.0.0.0", 0)
    assert "every interface" in capsys.readouterr().err
    check_prometheus("127.0.0.1", 0)
    assert capsys.readouterr().err == ""


def test_gpu_memory_limit_on_the_cpu_is_refused(capsys):
    """Issue 17 (14): `--gpu-memory-limit 999TiB` on a CPU was accepted silently."""
    pytest.importorskip("torch")
    from gpuwatch.errors import UsageError
    from gpuwatch.telemetry.bus import Bus
    from gpuwatch.workload.factory import WorkloadSpec, make_workloads

    with pytest.raises(UsageError, match="gpu-memory-limit"):
        make_workloads(WorkloadSpec(preset="tiny", device="cpu", memory_limit_bytes=999 * 2**40), Bus())


def test_compact_of_a_truncated_compacted_session_is_an_error(tmp_path, capsys):
    """Issue 17 (14): `compact` of a truncated compacted file said "already compact", exit 0."""
    import shutil

    from gpuwatch.cli import main

    s = tmp_path / "s"
    shutil.copytree(RAMP, s)
    data = (s / "samples.parquet").read_bytes()
    (s / "samples.parquet").write_bytes(data[: len(data) // 2])
    assert main(["compact", str(s)]) == 1
    err = capsys.readouterr().err
    assert "samples.parquet" in err and "already compact;" not in err, err
    shutil.copy(RAMP / "samples.parquet", s / "samples.parquet")
    assert main(["compact", str(s)]) == 0 and "already compact" in capsys.readouterr().err


def test_a_run_whose_every_step_ran_out_of_memory_fails(capsys):
    """Issue 17 (10): `stress --preset tiny --batch 1000000000` on a CPU logged "CUDA OOM" nine times, ran 0
    steps and exited 0. (The real run is not repeated here: it grows to 11 GB of RSS.)"""
    from types import SimpleNamespace

    from gpuwatch.ci import finish as _finish
    from gpuwatch.runtime import session_status
    from gpuwatch.telemetry.bus import Bus

    def workload(ooms: int, step: int):
        return SimpleNamespace(
            cfg=SimpleNamespace(preset="tiny", mode="prefill", gpu_index=None, schedule="steady"),
            device_name="cpu", state="stopped", ooms=ooms, recovered=ooms, nonfinite=0, integrity_failures=0,
            unrecovered=None, manual=False, schedule=SimpleNamespace(edges=[], oom_levels=None),
            export_state=lambda: {"step": step}, describe=lambda: {"preset": "tiny", "mode": "prefill", "gpu_index": None})

    def session(w):
        return SimpleNamespace(workloads=[w], bus=Bus(), status=lambda: session_status("no risk model", workloads=[w]))

    assert _finish(session(workload(9, 0)), "deadline") == 1
    assert "no step completed (9 OOM(s))" in capsys.readouterr().out
    assert _finish(session(workload(0, 0)), "deadline") == 0  # built too slowly for a short --duration: no failure
    assert _finish(session(workload(9, 0)), "SIGTERM") == 143


def test_eval_with_no_usable_session_is_an_error(py, env, tmp_path):
    """A new user's `gpuwatch eval bad/trunc`: a warning that the session was skipped, no figures, and exit 0.
    Nothing to evaluate is an error: the warning, then one error line, exit 2."""
    r = run(py, env, "eval", str(tmp_path / "nonexistent"))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert "skipped" in lines[0] and lines[-1].startswith("gpuwatch: error: no usable session"), r.stderr
    assert "Traceback" not in r.stderr
