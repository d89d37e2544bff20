"""The recorder under a failing disk: a full disk (a real small tmpfs where this machine lets us mount
one, and a patched write everywhere), polars' non-OSError failures, retry without losing or duplicating
rows, a stop during the outage, and `check_output_dir` on folders that cannot be written."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import time
import uuid
from pathlib import Path

import polars as pl
import pytest

from gpuwatch.errors import UsageError
from gpuwatch.recording import writer
from gpuwatch.recording.reader import open_recording
from gpuwatch.recording.replay_backend import ReplayGpuBackend
from gpuwatch.atomic import check_output_dir
from gpuwatch.recording.writer import Recorder, classify_error
from gpuwatch.telemetry.bus import Bus
from gpuwatch.telemetry.sampler import Sampler

from conftest import RAMP

_BACKEND = None


def _sampler(bus: Bus) -> Sampler:
    global _BACKEND
    _BACKEND = _BACKEND or ReplayGpuBackend(RAMP)
    s = Sampler(bus, _BACKEND, None)
    s.slow_tick()
    return s


def _session(root: Path, **kw) -> tuple[Bus, Sampler, Recorder]:
    bus = Bus()
    r = Recorder(bus, root, {"test": True}, name="s", **kw)
    r.dir.mkdir(parents=True)
    writer.write_json_atomic(r.meta, r.dir / "meta.json")
    return bus, _sampler(bus), r


def _ticks(s: Sampler, n: int) -> None:
    for _ in range(n):
        s.tick()


def _temps(d: Path) -> list[str]:
    return [p.name for p in d.iterdir() if p.name.endswith(".tmp") or p.name.startswith(".")]


def _kinds(bus: Bus) -> list[str]:
    return [e.kind for e in bus.events.latest(1000)]


class _Disk:
    """Makes the recorder's writes (the per-flush stream append, and the Parquet files of rolls and
    compaction) fail like a full disk while `full` is set."""

    def __init__(self, monkeypatch, exc=None):
        self.full = False
        self.exc = exc
        real, real_append = writer.write_atomic, writer.append_stream

        def write(df, path, *a, **k):
            if self.full:
                raise self.exc or OSError(errno.ENOSPC, "No space left on device", str(path))
            return real(df, path, *a, **k)

        def append(stream, df):
            if self.full:
                raise self.exc or OSError(errno.ENOSPC, "No space left on device", str(stream.path))
            return real_append(stream, df)
        monkeypatch.setattr(writer, "write_atomic", write)
        monkeypatch.setattr(writer, "append_stream", append)


def test_full_disk_is_one_event_then_retried_without_losing_or_duplicating_rows(tmp_path, monkeypatch):
    bus, s, r = _session(tmp_path)
    disk = _Disk(monkeypatch)
    _ticks(s, 10)
    r.flush()
    disk.full = True
    for _ in range(4):  # four failed attempts while rows keep coming
        _ticks(s, 10)
        bus.emit("mark", "during the outage")
        r.flush()
    assert r.state == "error"
    assert "\n" not in r.error and "ENOSPC" in r.error and "disk full" in r.error and str(r.dir) in r.error
    errs = [e for e in bus.events.latest(100) if e.kind == "recorder_error"]
    assert len(errs) == 1 and errs[0].detail["errno"] == "ENOSPC" and errs[0].severity == "error"
    assert not _temps(r.dir)
    disk.full = False
    _ticks(s, 10)
    r.flush()
    assert r.error is None and r.state == "recording"
    assert _kinds(bus).count("recorder_resumed") == 1
    r.stop()
    rec = open_recording(r.dir)
    assert rec.samples["tick"].to_list() == list(range(60))  # every row once, in order
    assert rec.complete and rec.incomplete_reason is None
    kinds = rec.events["kind"].to_list()
    assert "recorder_error" in kinds and "recorder_resumed" in kinds and kinds.count("mark") == 4
    assert not _temps(r.dir)


def test_polars_reports_a_full_disk_as_compute_error_and_it_is_classified(tmp_path, monkeypatch):
    exc = pl.exceptions.ComputeError("parquet: File out of specification: underlying IO error: "
                                     "No space left on device (os error 28)")
    bus, s, r = _session(tmp_path)
    disk = _Disk(monkeypatch, exc)
    disk.full = True
    _ticks(s, 5)
    r.flush()
    assert "ENOSPC" in r.error
    assert classify_error(pl.exceptions.ComputeError("weird"), tmp_path)[0] == "ComputeError"
    assert classify_error(OSError(errno.EROFS, "Read-only file system"), tmp_path)[0] == "EROFS"


def test_the_recorder_thread_survives_any_exception(tmp_path, monkeypatch):
    bus, s, r = _session(tmp_path, retry_s=0.05)
    disk = _Disk(monkeypatch, RuntimeError("a bug, not a disk"))
    disk.full = True
    r._thread = writer.start_thread(r._run, "gpuwatch-recorder")
    _ticks(s, 5)
    r.kick()
    deadline = time.monotonic() + 5
    while r.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert r.state == "error" and "RuntimeError" in r.error
    time.sleep(0.2)  # several retries
    assert r._thread.is_alive()
    disk.full = False
    deadline = time.monotonic() + 5
    while r.error is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert r.error is None
    r.stop()
    assert open_recording(r.dir).samples.height == 5


def test_stop_during_the_outage_keeps_what_was_written_and_says_what_was_lost(tmp_path, monkeypatch):
    bus, s, r = _session(tmp_path)
    disk = _Disk(monkeypatch)
    _ticks(s, 20)
    r.flush()
    disk.full = True
    _ticks(s, 7)
    r.flush()
    r.stop()  # the disk is still full: 7 sample rows were never written
    assert r.lost["samples"] == 7
    meta = json.loads((r.dir / "meta.json").read_text())
    assert meta["complete"] is False and "7 samples rows" in meta["incomplete_reason"]
    rec = open_recording(r.dir)
    assert rec.samples["tick"].to_list() == list(range(20))
    assert rec.incomplete_reason.startswith("incomplete: 7 samples rows") and "\n" not in rec.incomplete_reason
    assert not _temps(r.dir)


def test_rows_older_than_the_hold_are_dropped_and_counted(tmp_path, monkeypatch):
    monkeypatch.setattr(writer, "HOLD_S", 0.0)
    bus, s, r = _session(tmp_path)
    disk = _Disk(monkeypatch)
    disk.full = True
    for _ in range(3):
        _ticks(s, 5)
        time.sleep(0.01)
        r.flush()
    disk.full = False
    r.flush()
    r.stop()
    assert r.lost["samples"] == 10 and r.rows == 5
    rec = open_recording(r.dir)
    assert rec.samples["tick"].to_list() == list(range(10, 15)) and not rec.complete
    assert "10 samples rows" in rec.incomplete_reason


@contextlib.contextmanager
def _tmpfs(path: Path, size: str, ro: bool = False):
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if ro else "")
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        r = None
    if r is None or r.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=10)


def _fill(path: Path) -> Path:
    """Fill the file system `path` is on (a ballast file; delete it to give the space back)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)
    return path


