"""Layout snapshots (SVG) at 80x24 and 160x50, live and replay, on recorded H200 data.
Update after an intended change with: pytest tests/test_snapshots.py --snapshot-update"""

from __future__ import annotations

import pytest

from gpuwatch.recording.source import ReplaySource
from gpuwatch.ui.app import make_app

from conftest import RAMP
from uihelpers import live_source

SIZES = [(80, 24), (160, 50)]


def _replay_at_first_oom():
    src = ReplaySource(RAMP)
    for _ in range(3):
        src.jump_event(1)
    return make_app(src)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_replay_layout(snap_compare, size):
    assert snap_compare(_replay_at_first_oom(), terminal_size=size)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_live_layout(snap_compare, size):
    src, _ = live_source()
    assert snap_compare(make_app(src), terminal_size=size)


GUARDED = RAMP.parent / "sample-h200-guard-ramp-train"


def _guarded_at_first_refusal():
    """A real guarded H200 session: the risk that was live, the alarm and the guard's refusal."""
    src = ReplaySource(GUARDED)
    ev = src.events_df
    i = ev["kind"].to_list().index("guard_action")
    src.seek_to(int(ev["ts"][i].timestamp() * 1e6) + 400_000)
    return make_app(src)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_guarded_replay_layout(snap_compare, size):
    assert snap_compare(_guarded_at_first_refusal(), terminal_size=size)


def test_help_screen(snap_compare):
    assert snap_compare(_replay_at_first_oom(), terminal_size=(80, 24), press=["question_mark"])


RANKS = RAMP.parent / "cpu-gloo-2rank-train"


def _two_ranks_at_end():
    """A data-parallel session (2 ranks, gloo, an OOM on rank 1 survived by both, the collective check):
    the ranks line names the straggler, communication beside the step time."""
    src = ReplaySource(RANKS)
    src.seek_to(int(src.steps_df["ts"].max().timestamp() * 1e6))
    return make_app(src)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_ranks_replay_layout(snap_compare, size):
    assert snap_compare(_two_ranks_at_end(), terminal_size=size)
