"""Signals end a headless run cleanly: Ctrl-C (SIGINT), SIGTERM and SIGHUP (a dropped SSH link) flush
and close the recording, print the summary and exit 128 + the signal, with no traceback; a crash
inside the dashboard exits non-zero with one line naming the log that holds the traceback."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest

from gpuwatch.recording.reader import open_recording

from conftest import RAMP, ROOT, wait_for_stream


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_record_stops_cleanly_on_a_signal(py, env, tmp_path, sig, code):
    p = subprocess.Popen([py, "-m", "gpuwatch", "record", "--source", str(RAMP), "-o", str(tmp_path), "--no-model"],
                         env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    wait_for_stream(tmp_path, 30)
    time.sleep(1.0)
    # Ctrl-C in a terminal signals the whole foreground process group, the sampler child included
    import os

    os.killpg(p.pid, sig) if sig == signal.SIGINT else p.send_signal(sig)
    out, err = p.communicate(timeout=30)
    assert p.returncode == code, (out, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "recording:" in out and f"stopped by {signal.Signals(sig).name}" in err
    rec = open_recording(next(tmp_path.iterdir()))
    assert rec.complete and rec.samples.height >= 10  # flushed and compacted: nothing lost


async def test_a_crash_in_the_dashboard_is_kept_for_the_log_not_printed(tmp_path):
    from gpuwatch.recording.source import ReplaySource
    from gpuwatch.ui.app import make_app
    from gpuwatch.ui.launch import crash_log

    src = ReplaySource(RAMP)
    app = make_app(src)
    with pytest.raises(ValueError):  # run_test re-raises it; `gpuwatch` writes it to a log instead
        async with app.run_test(size=(80, 24)) as pilot:
            def boom():
                raise ValueError("hour must be in 0..23")
            src.poll = boom
            await pilot.pause(0.6)
    assert isinstance(app.crashed, ValueError) and app.return_code == 1
    assert not app._exit_renderables  # no traceback dumped on the restored terminal
    path = crash_log(app.crashed, tmp_path)
    assert path.parent == tmp_path and "hour must be in 0..23" in path.read_text() and "Traceback" in path.read_text()


def test_a_stop_signal_while_a_table_is_read_is_a_stop_not_a_broken_recording(monkeypatch):
    """Found in session 38: a SIGTERM that cut into reading a Parquet table (torchrun signalling rank 0) was
    reported as "columns of the wrong type" - the CLI's stop was an Exception, and the readers' catch-alls (polars
    raises BaseExceptions for corrupt pages) took it for a broken file. The stop is let through as itself now, and
    the same catch-all still names a real decoding failure."""
    import polars as pl

    from gpuwatch.errors import RecordingError, StopSignal
    from gpuwatch.recording import layout, schema

    df = pl.read_parquet(RAMP / "steps.parquet")

    def stopped(*_a, **_k):
        raise StopSignal(signal.SIGTERM)
    monkeypatch.setattr(schema, "conform", stopped)
    with pytest.raises(StopSignal):
        layout.check_frame(RAMP / "steps.parquet", df, "steps")

    def broken(*_a, **_k):
        raise ValueError("cannot cast")
    monkeypatch.setattr(schema, "conform", broken)
    with pytest.raises(RecordingError, match="columns of the wrong type"):
        layout.check_frame(RAMP / "steps.parquet", df, "steps")