def test_a_real_full_tmpfs(tmp_path):
    """200 KiB of tmpfs, filled up by a ballast file: the failing writes are polars' own errors."""
    with _tmpfs(tmp_path / "disk", "200k") as disk:
        bus, s, r = _session(disk)
        _ticks(s, 10)
        r.flush()
        before = {p.name: p.read_bytes() for p in r.dir.iterdir()}
        ballast = _fill(disk / "ballast")
        for _ in range(3):
            _ticks(s, 10)
            r.flush()
        assert r.state == "error" and "ENOSPC" in r.error and str(r.dir) in r.error, r.error
        assert not _temps(r.dir), "no temp file left behind"
        assert all((r.dir / n).read_bytes() == b for n, b in before.items())  # nothing written is damaged
        assert open_recording(r.dir).samples.height == 10
        ballast.unlink()
        _ticks(s, 10)
        r.flush()
        assert r.error is None
        r.stop()
        rec = open_recording(r.dir)
        assert rec.samples["tick"].to_list() == list(range(50)) and rec.complete
        assert rec.events["kind"].to_list().count("recorder_resumed") == 1
        assert not _temps(r.dir)


def test_a_real_full_tmpfs_with_the_recorder_thread(tmp_path):
    """The thread path end to end: a full disk for a while, then space comes back."""
    with _tmpfs(tmp_path / "disk", "200k") as disk:
        bus, s, r = _session(disk, retry_s=0.1)
        r.wait_s = 0.05
        r._thread = writer.start_thread(r._run, "gpuwatch-recorder")
        ballast = _fill(disk / "ballast")
        deadline = time.monotonic() + 10
        while r.error is None and time.monotonic() < deadline:
            _ticks(s, 5)
            time.sleep(0.05)
        assert r.error is not None and "ENOSPC" in r.error
        assert r._thread.is_alive()
        ballast.unlink()
        deadline = time.monotonic() + 10
        while r.error is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r.error is None
        _ticks(s, 5)
        r.stop()
        rec = open_recording(r.dir)
        ticks = rec.samples["tick"].to_list()
        assert ticks == list(range(len(ticks))) and rec.complete
        assert not _temps(r.dir)


