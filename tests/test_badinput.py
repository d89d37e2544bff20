"""A corpus of damaged sessions, generated from a copy of a real shipped recording.

Unreadable sessions: `gpuwatch replay PATH` (a subprocess, with a timeout: nothing may hang) exits 1
before the TUI starts, with exactly one stderr line starting "gpuwatch: error:" and no traceback.
Partly damaged sessions (the TUI would start): `open_recording` returns the intact data and one
warning line naming the damaged file. After every case the files that were not damaged are byte for
byte what they were (reading never changes or loses what was recorded)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import polars as pl
import pytest

from gpuwatch.errors import RecordingError
from gpuwatch.recording.reader import SessionReader, open_recording
from gpuwatch.recording.source import ReplaySource

from conftest import RECORDINGS, ROOT

SHIPPED = RECORDINGS / "sample-h200-oom-inject"


def _digest(folder: Path) -> dict[str, str]:
    out = {}
    for p in sorted(folder.iterdir()):
        if p.is_file() and not p.is_symlink():
            out[p.name] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


SHIPPED_DIGEST = _digest(SHIPPED)


def _meta(d: Path, **change) -> None:
    m = json.loads((d / "meta.json").read_text())
    for k, v in change.items():
        if v is _DEL:
            m.pop(k, None)
        else:
            m[k] = v
    (d / "meta.json").write_text(json.dumps(m))


_DEL = object()


def _replace(name: str, make: Callable[[Path], None]) -> Callable[[Path], list[str]]:
    def corrupt(d: Path) -> list[str]:
        p = d / name
        if p.exists() or p.is_symlink():
            p.unlink()
        make(p)
        return [name]
    return corrupt


def _bytes(data: bytes) -> Callable[[Path], None]:
    return lambda p: p.write_bytes(data)


def _fifo(p: Path) -> None:
    os.mkfifo(p)


def _loop(p: Path) -> None:
    os.symlink(p.name, p)  # points at itself


def _truncate(name: str, frac: float = 0.5) -> Callable[[Path], list[str]]:
    def corrupt(d: Path) -> list[str]:
        p = d / name
        data = p.read_bytes()
        p.write_bytes(data[: int(len(data) * frac)])
        return [name]
    return corrupt


def _scribble(name: str) -> Callable[[Path], list[str]]:
    """Overwrite the middle of the file (the pages), keeping the footer magic."""
    def corrupt(d: Path) -> list[str]:
        p = d / name
        data = bytearray(p.read_bytes())
        for i in range(8, max(9, len(data) - 200)):
            data[i] = (data[i] * 7 + 13) % 256
        p.write_bytes(bytes(data))
        return [name]
    return corrupt


def _meta_case(**change) -> Callable[[Path], list[str]]:
    def corrupt(d: Path) -> list[str]:
        _meta(d, **change)
        return ["meta.json"]
    return corrupt


def _all(*fs) -> Callable[[Path], list[str]]:
    return lambda d: [n for f in fs for n in f(d)]


def _wrong_schema(p: Path) -> None:
    pl.DataFrame({"a": [1, 2], "b": ["x", "y"]}).write_parquet(p)


def _samples_as_strings(p: Path) -> None:
    pl.DataFrame({"ts": ["yesterday"], "tick": ["one"]}).write_parquet(p)


def _unrelated(d: Path) -> list[str]:
    gone = [p.name for p in d.iterdir()]
    for p in list(d.iterdir()):
        p.unlink()
    (d / "README.txt").write_text("holiday photos")
    (d / "data.csv").write_text("a,b\n1,2\n")
    return gone


# Unreadable: replay must exit 1 with one line, before any TUI.
FATAL: dict[str, Callable[[Path], list[str]]] = {
    "meta_not_json": _replace("meta.json", _bytes(b'{"schema_version": 2, "start": ')),
    "meta_binary": _replace("meta.json", _bytes(bytes(range(256)) * 4)),
    "meta_empty": _replace("meta.json", _bytes(b"")),
    "meta_a_list": _replace("meta.json", _bytes(b"[1, 2, 3]")),
    "meta_a_number": _replace("meta.json", _bytes(b"5")),
    "meta_deep_nesting": _replace("meta.json", _bytes(b"[" * 100000 + b"]" * 100000)),
    "meta_gpus_int": _meta_case(gpus=5),
    "meta_gpus_strings": _meta_case(gpus=["GPU0"]),
    "meta_gpu_index_text": _meta_case(gpus=[{"index": "zero", "name": "H200"}]),
    "meta_config_list": _meta_case(config=[]),
    "meta_workloads_text": _meta_case(config={"workloads": "v2-lite"}),
    "meta_complete_text": _meta_case(complete="yes"),
    "schema_missing": _meta_case(schema_version=_DEL),
    "schema_99": _meta_case(schema_version=99),
    "schema_abc": _meta_case(schema_version="abc"),
    "schema_true": _meta_case(schema_version=True),
    "meta_fifo": _replace("meta.json", _fifo),
    "meta_symlink_loop": _replace("meta.json", _loop),
    "meta_a_folder": _replace("meta.json", lambda p: p.mkdir()),
    "all_tables_zero_bytes": _all(*(_replace(f"{t}.parquet", _bytes(b"")) for t in ("samples", "steps", "events"))),
    "all_tables_truncated": _all(*(_truncate(f"{t}.parquet", 0.3) for t in ("samples", "steps", "events"))),
    "samples_wrong_schema": _replace("samples.parquet", _samples_as_strings),
    "samples_unrelated_parquet": _replace("samples.parquet", _wrong_schema),
    "samples_a_fifo": _replace("samples.parquet", _fifo),
    "samples_a_folder": _replace("samples.parquet", lambda p: p.mkdir()),
    "samples_symlink_loop": _replace("samples.parquet", _loop),
    "samples_zero_bytes": _replace("samples.parquet", _bytes(b"")),
    "samples_scribbled": _scribble("samples.parquet"),
    "unrelated_folder": _unrelated,
}

# Partly damaged: the intact tables are read, the damaged file is one warning naming it.
PARTIAL: dict[str, tuple[Callable[[Path], list[str]], str]] = {
    "steps_truncated": (_truncate("steps.parquet"), "steps.parquet: truncated Parquet file"),
    "steps_scribbled": (_scribble("steps.parquet"), "steps.parquet: corrupt Parquet"),
    "events_garbage": (_replace("events.parquet", _bytes(b"garbage" * 100)), "events.parquet: not a Parquet file"),
    "events_zero_bytes": (_replace("events.parquet", _bytes(b"")), "events.parquet: empty file"),
    "risk_segment_a_fifo": (_replace("risk-000001.parquet", _fifo), "risk-000001.parquet: not a regular file"),
    "risk_segment_a_folder": (_replace("risk-000001.parquet", lambda p: p.mkdir()), "risk-000001.parquet: is a folder"),
    "risk_segment_loop": (_replace("risk-000001.parquet", _loop), "risk-000001.parquet: symbolic link loop"),
    "risk_segment_wrong_schema": (_replace("risk-000001.parquet", _wrong_schema), "risk-000001.parquet: wrong schema"),
    "unrelated_parquet_name": (_replace("notes.parquet", _wrong_schema), "notes.parquet: not a gpuwatch file name"),
    "no_meta": (lambda d: ((d / "meta.json").unlink(), ["meta.json"])[1], "meta.json: missing"),
}


@pytest.fixture
def session(tmp_path):
    d = tmp_path / "session"
    shutil.copytree(SHIPPED, d)
    yield d
    assert _digest(SHIPPED) == SHIPPED_DIGEST  # the shipped recording itself is never touched


def _unchanged_except(d: Path, before: dict[str, str], damaged: list[str]) -> None:
    after = _digest(d)
    for name, h in before.items():
        if name not in damaged:
            assert after.get(name) == h, f"{name} changed or vanished"


# `gpuwatch replay` runs as a subprocess for one case of each kind (all at once: a CLI start costs
# about a second of CPU); every FATAL case is checked in-process below.
SUBPROCESS_CASES = ["meta_not_json", "meta_a_list", "meta_gpus_int", "meta_config_list", "schema_abc",
                    "meta_fifo", "samples_a_fifo", "samples_symlink_loop", "all_tables_zero_bytes",
                    "unrelated_folder", "samples_scribbled"]


@pytest.fixture(scope="module")
def replay_runs(tmp_path_factory):
    """Damage one copy per case, start `gpuwatch replay` on each concurrently, collect the results."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONUNBUFFERED="1")
    runs = {}
    for case in SUBPROCESS_CASES:
        d = tmp_path_factory.mktemp(case) / "session"
        shutil.copytree(SHIPPED, d)
        before = _digest(d)
        damaged = FATAL[case](d)
        p = subprocess.Popen([sys.executable, "-m", "gpuwatch", "replay", str(d)], env=env, cwd=ROOT,
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        runs[case] = (d, before, damaged, p)
    out = {}
    for case, (d, before, damaged, p) in runs.items():
        try:
            so, se = p.communicate(timeout=60)
            out[case] = (d, before, damaged, p.returncode, so, se)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            out[case] = (d, before, damaged, None, "", "HUNG")
    yield out
    assert _digest(SHIPPED) == SHIPPED_DIGEST


@pytest.mark.parametrize("case", SUBPROCESS_CASES)
def test_replay_of_an_unreadable_session_is_one_line_and_exit_1(replay_runs, case):
    d, before, damaged, code, stdout, stderr = replay_runs[case]
    assert stderr != "HUNG", f"{case}: replay hung"
    lines = stderr.splitlines()
    assert code == 1, (code, stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("gpuwatch: error:"), stderr[-2000:]
    assert "Traceback" not in stderr and "Traceback" not in stdout
    assert str(d) in lines[0]  # names the session or the file in it
    _unchanged_except(d, before, damaged)


@pytest.mark.parametrize("case", sorted(FATAL))
def test_unreadable_session_is_one_line_recording_error(session, case):
    before = _digest(session)
    damaged = FATAL[case](session)
    with pytest.raises(RecordingError) as e:  # what replay opens before any TUI: only RecordingError
        ReplaySource(session)
    assert "\n" not in str(e.value) and str(session) in str(e.value)
    _unchanged_except(session, before, damaged)


@pytest.mark.parametrize("case", sorted(PARTIAL))
def test_partly_damaged_session_opens_with_a_warning(session, case):
    before = _digest(session)
    corrupt, warning = PARTIAL[case]
    damaged = corrupt(session)
    rec = open_recording(session)
    assert rec.samples.height > 100
    assert any(warning in w for w in rec.warnings), rec.warnings
    assert all("\n" not in w for w in rec.warnings)
    ReplaySource(session)  # what the TUI opens: no exception
    _unchanged_except(session, before, damaged)


def test_incomplete_session_says_so(session):
    _meta(session, complete=False, end=_DEL)
    rec = open_recording(session)
    assert rec.incomplete_reason.startswith("incomplete: the recording process stopped without closing the session (last data ")
    assert rec.incomplete_reason.endswith(" UTC)")
    _meta(session, complete=False, incomplete_reason="recording stopped: disk full (ENOSPC) in /x")
    assert open_recording(session).incomplete_reason.startswith("incomplete: recording stopped: disk full (ENOSPC)")
    _meta(session, complete=True)
    assert open_recording(session).incomplete_reason is None
    assert SessionReader(session / "samples.parquet").incomplete_reason is None


@pytest.mark.parametrize("kind", ["loop", "fifo", "missing", "nul"])
def test_bad_session_paths(tmp_path, kind):
    p = tmp_path / "x"
    if kind == "loop":
        os.symlink("x", p)
    elif kind == "fifo":
        os.mkfifo(p)
    elif kind == "nul":
        p = str(p) + "\0y"
    with pytest.raises(RecordingError) as e:
        open_recording(p)
    assert "\n" not in str(e.value)


def test_unreadable_files_without_permission(session):
    """As root nothing is unreadable, so read as nobody for a moment."""
    (session / "steps.parquet").chmod(0)
    if os.geteuid() != 0:
        rec = open_recording(session)
        assert any("steps.parquet: cannot read (Permission denied" in w for w in rec.warnings)
        return
    modes, top = {}, session
    while top != Path(top.anchor):  # let nobody reach the session (for this test only)
        modes[top] = top.stat().st_mode & 0o7777
        top.chmod(modes[top] | 0o055)
        top = top.parent
        if str(top) in ("/tmp", "/"):
            break
    try:
        os.seteuid(65534)
    except OSError as e:
        pytest.skip(f"cannot change the effective user: {e}")
    try:
        rec = open_recording(session)
    finally:
        os.seteuid(0)
        for d, m in modes.items():
            d.chmod(m)
    assert any("steps.parquet: cannot read (Permission denied" in w for w in rec.warnings), rec.warnings
    assert rec.samples.height > 100


def test_watch_source_of_an_unreadable_session_is_the_replay_error(py, env, tmp_path):
    """`watch --source` a session whose samples are truncated used to show LIVE ... CPU-only."""
    import shutil
    import subprocess

    bad = tmp_path / "bad"
    shutil.copytree(ROOT / "recordings" / "sample-h200-oom-inject", bad)
    with open(bad / "samples.parquet", "r+b") as fh:
        fh.truncate(100)
    r = subprocess.run([py, "-m", "gpuwatch", "watch", "--source", str(bad), "--duration", "2s"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("gpuwatch: error:") and "samples.parquet" in r.stderr


def test_a_folder_of_text_files_is_said_to_hold_no_session(tmp_path):
    """Issue 17 (12): a folder of text files said "meta.json: missing; reading the Parquet files alone"
    (the first warning), as if a session were being read; it must say plainly that it holds none."""
    d = tmp_path / "notes"
    d.mkdir()
    (d / "todo.txt").write_text("buy milk\n")
    (d / "samples.parquet").write_text("not parquet, just text\n")  # a text file under a table's name
    (d / "results.parquet").write_text("more text\n")
    with pytest.raises(RecordingError) as e:
        open_recording(d)
    msg = str(e.value)
    assert msg.startswith(f"{d}: not a gpuwatch session"), msg
    assert "reading the Parquet files alone" not in msg and "\n" not in msg
    assert "samples.parquet: not a Parquet file" in msg  # and why the files in it are none


def test_all_tables_truncated_names_every_table(session):
    """Issue 17 (12): with samples, steps and events all truncated the error named events.parquet alone."""
    damaged = FATAL["all_tables_truncated"](session)
    with pytest.raises(RecordingError) as e:
        open_recording(session)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{session}: ")
    for name in damaged:
        assert f"{name}: truncated Parquet file" in msg, msg
    assert "no table could be read (3 files)" in msg
    with pytest.raises(RecordingError) as e:  # what `replay` opens
        ReplaySource(session)
    assert all(f"{name}: truncated Parquet file" in str(e.value) for name in damaged), str(e.value)


def test_replay_of_a_folder_of_text_files_says_it_holds_no_session(tmp_path):
    d = tmp_path / "notes"
    d.mkdir()
    (d / "samples.parquet").write_text("text\n")
    with pytest.raises(RecordingError) as e:
        ReplaySource(d)
    assert str(e.value).startswith(f"{d}: not a gpuwatch session (no meta.json; samples.parquet: not a Parquet file")
