"""`gpuwatch replay` on a shipped recording inside a real terminal (tmux): send keys, read the screen."""

from __future__ import annotations

import json

import re
import shutil
import subprocess
import time
import uuid

import pytest

from conftest import RAMP, ROOT

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


# Each test runs its own tmux server on its own socket (-L), with no user config (-f /dev/null), and
# kills it at the end. With the shared default server, a test's kill-session could make the server
# exit just as the next test's new-session connected to it ("server exited unexpectedly", seen in CI).
_SOCKET = f"gw-test-{uuid.uuid4().hex[:8]}"


def tmux(*args: str, check: bool = False) -> str:
    return subprocess.run(["tmux", "-L", _SOCKET, "-f", "/dev/null", *args], capture_output=True, text=True,
                          timeout=10, check=check).stdout


@pytest.fixture(autouse=True)
def _own_server():
    global _SOCKET
    _SOCKET = f"gw-test-{uuid.uuid4().hex[:8]}"
    yield
    tmux("kill-server")


def new_session(name: str, cmd: str, *env_args: str) -> None:
    tmux("new-session", "-d", "-s", name, "-x", "80", "-y", "24", *env_args, cmd, check=True)


def wait_for(session: str, needle: str, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    screen = ""
    while time.monotonic() < deadline:
        screen = tmux("capture-pane", "-t", session, "-p")
        if needle in screen:
            return screen
        time.sleep(0.2)
    raise AssertionError(f"{needle!r} not on screen:\n{screen}")


def test_replay_in_a_real_terminal(py, env):
    name = f"gw-{uuid.uuid4().hex[:8]}"
    cmd = f"cd {ROOT} && PYTHONPATH={ROOT} {py} -m gpuwatch replay {RAMP}; echo EXITED $?; sleep 5"
    env_args = [a for k in ("TERM",) for a in ("-e", f"{k}=xterm-256color")]
    new_session(name, cmd, *env_args)
    try:
        screen = wait_for(name, "REPLAY")
        assert "0.0/81.0 s" in screen and "GPU0 H200" in screen
        tmux("send-keys", "-t", name, "n", "n", "n")
        screen = wait_for(name, "CUDA OOM at batch 18")
        tmux("send-keys", "-t", name, "g")
        wait_for(name, "Go to")
        tmux("send-keys", "-t", name, "50%", "Enter")
        screen = wait_for(name, "40.5/81.0 s")
        tmux("send-keys", "-t", name, "]")
        screen = wait_for(name, "50.5/81.0 s")
        thr = json.loads((ROOT / "models" / "risk.manifest.json").read_text())["threshold"]
        screen = wait_for(name, f"alarm {thr:.2f}", timeout=40)  # scored on the fly, in the background
        assert "throttle:" in screen and "risk" in screen
        tmux("send-keys", "-t", name, "q")
        wait_for(name, "EXITED 0")
    finally:
        tmux("kill-session", "-t", name)


def test_16_colour_terminal_gets_only_the_16_colours(py, env):
    name = f"gw-{uuid.uuid4().hex[:8]}"
    cmd = f"cd {ROOT} && TERM=xterm COLORTERM= PYTHONPATH={ROOT} {py} -m gpuwatch replay {RAMP}; sleep 5"
    new_session(name, cmd)
    try:
        wait_for(name, "REPLAY")
        tmux("send-keys", "-t", name, "n", "n", "n")
        wait_for(name, "CUDA OOM")
        styled = tmux("capture-pane", "-t", name, "-p", "-e")
        assert not re.findall(r"[34]8;[25];", styled), "256/true colour sent to a 16-colour terminal"
        assert re.findall(r"\x1b\[[0-9;]*(?:3[0-7]|9[0-7])[;m]", styled), "no colour at all"
        tmux("send-keys", "-t", name, "q")
    finally:
        tmux("kill-session", "-t", name)


def test_no_color_is_honoured(py, env):
    name = f"gw-{uuid.uuid4().hex[:8]}"
    cmd = f"cd {ROOT} && NO_COLOR=1 PYTHONPATH={ROOT} {py} -m gpuwatch replay {RAMP}; sleep 5"
    new_session(name, cmd, "-e", "TERM=xterm-256color")
    try:
        wait_for(name, "REPLAY")
        time.sleep(0.5)
        styled = tmux("capture-pane", "-t", name, "-p", "-e")
        # Textual's NO_COLOR mode is monochrome: only greys (the 256-colour grey ramp, or r=g=b)
        palette = [int(n) for n in re.findall(r"[34]8;5;(\d+)", styled)]
        assert palette and all(n >= 232 or n in (0, 7, 8, 15, 16, 231) for n in palette), sorted(set(palette))
        for r, g, b in re.findall(r"[34]8;2;(\d+);(\d+);(\d+)", styled):
            assert r == g == b
        tmux("send-keys", "-t", name, "q")
    finally:
        tmux("kill-session", "-t", name)


@pytest.mark.parametrize("sig", ["TERM", "HUP"])
def test_dashboard_closes_its_recording_on_sigterm_and_sighup(py, tmp_path, sig):
    """A dropped SSH link (SIGHUP) or a kill (SIGTERM) ends the dashboard like `q`: the session is
    stopped and its recording compacted and marked complete; the exit code says which signal."""
    from gpuwatch.recording.reader import open_recording

    name = f"gw-{sig.lower()}"
    pidfile = tmp_path / "pid"
    cmd = (f"cd {ROOT} && echo $$ > {pidfile} && exec {py} -m gpuwatch watch --source {RAMP} --record "
           f"-o {tmp_path / 'rec'} --no-model")
    new_session(name, f"bash -c '{cmd}; echo EXITED $?; sleep 30'")
    try:
        wait_for(name, "REPLAY", timeout=30)
        time.sleep(2.0)
        subprocess.run(["kill", f"-{sig}", pidfile.read_text().strip()], check=True)
        deadline = time.monotonic() + 20
        def closed() -> bool:  # compaction ends by rewriting meta.json with complete: true
            metas = list((tmp_path / "rec").glob("*/meta.json"))
            return bool(metas) and '"complete": true' in metas[0].read_text()
        while time.monotonic() < deadline and not closed():
            time.sleep(0.2)
        screen = tmux("capture-pane", "-t", name, "-p")
        rec = open_recording(next((tmp_path / "rec").iterdir()))
        assert rec.complete and rec.samples.height >= 10, screen
    finally:
        tmux("kill-session", "-t", name)


def test_too_small_terminal_says_so_until_resized_back(py, env):
    """At 60x20 the help was clipped mid-word with no close key in sight; now a one-line screen says the
    terminal is too small until it is resized back, and q still quits."""
    name = f"gw-{uuid.uuid4().hex[:8]}"
    # COLUMNS/LINES from the test process would fix the size Textual reads (shutil.get_terminal_size)
    cmd = (f"cd {ROOT} && env -u COLUMNS -u LINES PYTHONPATH={ROOT} {py} -m gpuwatch replay {RAMP} --no-model; "
           "echo EXITED $?; sleep 5")
    tmux("new-session", "-d", "-s", name, "-x", "60", "-y", "20", "-e", "TERM=xterm-256color", cmd, check=True)
    try:
        screen = wait_for(name, "terminal too small (60x20, needs 80x24)")
        assert "REPLAY" not in screen
        tmux("send-keys", "-t", name, "?")
        time.sleep(0.5)
        assert "terminal too small" in tmux("capture-pane", "-t", name, "-p")
        tmux("resize-window", "-t", name, "-x", "80", "-y", "24")
        screen = wait_for(name, "REPLAY")
        assert "terminal too small" not in screen and "g go to" in screen  # the footer whole
        tmux("resize-window", "-t", name, "-x", "70", "-y", "24")
        wait_for(name, "terminal too small (70x24, needs 80x24)")
        tmux("send-keys", "-t", name, "q")
        wait_for(name, "EXITED 0")
    finally:
        tmux("kill-session", "-t", name)
