"""`gpuwatch stress` as a CI job: progress lines, --summary-json, --junit, --fail-on, --resume.

The runs that need a workload start together in one module fixture (each pays ~6-8 s importing torch,
so they overlap): a CI run on the CPU with a replayed H200 as its GPU telemetry (so the health rows have
data and a threshold can fail), a failing run without recording, and an interrupted run that is then
resumed. Everything else is in-process and fast.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from gpuwatch import ci
from gpuwatch.cli import main
from gpuwatch.errors import UsageError
from gpuwatch.recording.reader import open_recording
from gpuwatch.runtime import session_status
from gpuwatch.waiting import wait_until
from gpuwatch.workload.schedule import Schedule

from conftest import ROOT, SWEEP

CPU = ["--preset", "tiny", "--device", "cpu", "--no-model"]


def _popen(py, env, *args, cwd=None):
    return subprocess.Popen([py, "-m", "gpuwatch", "stress", *args], env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, text: str, timeout: float = 90) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.1)
    raise AssertionError(f"{text!r} never appeared in {path}: {path.read_text() if path.exists() else ''}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, py_env):
    py, env = py_env
    tmp = tmp_path_factory.mktemp("ci")
    out = {"tmp": tmp}
    # 1. a CI run: replayed H200 telemetry (throttled by its power cap 90 % of the time), tiny workload
    ci_run = _popen(py, env, *CPU, "--duration", "2.5s", "--integrity-every", "1", "--progress", "1s",
                    "--source", str(SWEEP), "-o", str(tmp / "rec"), "--summary-json", str(tmp / "s.json"),
                    "--junit", str(tmp / "j.xml"), "--fail-on", "throttled>0.05,temp_margin<5")
    # 2. an unrecovered failure, no recording
    from conftest import ROOT

    bad = subprocess.Popen([py, str(ROOT / "tests" / "support" / "failing_step.py"), "stress", *CPU, "--steps", "3",
                            "--no-record", "--summary-json", str(tmp / "bad.json"), "--junit", str(tmp / "bad.xml")],
                           env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # 3. an interrupted run (SIGTERM after its first progress line), then resumed
    err = tmp / "part1.err"
    with open(err, "w") as fh:
        part1 = subprocess.Popen([py, "-m", "gpuwatch", "stress", *CPU, "--schedule", "ramp", "--batch", "8",
                                  "--duration", "3s", "--progress", "1s", "-o", str(tmp / "res")],
                                 env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=fh)
        _wait_for(err, "| step ")
        part1.send_signal(signal.SIGTERM)
        out["part1_rc"] = part1.wait(60)
    session = next((tmp / "res").iterdir())
    out["part1_steps"] = open_recording(session).steps["step"].to_list()
    out["session"] = session
    part2 = _popen(py, env, "--resume", str(session), "--duration", "5s", "--progress", "1s", "--no-model",
                   "--summary-json", str(tmp / "res.json"))
    for name, p in (("ci", ci_run), ("bad", bad), ("resume", part2)):
        so, se = p.communicate(timeout=120)
        out[name] = (p.returncode, so, se)
    return out


@pytest.fixture(scope="module")
def py_env():
    import os
    import sys

    from conftest import ROOT

    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e["PYTHONUNBUFFERED"] = "1"
    return sys.executable, e


# -- the CI run ----------------------------------------------------------------------------------------
def test_progress_lines_on_stderr(runs):
    rc, so, se = runs["ci"]
    lines = [ln for ln in se.splitlines() if "| step " in ln]
    assert len(lines) >= 1, se
    assert "/0:00:02" in lines[0] and "tok/s" in lines[0] and "OOM 0 (0 recovered)" in lines[0] and "rows" in lines[0]
    assert "| step " not in so  # progress goes to stderr, the summary to stdout


def test_threshold_failure_exits_1_with_junit_and_summary(runs):
    rc, so, se = runs["ci"]
    assert rc == 1, se
    assert "health: Throttling" in so and "FAIL" in so and "Traceback" not in se
    s = json.loads((runs["tmp"] / "s.json").read_text())
    assert s["exit"]["code"] == 1 and any("Throttling" in w for w in s["exit"]["why"])
    assert s["thresholds"] == {"throttled": 0.05, "temp_margin": 5.0}
    assert s["workloads"][0]["preset"] == "tiny" and s["workloads"][0]["steps"] >= 1
    assert s["recording"]["complete"] is True and s["recording"]["rows"] > 0
    rows = {r["name"]: r for r in s["health"]["rows"]}
    assert rows["Throttling"]["verdict"] == "FAIL" and rows["Throttling"]["enforced"]
    assert rows["Temperature"]["verdict"] == "pass" and rows["Temperature"]["threshold"] == 84.0
    assert rows["Compute (TFLOP/s vs peak)"]["verdict"] == "no data (not enforced)"  # no MFU on a CPU
    root = ET.parse(runs["tmp"] / "j.xml").getroot()
    suites = root.findall("testsuite")
    assert len(suites) == 1 and suites[0].get("name") == "gpuwatch stress"
    cases = {c.get("name"): c for c in suites[0].findall("testcase")}
    assert cases["no unrecovered failure (tiny prefill on CPU)"].find("failure") is None
    assert cases["integrity checks (tiny prefill on CPU)"].find("failure") is None
    assert cases["integrity checks (tiny prefill on CPU)"].find("skipped") is None
    assert cases["health: Throttling"].find("failure") is not None
    assert "needs <= 5.0 %" in cases["health: Throttling"].find("failure").get("message")
    assert cases["health: Compute (TFLOP/s vs peak)"].find("skipped") is not None
    assert cases["health: Temperature"].find("failure") is None
    assert suites[0].get("failures") == "1" and int(suites[0].get("tests")) == len(cases) == 8


def test_unrecovered_failure_without_recording(runs):
    rc, so, se = runs["bad"]
    assert rc == 1 and "UNRECOVERED" in so and "Traceback" not in se
    assert "health: not recorded (--no-record): health checks skipped" in so
    s = json.loads((runs["tmp"] / "bad.json").read_text())
    assert s["exit"]["code"] == 1 and s["health"]["checked"] is False and s["recording"] is None
    cases = {c.get("name"): c for c in ET.parse(runs["tmp"] / "bad.xml").getroot().iter("testcase")}
    assert cases["no unrecovered failure (tiny prefill on CPU)"].find("failure") is not None
    assert cases["health checks"].find("skipped") is not None
    assert not any(n.startswith("health:") for n in cases)


# -- resume --------------------------------------------------------------------------------------------
def test_resume_continues_the_interrupted_session(runs):
    assert runs["part1_rc"] == 143
    rc, so, se = runs["resume"]
    assert rc == 0, se
    assert "resuming" in se and "(closed cleanly)" in se
    rec = open_recording(runs["session"])
    steps = rec.steps["step"].to_list()
    first = runs["part1_steps"]
    assert first and steps[: len(first)] == first
    assert steps == list(range(len(steps))) and len(steps) > len(first)  # increasing, no gap, no duplicate
    # the resumed sampler numbers its ticks on from the last one: (tick, gpu) stays unique in the session
    assert rec.samples.select("tick", "gpu").is_unique().all()
    assert rec.samples.sort("ts")["tick"].is_sorted()
    kinds = rec.events["kind"].to_list()
    assert kinds.count("session_resumed") == 1 and kinds.count("session_start") == 2
    assert rec.meta["complete"] is True and len(rec.meta["resumed"]) == 1
    after = rec.meta["resumed"][0]["after_s"]
    assert 0.5 < after < 4.0  # SIGTERM'd after >= 1 s of its 3 s (stopping takes a moment)
    # the ramp goes on where it was: batches never drop back to the ramp's start at the resume
    batches = rec.steps["batch"].to_list()
    assert batches == sorted(batches) and batches[len(first)] >= batches[len(first) - 1]
    s = json.loads((runs["tmp"] / "res.json").read_text())
    assert s["resumed"] is True and 4.5 <= s["elapsed_s"] <= 6.5
    assert s["this_run_s"] < 5.0 - after + 1.0  # the earlier part's time counted against --duration
    assert s["workloads"][0]["steps"] == len(steps)  # the summary covers the whole session
    assert not rec.warnings


def test_resume_refuses_what_is_not_a_stress_session(tmp_path, capsys):
    assert main(["stress", "--resume", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not a gpuwatch session folder" in err
    (tmp_path / "meta.json").write_text(json.dumps({"schema_version": 2, "config": {"workloads": []},
                                                   "argv": ["gpuwatch", "record"]}))
    assert main(["stress", "--resume", str(tmp_path)]) == 2
    assert "ran no workload" in capsys.readouterr().err
    assert main(["stress", "--resume", str(tmp_path), "--no-record"]) == 2
    assert "drop --no-record" in capsys.readouterr().err


def test_resume_refuses_contradicting_flags(runs, capsys):
    assert main(["stress", "--resume", str(runs["session"]), "--preset", "small"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--preset small contradicts the recorded run (--preset tiny)" in err
    assert main(["stress", "--resume", str(runs["session"]), "--schedule", "sweep"]) == 2
    assert "--schedule sweep contradicts" in capsys.readouterr().err


# -- --fail-on parsing (strict, one line, exit 2) ------------------------------------------------------
def test_fail_on_parses():
    assert ci.parse_fail_on("util<85,mfu<0.6,temp_margin<5,throttled>0.05,mem_peak>0.95") == {
        "util": 85.0, "mfu": 0.6, "temp_margin": 5.0, "throttled": 0.05, "mem_peak": 0.95}
    assert ci.parse_fail_on(" mfu < 60% ") == {"mfu": 0.6}
    assert ci.merge_fail_on([{"util": 80.0}, {"mfu": 0.5}]) == {"util": 80.0, "mfu": 0.5}


@pytest.mark.parametrize("bad, why", [
    ("util>85", "util fails below a value"), ("speed<3", "unknown check 'speed'"), ("util<", "bad item"),
    ("mfu<1.5", "out of range"), ("util<85,util<90", "util given twice"), ("util<nan", "bad item"),
    ("", "bad item"), ("throttled>-1", "bad item"),
])
def test_bad_fail_on_is_one_line_exit_2(bad, why, capsys):
    with pytest.raises(UsageError, match=why):
        ci.parse_fail_on(bad)
    assert main(["stress", "--fail-on", bad, "--no-record"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and why in err and err.startswith("gpuwatch: error:")


def test_bad_fail_on_in_a_subprocess(py_env):
    py, env = py_env
    r = subprocess.run([py, "-m", "gpuwatch", "stress", "--fail-on", "util>85"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "util fails below" in r.stderr


def test_fail_on_needs_a_recording_and_outputs_need_a_folder(tmp_path, capsys):
    assert main(["stress", "--fail-on", "util<80", "--no-record"]) == 2
    assert "needs the recording" in capsys.readouterr().err
    assert main(["stress", "--junit", str(tmp_path / "nope" / "j.xml"), "--no-record"]) == 2
    assert "no folder" in capsys.readouterr().err


# -- the threshold logic on a shipped H200 recording ----------------------------------------------------
def test_thresholds_on_a_shipped_recording():
    rec = open_recording(SWEEP)
    rows = {r["name"]: r for r in ci.health_rows(rec, {})}
    assert all(r["verdict"] not in ("FAIL", "FAIL (no data)") for r in rows.values())  # nothing given: never failing
    assert rows["Throttling"]["status"] == "fail"  # ... though the report's default says fail
    assert rows["Throttling"]["verdict"] == "FAIL (not enforced)"  # and it says so
    rows = {r["name"]: r for r in ci.health_rows(rec, {"util": 90, "mfu": 0.2, "throttled": 0.95, "temp_margin": 30})}
    assert rows["GPU utilization"]["verdict"] == "pass"  # 94.9 % > 90
    assert rows["Compute (TFLOP/s vs peak)"]["verdict"] == "pass"  # 25 % >= 20 %
    assert rows["Throttling"]["verdict"] == "pass"  # 90 % <= 95 %
    assert rows["Temperature"]["verdict"] == "FAIL" and rows["Temperature"]["threshold"] == 59.0  # 67 °C, 89 - 30
    rows = {r["name"]: r for r in ci.health_rows(rec, {"util": 96, "mem_peak": 0.3})}
    assert rows["GPU utilization"]["verdict"] == "FAIL" and rows["Memory (peak vs limit)"]["verdict"] == "FAIL"


def test_junit_shape_of_a_summary():
    summary = {"this_run_s": 1.0, "session": None, "stopped_by": "done", "elapsed_s": 1.0, "duration_s": None,
               "resumed": False, "exit": {"code": 1, "why": ["x"]},
               "checks": [{"name": "a", "status": "pass", "message": "ok"},
                          {"name": "b", "status": "fail", "message": "bad <&> value"},
                          {"name": "c", "status": "skipped", "message": "no data"}]}
    root = ET.fromstring(ci.junit_xml(summary).split("\n", 1)[1])
    suite = root.find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("3", "1", "1")
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == ["a", "b", "c"]
    assert cases[1].find("failure").get("message") == "bad <&> value" and cases[2].find("skipped") is not None


# -- pieces ----------------------------------------------------------------------------------------------
def test_schedule_state_restores_and_replays():
    live = Schedule("ramp", 8, 64, max_batch=40)
    hist = []
    for i in range(40):
        if i == 13:
            live.hold(5)
            hist.append(("hold", 5))
        if i == 20:
            b = live.plan()[0]
            live.oom(b)
            hist.append(("oom", b))
        live.done()
        hist.append(("done",))
    again = Schedule("ramp", 8, 64, max_batch=40)
    again.replay(hist)
    assert again.state() == live.state()
    copy = Schedule("ramp", 8, 64, max_batch=40)
    copy.restore(live.state())
    assert copy.state() == live.state() and copy.plan() == live.plan()
    with pytest.raises(ValueError):
        Schedule("sweep", 8, 64).restore(live.state())


def test_wait_until_ticks_and_still_ends():
    ticks = []
    t0 = time.monotonic()
    why = wait_until(t0 + 0.35, on_tick=lambda: ticks.append(time.monotonic() - t0), tick_s=0.1)
    assert why == "deadline" and 2 <= len(ticks) <= 4
    assert wait_until(time.monotonic(), on_tick=lambda: 1 / 0, tick_s=0.01) == "deadline"


def test_resume_refuses_a_session_still_being_recorded(runs, capsys):
    from gpuwatch.recording.writer import LOCK_NAME, lock_session, unlock_session

    assert not (runs["session"] / LOCK_NAME).exists()  # a clean stop leaves the folder as it was
    fd = lock_session(runs["session"])  # as a live recorder holds it
    try:
        assert main(["stress", "--resume", str(runs["session"])]) == 2
        assert "still recording this session" in capsys.readouterr().err
    finally:
        unlock_session(fd)
        (runs["session"] / LOCK_NAME).unlink()


def test_no_data_for_an_enforced_check_fails_the_run():
    """Issue 17 (9): `stress --fail-on 'util<85,throttled>0.05'` with no GPU exited 0."""
    import dataclasses
    from types import SimpleNamespace

    import polars as pl

    rec = open_recording(SWEEP)
    gpu_cols = [c for c in rec.samples.columns if c.startswith("gpu")]
    cpu = dataclasses.replace(rec, meta={**rec.meta, "gpus": []}, samples=rec.samples.with_columns(
        *(pl.lit(None).cast(rec.samples.schema[c]).alias(c) for c in gpu_cols)))
    session = SimpleNamespace(workloads=[], status=lambda: session_status(None))
    info = ci.RunInfo(fail_on=ci.parse_fail_on("util<85,throttled>0.05"))
    summary = ci.verdict(session, "done", info, [], cpu, None)
    assert summary["exit"]["code"] == 1, summary["exit"]
    assert any("no data" in w for w in summary["exit"]["why"])
    failed = {c["name"] for c in summary["checks"] if c["status"] == "fail"}
    assert failed == {"health: GPU utilization", "health: Throttling"}
    # a check not asked for, without data, is still only skipped
    assert {c["status"] for c in summary["checks"] if c["name"] == "health: Temperature"} == {"skipped"}


def test_headless_stress_survives_its_terminal_closing(tmp_path, py_env):
    """Issue 17 (4): the README says a headless `stress` survives a dropped SSH link; SIGHUP stopped it."""
    py, env = py_env
    err = tmp_path / "err"
    with open(err, "w") as fh:
        p = subprocess.Popen([py, "-m", "gpuwatch", "stress", *CPU, "--duration", "6s", "--progress", "1s",
                              "-o", str(tmp_path / "rec")], env=env, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=fh)
        _wait_for(err, "| step ")
        p.send_signal(signal.SIGHUP)
        rc = p.wait(90)
    assert rc == 0, err.read_text()
    session = next((tmp_path / "rec").iterdir())
    rec = open_recording(session)
    assert rec.complete and "detached" in rec.events["kind"].to_list()
    assert "| step " in (session / "stress.log").read_text()  # progress went on, into the session's log


def test_resume_of_a_finished_session_is_refused(runs, capsys):
    """Issue 17 (8): resuming a finished session reopened it, ran 0 steps, appended idle samples and a
    `resumed` entry, exit 0 - again on every call."""
    session = runs["session"]
    assert runs["resume"][0] == 0  # the resumed run ran its --duration 5s to the end
    before = json.loads((session / "meta.json").read_text())
    files = sorted(p.name for p in session.iterdir())
    assert main(["stress", "--resume", str(session), "--duration", "5s"]) == 2
    assert "finished" in capsys.readouterr().err
    assert json.loads((session / "meta.json").read_text()) == before
    assert sorted(p.name for p in session.iterdir()) == files


# -- one table for every status (gpuwatch/report/judgement.py) -------------------------------------------
def _cpu_recording():
    import dataclasses

    import polars as pl

    rec = open_recording(SWEEP)
    gpu_cols = [c for c in rec.samples.columns if c.startswith("gpu")]
    return dataclasses.replace(rec, meta={**rec.meta, "gpus": []}, samples=rec.samples.with_columns(
        *(pl.lit(None).cast(rec.samples.schema[c]).alias(c) for c in gpu_cols)))


def _judged(rec, fail_on: str | None):
    from types import SimpleNamespace

    session = SimpleNamespace(workloads=[], status=lambda: session_status(None))
    info = ci.RunInfo(fail_on=ci.parse_fail_on(fail_on) if fail_on else {})
    summary = ci.verdict(session, "done", info, [], rec, None)
    lines = {ln.split(":")[1].strip(): ln for ln in ci.health_lines(summary)}
    root = ET.fromstring(ci.junit_xml({**summary, "this_run_s": 0.0}).split("\n", 1)[1])
    cases = {c.get("name"): c for c in root.iter("testcase")}
    return summary, lines, cases


def test_a_row_past_its_threshold_never_says_pass():
    """Issue: `GPU utilization: 22.6 % (> 85.0 %) pass (default threshold: fails, not enforced)`."""
    summary, lines, cases = _judged(open_recording(SWEEP), None)  # the sweep: throttled 90 % of its samples
    line = lines["Throttling"]
    assert line.endswith(") FAIL (not enforced)") and " pass" not in line, line
    assert summary["exit"]["code"] == 0  # not enforced: the run does not fail
    case = cases["health: Throttling"]
    assert case.find("failure") is None and case.find("system-out").text.startswith("FAIL (not enforced): ")
    assert lines["GPU utilization"].endswith(") pass")  # 94.9 % > 85 %


def test_no_data_says_the_same_on_stdout_junit_json_and_exit_code():
    """Issue: with no data stdout said `n/a` while `--fail-on util` exited 1 and JUnit failed the row (and
    docs/CI.md said such a row is skipped)."""
    summary, lines, cases = _judged(_cpu_recording(), "util<85")
    rows = {r["name"]: r for r in summary["health"]["rows"]}
    assert rows["GPU utilization"]["verdict"] == "FAIL (no data)"
    assert ") FAIL (no data): no utilization samples" in lines["GPU utilization"], lines
    assert "n/a" not in "\n".join(lines.values())
    f = cases["health: GPU utilization"].find("failure")
    assert f is not None and f.get("message").startswith("FAIL (no data)") and f.get("type") == "no data"
    assert summary["exit"]["code"] == 1 and any("FAIL (no data" in w for w in summary["exit"]["why"])
    assert rows["Throttling"]["verdict"] == "no data (not enforced)"
    assert ") no data (not enforced)" in lines["Throttling"]
    assert cases["health: Throttling"].find("skipped") is not None


def test_every_status_comes_from_the_one_table(capsys):
    from gpuwatch.report.judgement import RULES, STATUSES, docs_table

    assert STATUSES == ("pass", "FAIL", "FAIL (not enforced)", "FAIL (no data)", "no data (not enforced)")
    assert {(k, j.fails_run) for k, j in RULES.items()} == {
        ((True, True), False), ((True, False), False), ((False, True), True), ((False, False), False),
        ((None, True), True), ((None, False), False)}
    assert docs_table() in (ROOT / "docs" / "CI.md").read_text()  # the docs say what the code does
    with pytest.raises(SystemExit):
        main(["stress", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for s in STATUSES:
        assert f"{s}: {' '.join(RULES[next(k for k, j in RULES.items() if j.status == s)].means.split())}" in text, s
