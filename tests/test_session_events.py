"""Events the session emits while it is being assembled, before its recorder exists (`no_gpu`), still
reach the recording: they are buffered and handed to the bus once the recorder reads it."""

from __future__ import annotations

import pynvml

from gpuwatch.recording.reader import open_recording


def _no_driver(monkeypatch):
    def boom():
        raise pynvml.NVMLError_LibraryNotFound()
    monkeypatch.setattr(pynvml, "nvmlInit", boom)


def test_a_no_gpu_run_records_its_no_gpu_event(tmp_path, monkeypatch):
    _no_driver(monkeypatch)
    from gpuwatch.runtime import ModelChoice, Session, SessionConfig

    s = Session(SessionConfig(sampler="thread", record_dir=tmp_path, name="nogpu", model=ModelChoice(enabled=False)))
    assert s.gpu is None
    with s:
        pass
    events = open_recording(s.recorder.dir).events
    kinds = events["kind"].to_list()
    assert "no_gpu" in kinds, kinds
    row = events.filter(events["kind"] == "no_gpu").row(0, named=True)
    assert row["severity"] == "warning" and "CPU-only" in row["message"]
    assert kinds.index("no_gpu") < kinds.index("session_start")  # in the order it happened


def test_without_a_recorder_the_no_gpu_event_is_on_the_bus_once(monkeypatch):
    _no_driver(monkeypatch)
    from gpuwatch.runtime import ModelChoice, Session, SessionConfig

    s = Session(SessionConfig(sampler="thread", model=ModelChoice(enabled=False)))
    assert [e.kind for e in s.bus.events.latest(5)] == ["no_gpu"]
