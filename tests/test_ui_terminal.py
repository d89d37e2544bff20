"""The dashboard commands without a terminal: `watch`, `live` (the default), `replay` and `replay --follow`
with stdin from /dev/null and output to a file (cron, CI, a pipe), or under TERM=dumb, used to draw
15 KB of escape codes into the file and exit 0. Now: one line on stderr, exit 2, nothing started."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import time

import pytest

from conftest import RAMP, ROOT

from gpuwatch.ui.launch import NO_TERMINAL

TUI_COMMANDS = {
    "watch": ["watch", "--duration", "3s"],
    "live": ["--duration", "3s", "--no-record", "--preset", "tiny"],  # no command: the live dashboard
    "replay": ["replay", str(RAMP)],
    "follow": ["replay", "--follow", str(RAMP)],
    "watch-source": ["watch", "--source", str(RAMP), "--duration", "3s"],
}


@pytest.mark.parametrize("name", TUI_COMMANDS)
def test_without_a_terminal_the_dashboard_says_so_and_exits_2(py, env, tmp_path, name):
    out = tmp_path / "out"
    with open(out, "wb") as fh:
        r = subprocess.run([py, "-m", "gpuwatch", *TUI_COMMANDS[name]], env=env, cwd=ROOT, stdin=subprocess.DEVNULL,
                           stdout=fh, stderr=subprocess.PIPE, timeout=60)
    err = r.stderr.decode()
    assert r.returncode == 2, (r.returncode, err[-2000:], out.stat().st_size)
    assert err.splitlines() == [f"gpuwatch: error: {NO_TERMINAL}"]
    assert out.read_bytes() == b""  # no escape codes


def _in_a_pty(argv: list[str], env: dict, timeout: float = 60.0) -> tuple[int, str]:
    """Run argv with stdin, stdout and stderr on a pseudo-terminal; its exit code and what it wrote."""
    master, slave = pty.openpty()
    p = subprocess.Popen(argv, env=env, cwd=ROOT, stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif p.poll() is not None:
                break
        code = p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        os.close(master)
    return code, b"".join(chunks).decode(errors="replace")


@pytest.mark.parametrize("name", ["watch", "replay"])
def test_a_dumb_terminal_is_refused_too(py, env, name):
    code, screen = _in_a_pty([py, "-m", "gpuwatch", *TUI_COMMANDS[name]], dict(env, TERM="dumb"))
    assert code == 2, screen[-2000:]
    assert screen.strip().splitlines() == [f"gpuwatch: error: {NO_TERMINAL}"]  # no escape codes either


def test_headless_commands_still_run_without_a_terminal(py, env, tmp_path):
    """What the message points to works where the dashboard does not."""
    r = subprocess.run([py, "-m", "gpuwatch", "record", "--duration", "1s", "-o", str(tmp_path)], env=env, cwd=ROOT,
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert NO_TERMINAL not in r.stderr
