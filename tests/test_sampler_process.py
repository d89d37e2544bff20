"""The sampler child process and signals: Ctrl-C / hang-up / SIGTERM sent to the terminal's process
group do not kill it with a traceback; `kill -9` of the parent leaves no resource-tracker warning and
no orphan; a child that dies is a `sampler_error` event."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from gpuwatch.recording.backends import BackendFactory
from gpuwatch.telemetry.bus import Bus
from gpuwatch.telemetry.sampler_process import SamplerProcess

from conftest import RAMP, ROOT

SCRIPT = """
import signal, sys, time
from gpuwatch.recording.backends import BackendFactory
from gpuwatch.telemetry.bus import Bus
from gpuwatch.telemetry.sampler_process import SamplerProcess

if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a shell may start us with it ignored
    bus = Bus()
    sp = SamplerProcess(bus, BackendFactory(sys.argv[1]), 0.05)
    sp.launch()
    sp.start()
    print("child", sp._proc.pid, flush=True)
    try:
        time.sleep(60)
    except KeyboardInterrupt:
        n = len(bus.ticks)
        time.sleep(0.5)  # the child keeps sampling after the Ctrl-C
        print("after-ctrl-c", len(bus.ticks) - n, flush=True)
    sp.stop()
    print("stopped", [e.kind for e in bus.events.latest(20)], flush=True)
"""


def _start(tmp_path, env):
    script = tmp_path / "run_sampler.py"
    script.write_text(SCRIPT)
    p = subprocess.Popen([sys.executable, str(script), str(RAMP)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    line = p.stdout.readline()
    if not line.startswith("child"):
        p.kill()
        pytest.fail(f"the script did not start: {line!r} {p.stderr.read()[-2000:]}")
    return p, int(line.split()[1])


def _finish(p, timeout=20):
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"hung: {err[-2000:]}")
    return out, err


def test_ctrl_c_to_the_process_group_does_not_kill_the_sampler_child(tmp_path, env):
    p, child = _start(tmp_path, env)
    time.sleep(0.3)
    os.killpg(p.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    out, err = _finish(p)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    after = int(next(line for line in out.splitlines() if line.startswith("after-ctrl-c")).split()[1])
    assert after >= 3, out  # still sampling half a second later
    assert "sampler_error" not in out
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM])
def test_a_group_hangup_or_term_ends_the_parent_and_the_child_quietly(tmp_path, env, sig):
    p, child = _start(tmp_path, env)
    time.sleep(0.3)
    os.killpg(p.pid, sig)
    out, err = _finish(p)
    assert "Traceback" not in err, err
    assert psutil.wait_procs([psutil.Process(child)], timeout=5)[1] == [] if psutil.pid_exists(child) else True


def test_kill_9_of_the_parent_leaves_no_leak_warning_and_no_orphan(tmp_path, env):
    p, child = _start(tmp_path, env)
    time.sleep(0.3)
    p.kill()
    out, err = _finish(p)
    assert "leaked" not in err and "resource_tracker" not in err and "Traceback" not in err, err
    if psutil.pid_exists(child):
        gone, alive = psutil.wait_procs([psutil.Process(child)], timeout=5)
        assert not alive, "the sampler child outlived its parent"


def test_a_child_that_dies_is_a_sampler_error_event():
    bus = Bus()
    sp = SamplerProcess(bus, BackendFactory(str(RAMP)), 0.05)
    sp.launch()
    sp.start()
    try:
        deadline = time.monotonic() + 10
        while len(bus.ticks) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(sp._proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not any(e.kind == "sampler_error" for e in bus.events.latest(10)) and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        sp.stop()
    ev = [e for e in bus.events.latest(10) if e.kind == "sampler_error"]
    assert len(ev) == 1 and ev[0].severity == "error" and "signal 9" in ev[0].message
    assert not any(e.kind == "recorder_error" for e in bus.events.latest(10))


def test_a_clean_stop_is_not_an_error():
    bus = Bus()
    sp = SamplerProcess(bus, BackendFactory(str(RAMP)), 0.05, deliver_s=0.2)
    sp.launch()
    sp.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    sp.stop()
    assert time.monotonic() - t0 < 3
    assert not sp._proc.is_alive() and sp._proc.exitcode == 0
    assert len(bus.ticks) >= 3 and not list(bus.events.latest(10))
