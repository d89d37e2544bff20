"""Recorder round trip, crash safety (kill -9), corrupt input and a full disk."""

from __future__ import annotations

import errno
import json
import random
import signal
import subprocess
import time

import numpy as np
import polars as pl
import psutil
import pytest

from gpuwatch.errors import RecordingError
from gpuwatch.recording import ipc, schema, writer
from gpuwatch.recording.reader import SessionReader, open_recording, read_table_file
from gpuwatch.recording.replay_backend import ReplayGpuBackend
from gpuwatch.recording.writer import Recorder
from gpuwatch.telemetry.bus import Bus
from gpuwatch.telemetry.sampler import Sampler

from conftest import RAMP, ROOT, wait_for_stream


def _recorder(tmp_path, flushes=5, ticks_per_flush=10, roll_every=300, compact=True):
    bus = Bus()
    s = Sampler(bus, ReplayGpuBackend(RAMP), None)
    s.slow_tick()
    r = Recorder(bus, tmp_path, {"test": True}, roll_every=roll_every, name="s")
    r.dir.mkdir(parents=True)
    writer.write_json_atomic(r.meta, r.dir / "meta.json")
    for i in range(flushes):
        for _ in range(ticks_per_flush):
            s.tick()
        bus.steps.append({"ts": time.time_ns() // 1000, "step": i, "gpu": 0, "mode": "train", "batch": 8,
                          "tokens_per_s": 1000.0 + i, "loss": 11.5})
        bus.emit("mark", f"mark {i}", detail_n=i)
        r.flush()
    r._stop.set()
    if compact:
        r.stop()
    return bus, r


def _legacy(tmp_path, flushes=4, rows=10):
    """A session as gpuwatch wrote it before the stream files: one Parquet segment per flush."""
    d = tmp_path / "legacy"
    d.mkdir()
    writer.write_json_atomic({"schema_version": 2, "start": "2026-01-01T00:00:00+00:00", "complete": False},
                             d / "meta.json")
    src = open_recording(RAMP).samples.head(flushes * rows)
    for i in range(flushes):
        writer.write_atomic(src.slice(i * rows, rows), d / f"samples-{i + 1:06d}.parquet", level=1, fsync=False)
    return d, src


def _batch_heights(path, growing=False):
    """Rows of each record batch of a stream file, in order. `growing`: the file is still being
    written, so an empty file or a torn last message reads as the batches whole so far (the writer
    creates the file before its schema message lands)."""
    data = path.read_bytes()
    msgs, why = ipc.ipc_messages(data)
    if growing and not msgs:
        return []
    assert why is None and msgs[0][2] == 1, (why, msgs[:1])
    head = data[:msgs[0][1]]
    return [pl.read_ipc_stream(head + data[a:b] + ipc.IPC_EOS).height for a, b, _ in msgs[1:]]


def test_round_trip_keeps_every_row_and_type(tmp_path):
    bus, r = _recorder(tmp_path)
    rec = open_recording(r.dir)
    assert rec.complete and not rec.warnings
    assert rec.samples.height == 50 and rec.samples["tick"].to_list() == list(range(50))
    assert dict(rec.samples.schema) == schema.SAMPLES
    assert rec.steps["tokens_per_s"].to_list() == [1000.0, 1001.0, 1002.0, 1003.0, 1004.0]
    assert [json.loads(d)["detail_n"] for d in rec.events["detail"]] == [0, 1, 2, 3, 4]
    src = [row for t in bus.ticks.latest(50) for row in t.rows]
    assert rec.samples["gpu_mem_used_bytes"].to_list() == [x["gpu_mem_used_bytes"] for x in src]
    assert sorted(p.name for p in r.dir.iterdir()) == ["events.parquet", "meta.json", "risk.parquet", "samples.parquet", "steps.parquet"]


