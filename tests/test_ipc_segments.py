"""The recorder's Arrow IPC stream files: torn tails, a growing file followed, a killed session resumed
and compacted, and compaction that returns exactly the rows written."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time

import polars as pl
import pytest

from gpuwatch.recording import ipc, schema, writer
from gpuwatch.recording.layout import table_files
from gpuwatch.recording.reader import SessionReader, open_recording, read_table_file
from gpuwatch.recording.replay_backend import ReplayGpuBackend
from gpuwatch.recording.source import ReplaySource
from gpuwatch.recording.writer import Recorder
from gpuwatch.telemetry.bus import Bus
from gpuwatch.telemetry.sampler import Sampler

from conftest import RAMP, ROOT, wait_for_stream


def _session(tmp_path, name="s", **kw):
    bus = Bus()
    s = Sampler(bus, ReplayGpuBackend(RAMP), None)
    s.slow_tick()
    r = Recorder(bus, tmp_path, {"test": True}, name=name, **kw).start()
    r._stop.set()  # flushes driven by hand
    return bus, s, r


def _flush(bus, s, r, n=10, i=0):
    for _ in range(n):
        s.tick()
    bus.steps.append({"ts": time.time_ns() // 1000, "step": i, "gpu": 0, "mode": "train", "batch": 8, "loss": 1.5})
    bus.emit("mark", f"mark {i}", n=i)
    r.flush()


def _written(bus) -> pl.DataFrame:
    """Every sample row the bus handed out, as the recorder converts them."""
    return writer.to_frame([row for t in bus.ticks.latest(100_000) for row in t.rows], "samples")


def _kill(r: Recorder) -> None:
    """What a kill -9 leaves: the files as they are, open streams never closed or compacted."""
    r._close_streams()
    writer.unlock_session(r._lock_fd)
    r._lock_fd = None


def test_a_torn_tail_reads_every_complete_batch(tmp_path):
    bus, s, r = _session(tmp_path)
    for i in range(4):
        _flush(bus, s, r, i=i)
    _kill(r)
    path = r.dir / "samples-000001.arrows"
    data = path.read_bytes()
    msgs, why = ipc.ipc_messages(data)
    assert why is None and [t for *_, t in msgs] == [1, 3, 3, 3, 3] and msgs[-1][1] == len(data)
    whole = read_table_file(path)[1]
    assert whole.height == 40
    cuts = list(range(msgs[-1][0], len(data)))  # every byte offset within the last batch
    cuts += random.Random(1).sample(range(0, msgs[-1][0]), 300)  # and a sample of the earlier ones
    for cut in cuts:
        path.write_bytes(data[:cut])
        complete = sum(1 for a, b, t in msgs if t == 3 and b <= cut)
        reader = SessionReader(r.dir)
        got = reader.load_new()["samples"]
        assert got.height == 10 * complete, cut
        assert got.equals(whole.head(10 * complete)), cut
        assert not [w for w in reader.warnings if "samples" in w], (cut, reader.warnings)


def test_a_damaged_batch_is_named_and_the_batches_before_it_read(tmp_path):
    bus, s, r = _session(tmp_path)
    for i in range(3):
        _flush(bus, s, r, i=i)
    _kill(r)
    path = r.dir / "samples-000001.arrows"
    data = bytearray(path.read_bytes())
    msgs, _ = ipc.ipc_messages(bytes(data))
    data[msgs[2][0]:msgs[2][0] + 4] = b"\x00\x01\x02\x03"  # the second batch's framing
    path.write_bytes(bytes(data))
    rec = open_recording(r.dir)
    assert rec.samples["tick"].to_list() == list(range(10))
    assert any("samples-000001.arrows: no message framing" in w and "1 batches read" in w for w in rec.warnings), rec.warnings


def test_follow_sees_rows_appended_to_a_growing_stream(tmp_path):
    bus, s, r = _session(tmp_path)
    _flush(bus, s, r)
    src = ReplaySource(r.dir, follow=True, clock=lambda: time.monotonic() * 10)  # polls every call
    assert len(src.ticks_ts) == 10
    reader = src.reader
    _flush(bus, s, r, n=5, i=1)
    src.poll()
    assert len(src.ticks_ts) == 15 and src.at_edge and src.cursor_us() == src.end_us
    # a batch still being written (half of it on disk) is read once it is whole
    df = writer.to_frame([row for t in bus.ticks.latest(3) for row in t.rows], "samples")
    head, batch = ipc.ipc_bytes(df)
    path = r.dir / "samples-000001.arrows"
    with open(path, "ab") as fh:
        fh.write(batch[:100])
    assert reader.load_new()["samples"].is_empty()
    with open(path, "ab") as fh:
        fh.write(batch[100:])
    assert reader.load_new()["samples"].height == 3
    assert not reader.warnings


def test_roll_and_compaction_return_exactly_the_rows_written(tmp_path):
    bus, s, r = _session(tmp_path, roll_every=4)
    for i in range(10):
        _flush(bus, s, r, n=random.Random(i).randint(1, 12), i=i)
    assert sorted(p.name for p in r.dir.glob("samples-*")) == [
        "samples-000009.arrows", "samples-c000001-000004.parquet", "samples-c000005-000008.parquet"]
    live = open_recording(r.dir)
    written = _written(bus)
    assert live.samples.equals(written)
    r.stop()
    assert sorted(p.name for p in r.dir.iterdir()) == [
        "events.parquet", "meta.json", "risk.parquet", "samples.parquet", "steps.parquet"]
    compacted = pl.read_parquet(r.dir / "samples.parquet")
    assert compacted.equals(written) and dict(compacted.schema) == schema.SAMPLES
    assert pl.read_parquet(r.dir / "steps.parquet")["step"].to_list() == list(range(10))
    meta = json.loads((r.dir / "meta.json").read_text())
    assert meta["complete"] and meta["rows"] == written.height
    assert meta["bytes"] == sum(p.stat().st_size for p in r.dir.glob("*.parquet"))


def test_a_killed_stream_session_resumes_into_chunks_and_compacts(tmp_path):
    bus, s, r = _session(tmp_path, roll_every=3)
    for i in range(5):
        _flush(bus, s, r, i=i)
    _kill(r)
    # killed between writing a chunk and deleting its stream: the stream is covered, read once
    st = ipc.StreamFile(r.dir / "samples-000001.arrows", 1)
    st.append(pl.read_parquet(r.dir / "samples-c000001-000003.parquet"))
    st.close()
    before = open_recording(r.dir)
    assert before.samples.equals(_written(bus)) and not before.complete
    assert [p.name for p in table_files(r.dir, "samples")] == ["samples-c000001-000003.parquet", "samples-000004.arrows"]

    r2 = Recorder(bus, tmp_path, {}, name="s", resume={"at": "later"}).start()
    r2._stop.set()
    assert r2.error is None
    assert sorted(p.name for p in r2.dir.glob("samples-*")) == [
        "samples-c000001-000003.parquet", "samples-c000004-000005.parquet"]
    assert r2._seg["samples"] == 5 and r2.rows == 50
    assert sorted(p.name for p in r2.dir.glob("steps-*")) == ["steps-c000001-000003.parquet", "steps-c000004-000005.parquet"]
    _flush(bus, s, r2, i=5)
    assert (r2.dir / "samples-000006.arrows").exists()
    r2.stop()
    rec = open_recording(r2.dir)
    assert rec.complete and rec.samples.equals(_written(bus)) and rec.samples.height == 60
    assert rec.steps["step"].to_list() == list(range(6))
    assert json.loads((r2.dir / "meta.json").read_text())["resumed"][0]["previous_close"] == "interrupted"


def test_a_failed_append_leaves_the_stream_as_it_was(tmp_path, monkeypatch):
    bus, s, r = _session(tmp_path)
    _flush(bus, s, r)
    path = r.dir / "samples-000001.arrows"
    before = path.read_bytes()
    real = os.write

    def short(fd, data):  # half of it lands, then the disk is full
        if fd == r._stream["samples"].fd:
            real(fd, bytes(data[: len(data) // 2]))
            raise OSError(28, "No space left on device")
        return real(fd, data)
    monkeypatch.setattr(ipc.os, "write", short)
    _flush(bus, s, r, i=1)
    assert r.state == "error" and "ENOSPC" in r.error
    assert path.read_bytes() == before
    monkeypatch.setattr(ipc.os, "write", real)
    _flush(bus, s, r, i=2)
    assert r.error is None
    r.stop()
    assert open_recording(r.dir).samples["tick"].to_list() == list(range(30))


def test_kill_9_mid_recording_reads_then_resumes_to_parquet(tmp_path, env, py):
    """A real `gpuwatch record` killed with SIGKILL: the streams read as they are (at most the last
    second lost), and resuming the folder turns them into Parquet with every row kept."""
    out = tmp_path / "rec"
    p = subprocess.Popen([py, "-m", "gpuwatch", "record", "--source", str(RAMP), "-o", str(out), "--no-model"],
                         env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert wait_for_stream(out, 60), "no stream file"
        time.sleep(random.uniform(1.0, 2.5))
        killed_at = time.time()
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=10)
    finally:
        if p.poll() is None:
            p.kill()
    session = next(out.iterdir())
    rec = open_recording(session)
    ticks = rec.samples["tick"].to_list()
    assert ticks == list(range(len(ticks))) and len(ticks) >= 10 and not rec.warnings
    assert killed_at - rec.samples["ts"].max().timestamp() <= 1.5
    r = Recorder(Bus(), out, {}, name=session.name, resume={"at": "now"}).start()
    assert r.error is None and not list(session.glob("*.arrows"))
    r.stop()
    assert sorted(p.name for p in session.glob("samples*")) == ["samples.parquet"]
    again = open_recording(session)
    assert again.samples.equals(rec.samples) and again.complete


@pytest.mark.parametrize("garbage", [b"", b"\xff\xff\xff\xff\x10\x00", b"PAR1 nope"])
def test_a_stream_file_with_no_schema_yet_or_garbage(tmp_path, garbage):
    bus, s, r = _session(tmp_path)
    _flush(bus, s, r)
    (r.dir / "samples-000002.arrows").write_bytes(garbage)
    reader = SessionReader(r.dir)
    assert reader.load_new()["samples"].height == 10
    named = [w for w in reader.warnings if "samples-000002.arrows" in w]
    assert bool(named) == garbage.startswith(b"PAR1"), reader.warnings
    reader.load_new()
    assert [w for w in reader.warnings if "samples-000002.arrows" in w] == named  # said once


def test_gpuwatch_compact_turns_a_killed_session_into_parquet_duckdb_can_read(tmp_path, py, env):
    """`gpuwatch compact SESSION` after a kill -9 of `gpuwatch record`: the streams and chunks become one
    Parquet file per table with exactly the rows written; a second run has nothing to do; a live session
    (locked) or a folder that is no session is refused in one line."""
    import subprocess

    bus, s, r = _session(tmp_path, roll_every=3)
    for i in range(5):
        _flush(bus, s, r, i=i)
    _kill(r)
    before = open_recording(r.dir)
    run = lambda *a: subprocess.run([py, "-m", "gpuwatch", "compact", *map(str, a)], env=env, cwd=ROOT,  # noqa: E731
                                    capture_output=True, text=True, timeout=120)
    p = run(r.dir)
    assert p.returncode == 0, p.stderr
    assert "compacted" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert sorted(n.name for n in r.dir.iterdir()) == [
        "events.parquet", "meta.json", "risk.parquet", "samples.parquet", "steps.parquet"]
    after = open_recording(r.dir)
    assert after.samples.equals(before.samples) and after.steps.equals(before.steps)
    # compaction closes the files; it does not make a killed session whole, and meta.json still says so
    meta = json.loads((r.dir / "meta.json").read_text())
    assert not after.complete and "compacted later by gpuwatch compact" in meta["incomplete_reason"]
    assert meta["end"] == after.samples["ts"].max().isoformat()
    assert pl.read_parquet(r.dir / "samples.parquet").height == 50  # a plain Parquet reader sees every row
    p = run(r.dir)
    assert p.returncode == 0 and "already compact" in p.stderr
    p = run(tmp_path / "nope")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "no such folder" in p.stderr
    p = run(tmp_path)  # a folder, but no session
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "not a session folder" in p.stderr
    _, _, live = _session(tmp_path, name="live")
    try:
        p = run(live.dir)
        assert p.returncode == 2 and "still being recorded" in p.stderr
    finally:
        live.stop()


def test_compact_refuses_a_damaged_stream_and_changes_nothing(tmp_path, py, env):
    """A stream damaged before its end (a torn write, bytes overwritten): compact and resume would have read
    the batches before the damage and deleted the file with the rest; they refuse, one line, exit 1."""
    import subprocess

    bus, s, r = _session(tmp_path)
    for i in range(4):
        _flush(bus, s, r, i=i)
    _kill(r)
    path = r.dir / "samples-000001.arrows"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # a torn write in the middle of a batch (a disk, not a kill)
    before = {p.name: p.read_bytes() for p in r.dir.iterdir()}
    p = subprocess.run([py, "-m", "gpuwatch", "compact", str(r.dir)], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 1 and p.stderr.count("\n") == 1, p.stderr
    assert "samples-000001.arrows" in p.stderr and "nothing deleted" in p.stderr
    after = {p.name: p.read_bytes() for p in r.dir.iterdir() if p.name != "meta.json"}
    assert {k: v for k, v in before.items() if k != "meta.json"} == after


def test_a_fifo_named_like_a_stream_is_refused_not_waited_on(tmp_path, py, env):
    import os
    import subprocess

    bus, s, r = _session(tmp_path)
    _flush(bus, s, r)
    _kill(r)
    os.mkfifo(r.dir / "steps-000005.arrows")
    p = subprocess.run([py, "-m", "gpuwatch", "compact", str(r.dir)], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 1 and "not a regular file" in p.stderr and p.stderr.count("\n") == 1, p.stderr


def test_a_stream_holding_another_tables_rows_is_refused(tmp_path):
    bus, s, r = _session(tmp_path)
    _flush(bus, s, r)
    _kill(r)
    import shutil

    shutil.copy(r.dir / "events-000001.arrows", r.dir / "steps-000009.arrows")
    rec = open_recording(r.dir)
    assert any("steps-000009.arrows" in w and "wrong schema for steps" in w for w in rec.warnings), rec.warnings
    assert rec.steps.height == 1  # only the real step row


def test_following_a_killed_session_says_the_writer_is_gone(tmp_path):
    bus, s, r = _session(tmp_path)
    _flush(bus, s, r)
    t = [0.0]
    src = ReplaySource(r.dir, follow=True, clock=lambda: t[0])
    t[0] = 10.0
    src.poll()
    assert not src.writer_gone  # the recorder still holds the lock
    _kill(r)  # the lock goes with the process
    t[0] = 20.0
    src.poll()
    assert src.writer_gone and not src.writer_done
    _flush(bus, s, r, i=1)  # (a resumed writer) new rows: following again
    t[0] = 30.0
    src.poll()
    assert not src.writer_gone
