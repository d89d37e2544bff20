"""`Session.status()`: one frozen snapshot of the guard, the recorder and each workload, from which the
dashboard (guard panel, header, workload line), the CI progress line, the stress verdict and a run's
summary lines all take their words - so each is written once, here pinned to what they said before."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpuwatch.control.policy import GuardConfig
from gpuwatch.runtime import ModelChoice, Session, SessionConfig, session_status


def _parts(error=None, incomplete=None, gpu_index=0, unable=None, manual=False):
    guard = SimpleNamespace(cfg=GuardConfig(mode="on", rule="model"), actions=3, misses=1, unable=unable,
                            stopped={})
    rec = SimpleNamespace(dir=Path("/r/s1"), rows=120, bytes=2048, dropped=2, error=error,
                          incomplete_reason=incomplete, meta={"complete": True, "resumed": []})
    w = SimpleNamespace(state="running", unrecovered="OOM at the floor", manual=manual, device_name="NVIDIA H200",
                        describe=lambda: {"preset": "tiny", "mode": "train", "gpu_index": gpu_index})
    return guard, rec, w


def test_each_front_end_says_what_it_said():
    guard, rec, w = _parts(manual=True)
    s = session_status("risk model x", guard, rec, [w], SimpleNamespace(late_ticks=4))
    assert s.guard_panel() == "guard on/model: 3 act, 1 miss (user has control: a hands back)"
    assert s.guard_progress() == "guard 3 action(s), 1 miss(es)"
    assert s.guard.summary() == "guard (on, model): 3 action(s), 1 failure(s) not prevented"
    assert s.recorder_header() == "rec 120 rows 2 KiB dropped 2 s1"
    assert s.recorder_progress() == "120 rows"
    assert s.recorder.summary() == "recording: /r/s1 (120 rows, 2048 bytes, 2 dropped, 4 late ticks)"
    assert s.recorder.summary(late=False) == "recording: /r/s1 (120 rows, 2048 bytes)"
    assert s.recorder.check() == "120 sample rows in /r/s1" and s.recorder.bad is None
    assert s.workloads[0].label == "tiny train on GPU 0"
    assert s.workloads[0].line == "tiny train on GPU 0: OOM at the floor"
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.model_note = "changed"  # type: ignore[misc]


def test_failures_and_absences_are_said_once():
    guard, rec, w = _parts(error="disk full", incomplete="killed", gpu_index=None, unable="no GPU")
    s = session_status("no risk model", guard, rec, [w])
    assert s.guard_panel() == "guard on: cannot act (no GPU)"
    assert s.recorder_header() == "REC ERROR: disk full" and s.recorder_progress() == "120 rows RECORDER ERROR"
    assert s.recorder.summary() == "recording: /r/s1 (120 rows, 2048 bytes, 2 dropped, None late ticks); ERROR disk full"
    assert s.recorder.bad == "disk full" and s.recorder.check() == "disk full"
    rec.error = None
    s = session_status("no risk model", None, rec, [w])
    assert s.recorder.summary().endswith("; INCOMPLETE killed") and s.recorder.check() == "INCOMPLETE killed"
    assert s.guard_panel() == "guard off" and s.guard_progress() == "guard off"  # a workload, no guard
    assert s.workloads[0].label == "tiny train on NVIDIA H200"  # no GPU index: the device's name
    empty = session_status("no risk model")
    assert empty.guard_panel() == "" and empty.recorder_header() == "not recording" == empty.recorder_progress()


def test_a_session_reports_its_own_parts(tmp_path):
    cfg = SessionConfig(sampler="thread", record_dir=tmp_path, model=ModelChoice(enabled=False))
    s = Session(cfg)
    try:
        st = s.status()
        assert st.model_note == "risk scoring off" and st.guard is None and st.workloads == ()
        assert st.recorder is not None and st.recorder.dir == s.recorder.dir and st.recorder.rows == 0
    finally:
        s.stop()