def test_rolled_chunks_and_a_crash_mid_roll_do_not_duplicate(tmp_path):
    bus, r = _recorder(tmp_path, flushes=7, roll_every=3, compact=False)
    names = sorted(p.name for p in r.dir.glob("samples-*"))
    assert names == ["samples-000007.arrows", "samples-c000001-000003.parquet", "samples-c000004-000006.parquet"]
    assert _batch_heights(r.dir / "samples-000007.arrows") == [10]
    # a crash between writing a chunk and deleting its stream (or, in older sessions, its segments)
    # leaves both: read once only
    df = pl.read_parquet(r.dir / "samples-c000004-000006.parquet")
    st = ipc.StreamFile(r.dir / "samples-000004.arrows", 4)
    for i in range(3):
        st.append(df.slice(i * 10, 10))
    st.close()
    writer.write_atomic(pl.read_parquet(r.dir / "samples-c000001-000003.parquet").head(10), r.dir / "samples-000002.parquet")
    rec = open_recording(r.dir)
    assert rec.samples["tick"].to_list() == list(range(70))
    assert not rec.complete and not rec.warnings


def test_truncated_and_garbage_segments_are_named_and_skipped(tmp_path):
    d, _ = _legacy(tmp_path, flushes=4)
    seg = d / "samples-000002.parquet"
    seg.write_bytes(seg.read_bytes()[: seg.stat().st_size // 2])
    (d / "samples-000009.parquet").write_text("this is not parquet")
    (d / "samples-000010.arrows").write_text("this is not an Arrow stream")
    rec = open_recording(d)
    assert rec.samples.height == 30  # segments 1, 3 and 4 survive
    assert any("samples-000002.parquet: truncated Parquet file" in w for w in rec.warnings)
    assert any("samples-000009.parquet: not a Parquet file" in w for w in rec.warnings)
    assert any("samples-000010.arrows: not an Arrow IPC stream" in w for w in rec.warnings)


def test_corrupt_pages_with_valid_footer_magic(tmp_path):
    d, _ = _legacy(tmp_path, flushes=2)
    seg = d / "samples-000001.parquet"
    data = bytearray(seg.read_bytes())
    for i in range(8, len(data) - 200):
        data[i] = 0xFF if i % 3 else data[i]
    seg.write_bytes(bytes(data))
    rec = open_recording(d)
    assert rec.samples.height == 10
    assert any("samples-000001.parquet" in w for w in rec.warnings)


def test_legacy_parquet_segments_read_resume_and_compact(tmp_path):
    """A session written before the stream files (Parquet segments) reads as before, and a recorder
    resuming it numbers its streams after them and compacts everything into one file."""
    d, src = _legacy(tmp_path, flushes=3)
    assert open_recording(d).samples.equals(src)
    bus = Bus()
    r = Recorder(bus, tmp_path, {}, name="legacy", resume={"at": "now"}).start()
    r._stop.set()
    assert r._seg["samples"] == 3 and r.rows == 30
    s = Sampler(bus, ReplayGpuBackend(RAMP), None)
    for _ in range(5):
        s.tick()
    r.flush()
    assert (d / "samples-000004.arrows").exists()
    assert open_recording(d).samples.height == 35
    r.stop()
    assert sorted(p.name for p in d.glob("samples*")) == ["samples.parquet"]
    rec = open_recording(d)
    assert rec.samples.height == 35 and rec.samples.head(30).equals(src) and rec.complete


def test_wrong_schema_version_is_one_line_naming_the_file(tmp_path):
    _, r = _recorder(tmp_path, flushes=1)
    meta = json.loads((r.dir / "meta.json").read_text())
    meta["schema_version"] = 99
    (r.dir / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(RecordingError, match=r"meta.json: schema version 99, this gpuwatch reads 1") as e:
        open_recording(r.dir)
    assert "\n" not in str(e.value)


def test_single_files(tmp_path):
    _, r = _recorder(tmp_path, flushes=2)
    rec = open_recording(r.dir / "samples.parquet")
    assert rec.samples.height == 20 and rec.events.is_empty()
    bad = tmp_path / "notes.parquet"
    bad.write_text("hello")
    with pytest.raises(RecordingError, match="notes.parquet: not a Parquet file"):
        open_recording(bad)
    other = tmp_path / "other.parquet"
    pl.DataFrame({"a": [1, 2]}).write_parquet(other)
    with pytest.raises(RecordingError, match="other.parquet: not a gpuwatch table"):
        open_recording(other)
    wrong = tmp_path / "wrong.parquet"
    pl.DataFrame({"ts": ["x"], "tick": ["y"]}).write_parquet(wrong)
    with pytest.raises(RecordingError, match="wrong schema"):
        read_table_file(wrong)
    with pytest.raises(RecordingError, match="no such file"):
        open_recording(tmp_path / "missing")


def test_full_disk_stops_recording_with_an_event_and_keeps_what_was_written(tmp_path, monkeypatch):
    bus, r = _recorder(tmp_path, flushes=3, compact=False)
    real = writer.append_stream

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(r.dir / "samples-000001.arrows"))
    monkeypatch.setattr(writer, "append_stream", full)
    s = Sampler(bus, ReplayGpuBackend(RAMP), None)
    s.tick()
    r.flush()
    assert r.state == "error" and "No space left on device" in r.error
    ev = [e for e in bus.events.latest(20) if e.kind == "recorder_error"]
    assert len(ev) == 1 and ev[0].severity == "error"
    r.flush()  # nothing more is attempted, nothing raises
    r.stop()
    monkeypatch.setattr(writer, "append_stream", real)
    assert open_recording(r.dir).samples.height == 30


def test_follow_reads_only_new_files(tmp_path):
    bus = Bus()
    s = Sampler(bus, ReplayGpuBackend(RAMP), None)
    r = Recorder(bus, tmp_path, {}, name="live").start()
    r._stop.set()  # drive flushes by hand
    reader = SessionReader(r.dir)
    assert reader.load_new()["samples"].height == 0
    for _ in range(3):
        s.tick()
    r.flush()
    assert reader.load_new()["samples"].height == 3
    for _ in range(2):
        s.tick()
    r.flush()
    assert reader.load_new()["samples"]["tick"].to_list() == [3, 4]


def test_a_recorder_started_without_its_thread_writes_when_flushed_by_hand(tmp_path):
    bus = Bus()
    s = Sampler(bus, ReplayGpuBackend(RAMP), None)
    r = Recorder(bus, tmp_path, {}, name="manual", flush_interval=0.01).start(thread=False)
    reader = SessionReader(r.dir)
    s.tick()
    time.sleep(0.1)  # ten flush intervals: no thread flushes them
    assert reader.load_new()["samples"].height == 0
    r.flush()
    assert reader.load_new()["samples"].height == 1
    r.stop()
    assert r.error is None and open_recording(r.dir).samples.height == 1


def test_follow_returns_each_row_once_through_rolls_and_compaction(tmp_path):
    bus = Bus()
    s = Sampler(bus, ReplayGpuBackend(RAMP), None)
    r = Recorder(bus, tmp_path, {}, name="long", roll_every=3).start()
    r._stop.set()
    reader = SessionReader(r.dir)
    got = []
    for i in range(8):  # segments 1-3 and 4-6 are rolled into chunks while the follower reads
        for _ in range(4):
            s.tick()
        r.flush()
        if i % 2:
            got += reader.load_new()["samples"]["tick"].to_list()
    bus.emit("mark", "before the end")
    r.stop()  # compaction replaces every file by samples.parquet
    got += reader.load_new()["samples"]["tick"].to_list()
    assert got == list(range(32))
    assert reader.load_new()["samples"].is_empty()


def test_kill_9_loses_at_most_about_one_second(tmp_path, env, py):
    out = tmp_path / "rec"
    p = subprocess.Popen([py, "-m", "gpuwatch", "record", "--source", str(RAMP), "-o", str(out)],
                         env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert wait_for_stream(out, 60), p.stderr.read1().decode() if p.poll() is not None else "no stream"
        time.sleep(random.uniform(0.3, 2.0))
        children = psutil.Process(p.pid).children(recursive=True)
        assert children, "the sampler runs in a child process"
        killed_at = time.time()
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=10)
    finally:
        if p.poll() is None:
            p.kill()
    session = next(out.iterdir())
    rec = open_recording(session)
    assert not rec.complete
    ticks = rec.samples["tick"].to_list()
    assert ticks == list(range(len(ticks)))  # nothing missing in the middle
    last = rec.samples["ts"].max().timestamp()
    assert killed_at - last <= 1.5, f"lost {killed_at - last:.2f} s"
    # the sampler child notices its parent is gone (a broken pipe at its next hand-over) and exits
    gone, alive = psutil.wait_procs(children, timeout=5)
    assert not alive


def test_two_sessions_in_the_same_second_do_not_collide(tmp_path):
    a = Recorder(Bus(), tmp_path, {}, name="same").start()
    b = Recorder(Bus(), tmp_path, {}, name="same").start()
    assert a.error is None and b.error is None
    assert (a.dir.name, b.dir.name) == ("same", "same-2")
    a.stop()
    b.stop()


def test_headless_recording_takes_ticks_a_second_at_a_time_and_loses_none(tmp_path):
    """`gpuwatch record`'s path: the sampler child hands ten ticks over per message and the recorder
    writes each batch as it lands (one record batch per second of ten rows), with no tick missing."""
    from gpuwatch.runtime import ModelChoice, Session, SessionConfig

    s = Session(SessionConfig(interval_s=0.1, record_dir=tmp_path, source=str(RAMP), deliver_s=1.0, name="batched",
                              model=ModelChoice(enabled=False)))
    assert s.recorder.wait_s == 2.0 and s.sampler.on_delivery == s.recorder.kick
    s.start()
    try:
        deadline = time.monotonic() + 30
        stream = s.recorder.dir / "samples-000001.arrows"
        while time.monotonic() < deadline and (not stream.exists() or len(_batch_heights(stream, growing=True)) < 4):
            time.sleep(0.05)
        heights = _batch_heights(stream)
    finally:
        s.stop()
    assert len(heights) >= 4 and sorted(heights)[len(heights) // 2] == 10, heights
    rec = open_recording(s.recorder.dir)
    ticks = rec.samples["tick"].to_list()
    assert ticks == list(range(ticks[0], ticks[0] + len(ticks)))
    assert rec.complete and json.loads((s.recorder.dir / "meta.json").read_text())["config"]["deliver_s"] == 1.0


def test_follow_appends_without_resorting_and_reads_the_same_as_a_whole_replay(tmp_path, monkeypatch):
    """Rows fed to a following source piece by piece (tail merges, one piece out of order) read back
    exactly as the whole recording opened at once."""
    from gpuwatch.recording.source import ReplaySource

    whole = ReplaySource(RAMP)
    rows = pl.concat([whole._by_gpu[g] for g in whole._by_gpu]).sort("ts")
    first, rest = rows.head(100), rows.slice(100)
    sess = tmp_path / "s"
    sess.mkdir()
    writer.write_json_atomic(json.loads((RAMP / "meta.json").read_text()), sess / "meta.json")
    writer.write_atomic(first, sess / "samples-000001.parquet")
    monkeypatch.setattr(ReplaySource, "TAIL_MERGE_MIN", 50)
    src = ReplaySource(sess, follow=True)
    pieces = [rest.slice(i, 37) for i in range(0, rest.height, 37)]
    pieces[3], pieces[4] = pieces[4], pieces[3]  # one piece arrives late
    empty = {"steps": schema.empty("steps"), "events": schema.empty("events")}
    for p in pieces:
        assert src._load({"samples": p, **empty})
    assert max(df.n_chunks() for df in src._by_gpu.values()) <= 3
    assert np.array_equal(src.ticks_ts, whole.ticks_ts)
    for t in (whole.start_us, whole.ticks_ts[len(whole.ticks_ts) // 2], whole.end_us):
        src.seek_to(t)
        whole.seek_to(t)
        assert src.latest() == whole.latest()
        for col in ("gpu_mem_used_bytes", "gpu_power_w", "host_cpu_per_core_pct"):
            assert src.series(col, 0, 300) == whole.series(col, 0, 300)


def _recorded_with_processes(tmp_path, monkeypatch, compact: bool):
    """A session sampled from the fake NVML (two GPUs, PID 42 on both) with the process fields added."""
    from gpuwatch.telemetry.nvml import NvmlBackend
    from gpuwatch.telemetry.procs import ProcInfo

    from support.fake_nvml import FakeDriver

    FakeDriver(monkeypatch)
    bus = Bus()
    s = Sampler(bus, NvmlBackend(), None)
    s.procinfo = ProcInfo(lambda pid: ("alice", "python train.py --batch 8"))
    r = Recorder(bus, tmp_path, {"test": True}, name="procs")
    r.dir.mkdir(parents=True)
    writer.write_json_atomic(r.meta, r.dir / "meta.json")
    s.slow_tick()
    for _ in range(3):
        for _ in range(10):
            s.tick()
        s.slow_tick()
        r.flush()
    r._stop.set()
    if compact:
        r.stop()
    return r.dir


@pytest.mark.parametrize("compact", [False, True], ids=["streams", "compacted"])
def test_process_utilization_user_and_command_round_trip_into_replay(tmp_path, monkeypatch, compact):
    """Issue 17: each process's SM/memory utilization, user and command are recorded in samples.gpu_procs
    and replayed (from the open stream files of a running or killed session, and from the compacted table)."""
    from gpuwatch.recording.source import ReplaySource

    d = _recorded_with_processes(tmp_path, monkeypatch, compact)
    rec = open_recording(d)
    assert not rec.warnings and dict(rec.samples.schema) == schema.SAMPLES
    procs = rec.samples.filter(pl.col("gpu") == 0)["gpu_procs"].to_list()
    assert procs[0] == [{"pid": 42, "used_bytes": 2**30, "sm_util_pct": None, "mem_util_pct": None,
                         "user": None, "command": None}]  # the first second: NVML's compute-apps alone
    assert procs[-1] == [{"pid": 42, "used_bytes": 2**30, "sm_util_pct": 55, "mem_util_pct": 20,
                          "user": "alice", "command": "python train.py --batch 8"}]
    assert rec.samples.filter(pl.col("gpu") == 1)["gpu_procs"].to_list()[-1][0]["sm_util_pct"] == 35
    src = ReplaySource(d)
    src.seek_to(src.end_us)
    latest = src.latest()
    assert latest[0]["gpu_procs"][0]["user"] == "alice" and latest[1]["gpu_procs"][0]["mem_util_pct"] == 10


def test_sessions_recorded_before_the_process_fields_read_them_as_null():
    """v1 and v2 sessions hold gpu_procs as (pid, used_bytes): they read unchanged, the new fields null."""
    for name in ("sample-h200-oom-inject", "sample-h200-guard-leak"):  # v1, v2
        rec = open_recording(RAMP.parent / name)
        assert not rec.warnings and dict(rec.samples.schema) == schema.SAMPLES
        listed = [p for ps in rec.samples["gpu_procs"].to_list() if ps for p in ps]
        assert listed and all(p["pid"] is not None for p in listed)
        assert all(p["sm_util_pct"] is None and p["user"] is None and p["command"] is None for p in listed)