# -- check_output_dir -----------------------------------------------------------------------------

def test_check_output_dir_creates_and_accepts_a_writable_folder(tmp_path):
    check_output_dir(tmp_path / "a" / "b")
    assert (tmp_path / "a" / "b").is_dir() and not list((tmp_path / "a" / "b").iterdir())


@pytest.mark.parametrize("case", ["proc", "file", "under_file"])
def test_check_output_dir_refuses_in_one_line(tmp_path, case):
    f = tmp_path / "f"
    f.write_text("x")
    path = {"proc": Path(f"/proc/gpuwatch-{uuid.uuid4().hex}"), "file": f, "under_file": f / "sub"}[case]
    with pytest.raises(UsageError) as e:
        check_output_dir(path)
    assert "\n" not in str(e.value) and str(path) in str(e.value)


def test_check_output_dir_refuses_a_read_only_mount(tmp_path):
    with _tmpfs(tmp_path / "ro", "64k", ro=True) as ro:
        with pytest.raises(UsageError, match="Read-only file system"):
            check_output_dir(ro)
        with pytest.raises(UsageError, match="cannot create"):
            check_output_dir(ro / "sub")


def test_check_output_dir_refuses_an_immutable_folder(tmp_path):
    with _tmpfs(tmp_path / "im", "64k") as fs:
        d = fs / "d"
        d.mkdir()
        if subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode != 0:
            pytest.skip("chattr +i not supported here")
        try:
            with pytest.raises(UsageError, match="Operation not permitted"):
                check_output_dir(d)
        finally:
            subprocess.run(["chattr", "-i", str(d)], capture_output=True)


def test_check_output_dir_refuses_a_full_disk(tmp_path):
    with _tmpfs(tmp_path / "full", "64k") as fs:
        _fill(fs / "ballast")
        with pytest.raises(UsageError, match="ENOSPC"):
            check_output_dir(fs)
        assert [p.name for p in fs.iterdir()] == ["ballast"]


def test_check_output_dir_refuses_without_permission(tmp_path):
    d = tmp_path / "locked"
    d.mkdir(mode=0o555)
    if os.geteuid() != 0:
        with pytest.raises(UsageError, match="Permission denied"):
            check_output_dir(d)
        return
    os.chmod(tmp_path, 0o755)  # root may write anywhere: check as nobody for a moment
    try:
        os.seteuid(65534)
    except OSError as e:
        pytest.skip(f"cannot change the effective user: {e}")
    try:
        with pytest.raises(UsageError, match="Permission denied") as e:
            check_output_dir(d)
        with pytest.raises(UsageError, match="Permission denied"):
            check_output_dir(d / "sub")
    finally:
        os.seteuid(0)
    assert str(d) in str(e.value) and "\n" not in str(e.value)
