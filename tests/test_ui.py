"""The dashboard as a user meets it: Pilot drives every key in live, replay and follow."""

from __future__ import annotations

import subprocess

import pytest

from gpuwatch.recording.source import ReplaySource
from gpuwatch.runtime import session_status
from gpuwatch.ui.app import make_app
from gpuwatch.units import parse_goto
from gpuwatch.ui.screens import ConfirmQuit, GotoScreen, HelpScreen

from conftest import RAMP, ROOT, wait_for_stream
from uihelpers import live_source


def text(app, wid: str) -> str:
    return str(app.query_one(f"#{wid}").render())


async def test_replay_keys_move_the_cursor():
    src = ReplaySource(RAMP)
    app = make_app(src)
    async with app.run_test(size=(80, 24)) as pilot:
        start = src.cursor_us()
        assert start == src.start_us and not src.playing
        assert "REPLAY" in text(app, "header") and "0.0/81.0 s" in text(app, "header")
        await pilot.press("right")
        assert src.cursor_us() - start == 1_000_000
        await pilot.press("right_square_bracket")
        assert src.cursor_us() - start == 11_000_000
        await pilot.press("left_square_bracket", "left")
        assert src.cursor_us() == start
        await pilot.press("full_stop", "full_stop")
        assert src.cursor_us() == src.ticks_ts[2]
        await pilot.press("comma")
        assert src.cursor_us() == src.ticks_ts[1]
        await pilot.press("end")
        assert src.cursor_us() == src.end_us
        await pilot.press("home")
        assert src.cursor_us() == src.start_us
        await pilot.press("plus", "plus")
        assert src.speed == 4.0
        await pilot.press("minus")
        assert src.speed == 2.0
        await pilot.press("l")
        assert src.loop
        await pilot.press("space")
        assert src.playing
        await pilot.pause(0.6)
        assert src.cursor_us() > start + 500_000  # playing at 2x
        await pilot.press("space")
        assert not src.playing


async def test_replay_jumps_between_events_and_shows_them():
    src = ReplaySource(RAMP)
    app = make_app(src)
    async with app.run_test(size=(100, 30)) as pilot:
        oom_ts = [int(t.timestamp() * 1e6) for t, k in zip(src.events_df["ts"], src.events_df["kind"]) if k == "oom"]
        for _ in range(3):  # session_start, workload_start, the first OOM
            await pilot.press("n")
        assert src.cursor_us() == oom_ts[0]
        assert "CUDA OOM at batch 18" in text(app, "events")
        await pilot.press("n", "n")
        assert src.cursor_us() == oom_ts[1]
        await pilot.press("N", "N")
        assert src.cursor_us() == oom_ts[0]


async def test_goto_time_percent_and_relative():
    src = ReplaySource(RAMP)
    app = make_app(src)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("g")
        assert isinstance(app.screen, GotoScreen)
        await pilot.press(*"50%", "enter")
        mid = src.start_us + (src.end_us - src.start_us) / 2
        assert abs(src.cursor_us() - mid) < 1
        await pilot.press("g", *"-10s", "enter")
        assert abs(src.cursor_us() - (mid - 10e6)) < 1
        await pilot.press("g", *"10:20:00", "enter")
        assert "10:20:00.0" in text(app, "header")
        await pilot.press("g", *"soon", "enter")  # a bad time: a notification, the cursor stays
        assert "10:20:00.0" in text(app, "header")


def test_parse_goto():
    src = ReplaySource(RAMP)
    args = (src.start_us, src.end_us, src.start_us)
    assert parse_goto("0%", *args) == src.start_us
    assert parse_goto("100%", *args) == src.end_us
    assert parse_goto("later", *args) is None
    assert parse_goto("99:00", *args) is None  # was a ValueError that crashed the app


async def test_help_and_quit_in_replay():
    app = make_app(ReplaySource(RAMP))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("q")
    assert app.return_code == 0


async def test_live_keys_reach_the_workload_and_the_bus():
    pytest.importorskip("torch")
    from gpuwatch.workload.runner import Workload, WorkloadConfig

    src, bus = live_source()
    w = Workload(bus, WorkloadConfig(batch=8, seq_len=8, overrides={"num_hidden_layers": 2}, integrity_every=0))
    w.guard = object()  # a guard is attached (never called: the workload is not started)

    class S:  # the part of a Session the App uses
        workload, recorder, guard, model_note = w, None, None, "no risk model"
        workloads = [w]
        bus = None

        def status(self):
            return session_status(self.model_note, self.guard, self.recorder, self.workloads)
    S.bus = bus
    app = make_app(src, session=S())
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("plus")
        assert w._pending["batch"][:2] == (10, "user")  # who acted travels with the change
        assert w.manual  # a manual change overrides the guard until handed back
        await pilot.press("minus")
        assert w._pending["batch"][0] == 6
        await pilot.press("p")
        assert w._pending["precision"][0] == "tf32"  # fp32 -> tf32 in the cycle
        await pilot.press("m")
        assert bus.events.latest(1)[0].kind == "mark"
        await pilot.press("space")
        assert "PAUSED" in text(app, "header")
        await pilot.press("space")
        assert "PAUSED" not in text(app, "header")
        await pilot.press("right", "g")  # replay keys do nothing live
        assert not isinstance(app.screen, GotoScreen)
        w.state = "running"
        await pilot.press("q")
        assert isinstance(app.screen, ConfirmQuit)
        await pilot.press("n")
        assert not isinstance(app.screen, ConfirmQuit) and app.is_running
        await pilot.press("ctrl+q")  # Textual's own quit key asks too while a workload runs (it quit at once)
        assert isinstance(app.screen, ConfirmQuit) and app.is_running
        await pilot.press("ctrl+q")  # asked once, not stacked
        assert sum(isinstance(x, ConfirmQuit) for x in app.screen_stack) == 1
        await pilot.press("n")
        assert not isinstance(app.screen, ConfirmQuit) and app.is_running
        await pilot.press("q", "y")
    assert app.return_code == 0


async def test_live_panels_show_real_values():
    src, bus = live_source()
    app = make_app(src)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause(0.1)
        gpus = text(app, "gpus")
        assert "GPU0 H200" in gpus and "/140 GiB" in gpus and "/700 W" in gpus
        assert "LIVE" in text(app, "header") and "not recording" in text(app, "header")
        assert "no risk scored" in text(app, "risk") and "headroom" in text(app, "risk")
        assert "tok/s" in text(app, "work")


async def test_view_pause_freezes_panels_while_data_arrives():
    src, bus = live_source(100)
    app = make_app(src)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("space")
        before = text(app, "events")
        bus.emit("mark", "arrived while paused")
        await pilot.pause(0.5)
        assert text(app, "events") == before
        await pilot.press("space")
        await pilot.pause(0.3)
        assert "arrived while paused" in text(app, "events")


async def test_errors_underneath_are_visible_not_fatal():
    src, bus = live_source(50)
    app = make_app(src)
    async with app.run_test(size=(100, 30)) as pilot:
        bus.emit("gpu_lost", "GPU 0 fell off the bus (NVML: GPU is lost)", "error", gpu=0)
        bus.emit("recorder_error", "recording stopped: No space left on device", "error")
        await pilot.pause(0.4)
        ev = text(app, "events")
        assert "fell off the bus" in ev and "No space left" in ev
        assert app.is_running


async def test_follow_a_session_another_process_is_writing(tmp_path, env, py):
    p = subprocess.Popen([py, "-m", "gpuwatch", "record", "--source", str(RAMP), "-o", str(tmp_path)],
                         env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_stream(tmp_path, 30)
        session = next(tmp_path.iterdir())
        src = ReplaySource(session, follow=True)
        app = make_app(src)
        async with app.run_test(size=(80, 24)) as pilot:
            assert "FOLLOW" in text(app, "header")
            first = src.cursor_us()
            await pilot.pause(2.5)
            assert src.cursor_us() > first + 1_000_000  # new segments arrived and the view kept up
            assert "at live edge" in text(app, "header")
            await pilot.press("left_square_bracket")  # look back: leaves the live edge
            assert not src.at_edge
            await pilot.press("f")
            assert src.at_edge
    finally:
        p.terminate()
        p.wait(timeout=20)


async def test_two_gpus_both_shown_and_s_cycles_the_plots(monkeypatch):
    from gpuwatch.recording.source import LiveSource
    from gpuwatch.recording.window import GpuMeta
    from gpuwatch.telemetry.bus import Bus
    from gpuwatch.telemetry.nvml import NvmlBackend
    from gpuwatch.telemetry.sampler import Sampler

    from support.fake_nvml import FakeDriver

    FakeDriver(monkeypatch)  # two GPUs behind the real pynvml error classes
    bus = Bus()
    s = Sampler(bus, NvmlBackend(), None)
    for _ in range(20):
        s.tick()
    src = LiveSource(bus, [GpuMeta(0, "NVIDIA H200", 141 * 2**30, 700.0, 89),
                           GpuMeta(1, "NVIDIA H200", 141 * 2**30, 700.0, 89)])
    app = make_app(src)
    async with app.run_test(size=(80, 24)) as pilot:
        gpus = text(app, "gpus")
        assert "GPU0 H200" in gpus and "GPU1 H200" in gpus
        assert app.plot_gpu == 0
        await pilot.press("s")
        assert app.plot_gpu == 1
        await pilot.press("s")
        assert app.plot_gpu == 0


async def test_replay_opens_at_once_and_fills_in_risk_scored_in_the_background():
    """Issue 17 (13): an 8-minute session without recorded risk used to be scored before the screen
    opened (~8.5 s on 2 cores); now the first screen comes at once and the risk fills in, said on screen."""
    import time

    from conftest import BENCH
    from gpuwatch.ui.launch import score_in_background

    t0 = time.perf_counter()
    src = ReplaySource(BENCH)
    assert src.risk_df.is_empty()
    app = make_app(src)
    thread = score_in_background(src, None, False)
    async with app.run_test(size=(80, 24)) as pilot:
        opened = time.perf_counter() - t0
        assert "REPLAY" in text(app, "header")
        assert opened < 1.0, opened
        assert "scoring risk in the background" in text(app, "risk") or not src.risk_df.is_empty()
        for _ in range(300):
            if not thread.is_alive():
                break
            await pilot.pause(0.1)
        assert not thread.is_alive() and not src.risk_df.is_empty()
        await pilot.press("end")
        assert "OOM" in text(app, "risk") and "scored on the fly" in text(app, "risk")


def test_events_are_ellipsized_at_word_boundaries():
    """Issue 17 (11): `...; runni`, `next_peak_est_fr` were cut mid-word, without an ellipsis."""
    from gpuwatch.ui.render import ellipsize, event_lines

    msg = "guard lowered the batch ceiling 24 -> 19 (risk 0.93); next_peak_est_frac 1.02; running at 19"
    ev = {"ts": 1_796_033_980_000_000, "kind": "guard_action", "message": msg, "severity": "warning",
          "gpu": 0, "detail": "{}"}
    full = event_lines([ev], 1, 500)[0].plain
    for width in range(30, len(full) + 1):
        line = event_lines([ev], 1, width)[0].plain
        assert len(line) <= width
        if line != full:
            kept = line.removesuffix("…")
            assert line.endswith("…") and full.startswith(kept), (width, line)
            assert full[len(kept)] in " ;,:", (width, line)  # cut where a word ends, never inside one
    assert ellipsize("alpha beta gamma", 12) == "alpha beta…"
    assert ellipsize("alpha beta", 10) == "alpha beta"


async def test_enter_shows_an_event_whole_and_arrows_walk_the_events():
    from gpuwatch.ui.screens import EventScreen

    src = ReplaySource(RAMP)
    app = make_app(src)
    async with app.run_test(size=(80, 24)) as pilot:
        for _ in range(3):
            await pilot.press("n")
        await pilot.press("enter")
        assert isinstance(app.screen, EventScreen)
        body = str(app.screen.query_one("#event-body").render())
        oom = src.events_df.filter(src.events_df["kind"] == "oom")["message"][0]
        assert oom in body  # the whole message, however long
        await pilot.press("up")
        assert "workload_start" in str(app.screen.query_one("#event-body").render())
        await pilot.press("escape")
        assert not isinstance(app.screen, EventScreen)


async def test_notifications_never_cover_the_header_at_80x24():
    """Issue 17 (11): n/N and 16x playback piled notifications up over the header."""
    src = ReplaySource(RAMP)
    app = make_app(src)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press(*["plus"] * 8, *["n"] * 12, *["N"] * 4, "l", "l")
        await pilot.pause(0.2)
        for x in range(0, 80, 4):
            widget, _ = app.screen.get_widget_at(x, 0)
            assert widget.id == "header", (x, widget)
        assert len(app._notifications) <= 1


async def test_mark_is_a_live_key_only():
    """Issue 17 (14): `m mark` was offered in replay, where it does nothing."""
    app = make_app(ReplaySource(RAMP))
    async with app.run_test(size=(80, 24)):
        assert "mark" not in {b.description for b in app.screen.active_bindings.values() if hasattr(b, "description")} \
            and all(b.binding.key != "m" for b in app.screen.active_bindings.values())


GUARD_PREFILL = RAMP.parent / "sample-h200-guard-ramp-prefill"


async def test_memory_is_measured_against_the_workload_cap():
    """Issue 20 (8): a run with --gpu-memory-limit 40GiB showed 39.0/140 GiB (28 %), not 39/40 GiB."""
    src = ReplaySource(GUARD_PREFILL)
    assert src.gpus[0].effective_limit_bytes == 40 * 2**30
    mem = src._by_gpu[0]["gpu_mem_used_bytes"]
    i = int(mem.arg_max())
    src.seek_to(int(src.times(0)[i]))
    used = mem[i] / 2**30
    app = make_app(src)
    async with app.run_test(size=(160, 50)):
        gpus = text(app, "gpus")
        assert f"{used:.1f}/40 GiB" in gpus and "/140 GiB" not in gpus, gpus
        assert f"{round(100 * used / 40)}%" in gpus


async def test_the_memory_history_of_a_capped_workload_beside_others_is_its_own():
    """Blind set 2905 (five capped workloads side by side on one GPU): the GPU panel reads the workload's own
    memory against its cap (`own`), and so do the history plot and the headroom line beside it - the whole
    GPU's memory there read 6.8 GiB against a 3.8 GiB cap. The plot's label is the panel's figure."""
    import re

    src = ReplaySource(RAMP.parent / "heldout-h100-2026-12-06-blind-2905" / "ho-03-small-decode-decode-ramp-b152-s512")
    src.seek_to(src.end_us)
    meta = src.gpus[0]
    row = src.latest()[meta.index]
    own = next(p["used_bytes"] for p in row["gpu_procs"] if p["pid"] == meta.pid) / 2**30
    whole = row["gpu_mem_used_bytes"] / 2**30
    assert whole > 1.5 * own  # the other processes' memory is on this GPU too
    app = make_app(src)
    async with app.run_test(size=(160, 50)):
        plots = text(app, "plots")
        label = re.search(r"^.*own GiB.*$", plots, re.M)
        assert label is not None and "mem GiB" not in plots, plots
        assert f"{own:.3g}" in plots, plots  # the last column's max is the panel's own figure
        gpus = text(app, "gpus")
        assert " own " in gpus and f" {own:.1f}/" in gpus, gpus


async def test_risk_plot_label_agrees_with_the_risk_panel():
    """Issue 20 (8): at 10:20:14.6 of the ramp the plot's label said 0.993 (the max of its last ten
    risk rows) while the panel and `gpuwatch score -o` said 0.05."""
    import re
    from datetime import datetime, timezone

    from gpuwatch.ui.launch import score_in_background

    src = ReplaySource(RAMP)
    score_in_background(src, None, False).join()
    src.seek_to(datetime(2026, 11, 30, 10, 20, 14, 600000, tzinfo=timezone.utc).timestamp() * 1e6)
    panel = src.risk(0, 1)[-1]["risk"]
    app = make_app(src)
    async with app.run_test(size=(80, 24)):
        plots = text(app, "plots")
        label = re.search(r"^risk .*?([0-9.]+)\s*$", plots, re.M).group(1)
        assert float(label) == pytest.approx(panel, abs=0.005), plots
        assert f"OOM {panel:.2f}" in text(app, "risk")


async def test_watch_source_replays_what_the_session_recorded():
    """Issue 17 (3, f): `watch --source recordings/sample-h200-ramp-train` showed `workload: none in this
    session`, `tok/s -`, none of its 5 OOMs, this machine's host line and the GPU name cut to `H200 [repl`."""
    from gpuwatch.recording.replay_backend import ReplayGpuBackend
    from gpuwatch.recording.source import LiveSource, RecordedFeed
    from gpuwatch.recording.window import GpuMeta
    from gpuwatch.telemetry.bus import Bus
    from gpuwatch.telemetry.sampler import Sampler
    from gpuwatch.ui.launch import attach_feed
    from uihelpers import T0, FixedHost

    bus = Bus()
    backend = ReplayGpuBackend(RAMP)
    fake = {"t": 0.0}
    s = Sampler(bus, backend, FixedHost(), clock=lambda: fake["t"], wall_us=lambda: T0 + int(fake["t"] * 1e6))
    g = backend.gpus[0]
    src = LiveSource(bus, [GpuMeta(0, g.name, g.mem_total_bytes, g.power_limit_w, g.temp_slowdown_c)], backend.label)

    class S:  # the part of a Session attach_feed and the App use
        workload, recorder, guard, model_note, workloads = None, None, None, "no risk model", []

        def status(self):
            return session_status(self.model_note)
    S.bus, S.source = bus, src
    attach_feed(S, RecordedFeed(bus, RAMP))
    s.slow_tick()
    app = make_app(src, session=S())
    async with app.run_test(size=(100, 30)) as pilot:
        for _ in range(9):  # the whole recording (81 s) and a bit of its next loop, fed as the ticks come
            for _ in range(100):
                s.tick()
                fake["t"] += 0.1
            src.poll()
            await pilot.pause(0.05)
        await pilot.press("space", "space")  # a full redraw now
        work = text(app, "work")
        assert "tok/s" in work and "none in this session" not in work and "- tok/s" not in work, work
        assert "GPU0 H200 " in text(app, "gpus") and "[repl" not in text(app, "gpus")
        kinds = [e.kind for e in bus.events.latest(1000)]
        assert kinds.count("oom") == 5, kinds
        assert "from vm" in text(app, "header")
        assert "host" in text(app, "host") and "126.0 GiB" not in text(app, "host")  # not FixedHost's figures


def test_the_end_of_a_session_shows_its_last_events():
    """Issue 17 (14): `--follow` (and replay at its end) never showed the final workload_stop and
    session_end events: they come after the last sample."""
    src = ReplaySource(RAMP)
    src.seek_to(src.end_us)
    kinds = [e["kind"] for e in src.events(4)]
    assert kinds[-2:] == ["workload_stop", "session_end"], kinds
    src.seek(-1)
    assert "session_end" not in [e["kind"] for e in src.events(4)]


def test_process_table_sorts_by_each_key():
    from gpuwatch.ui.render import PROC_SORTS, proc_lines, proc_rows, sort_procs

    latest = {0: {"gpu_procs": [{"pid": 300, "used_bytes": 5 * 2**30}, {"pid": 100, "used_bytes": 9 * 2**30}]},
              1: {"gpu_procs": [{"pid": 200, "used_bytes": 1 * 2**30, "sm_util_pct": 97, "mem_util_pct": 40}]}}
    names = {100: ("bob", "python train.py"), 200: ("alice", "vllm serve"), 300: ("carol", "a.out")}
    rows = proc_rows(latest, names)
    order = {k: [r["pid"] for r in sort_procs(rows, k)] for k in PROC_SORTS}
    assert order == {"memory": [100, 300, 200], "pid": [100, 200, 300], "user": [200, 100, 300],
                     "command": [300, 100, 200], "gpu": [100, 300, 200]}
    lines = [t.plain for t in proc_lines(rows, "memory", 10, 80)]
    assert "PID" in lines[0] and "USER" in lines[0] and "SM%" in lines[0]
    assert lines[1].split()[:4] == ["0", "100", "bob", "9"] and "python train.py" in lines[1]
    assert "97" in lines[3] and "40" in lines[3] and "vllm serve" in lines[3]


async def test_t_shows_every_process_of_the_live_gpus_and_o_sorts_them(monkeypatch):
    """Issue 17 (b): a process panel (PID, user, command, GPU memory), sortable by a key."""

    from gpuwatch.recording.source import LiveSource
    from gpuwatch.recording.window import GpuMeta
    from gpuwatch.telemetry.bus import Bus
    from gpuwatch.telemetry.nvml import NvmlBackend
    from gpuwatch.telemetry.sampler import Sampler

    from test_nvml_boundary import FakeDriver

    FakeDriver(monkeypatch)
    bus = Bus()
    s = Sampler(bus, NvmlBackend(), None)
    s.tick()
    procs = [p for t in bus.ticks.latest(1) for r in t.rows for p in (r.get("gpu_procs") or [])]
    src = LiveSource(bus, [GpuMeta(0, "NVIDIA H200", 141 * 2**30, 700.0, 89),
                           GpuMeta(1, "NVIDIA H200", 141 * 2**30, 700.0, 89)])
    app = make_app(src)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("t")
        panel = text(app, "events")
        assert "PID" in panel and "sorted by memory" in panel
        for p in procs:
            assert str(p["pid"]) in panel
        await pilot.press("o")
        assert "sorted by pid" in text(app, "events")
        await pilot.press("t")
        assert "PID" not in text(app, "events")


async def test_process_panel_shows_utilization_user_and_command_live_and_in_replay(tmp_path, monkeypatch):
    """Issue 17 (2): SM% and MEM% (NVML's per-process utilization), user and command are shown live and,
    recorded in samples.gpu_procs, in the replay of the session (they used to be '-' live and absent in
    replay)."""
    from gpuwatch.recording.source import LiveSource
    from gpuwatch.recording.window import GpuMeta
    from gpuwatch.telemetry.bus import Bus
    from gpuwatch.telemetry.nvml import NvmlBackend
    from gpuwatch.telemetry.procs import ProcInfo
    from gpuwatch.telemetry.sampler import Sampler

    from support.fake_nvml import FakeDriver
    from test_recording import _recorded_with_processes

    def rows_of(panel: str) -> list[list[str]]:
        return [ln.split() for ln in panel.splitlines() if ln.split()[:2] in (["0", "42"], ["1", "42"])]

    FakeDriver(monkeypatch)
    bus = Bus()
    s = Sampler(bus, NvmlBackend(), None)
    s.procinfo = ProcInfo(lambda pid: ("alice", "python train.py --batch 8"))
    s.slow_tick()
    s.tick()
    s.slow_tick()
    s.tick()
    gpus = [GpuMeta(0, "NVIDIA H200", 141 * 2**30, 700.0, 89), GpuMeta(1, "NVIDIA H200", 141 * 2**30, 700.0, 89)]
    app = make_app(LiveSource(bus, gpus))
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("t")
        live = rows_of(text(app, "events"))
    assert live == [["0", "42", "alice", "1", "GiB", "55", "20", "python", "train.py", "--batch", "8"],
                    ["1", "42", "alice", "1", "GiB", "35", "10", "python", "train.py", "--batch", "8"]], live

    src = ReplaySource(_recorded_with_processes(tmp_path, monkeypatch, compact=True))
    app = make_app(src)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("end", "t")
        assert rows_of(text(app, "events")) == live  # the replay shows what the live screen showed
        await pilot.press("home")
        first = rows_of(text(app, "events"))  # the first second: recorded before the first slow read
        assert [r[:3] for r in first] == [["0", "42", "-"], ["1", "42", "-"]] and first[0][5:7] == ["-", "-"]


def test_replay_with_a_named_model_checks_it_and_says_when_the_recorded_risk_is_shown(monkeypatch, tmp_path):
    """A new user: `replay SESSION --model /tmp/nope.joblib` on a session recorded with its risk opened the
    dashboard as if nothing were wrong (the named model was only read for sessions without risk). A named model
    is always read - a missing one is the one-line error it is elsewhere - and where the session's own risk is
    shown instead, that is said."""

    from gpuwatch.predict.model import ModelError
    from gpuwatch.ui import launch

    session = RAMP.parent / "heldout-h200-2026-12-06-blind-2906" / "ho-02-loop-cache-b6-s96-768-e2"
    assert not ReplaySource(session).risk_df.is_empty()  # recorded with its risk
    monkeypatch.setattr(launch, "require_terminal", lambda *a, **k: None)
    monkeypatch.setattr(launch, "_run_app", lambda app, session, status: 0)
    said: list[str] = []
    with pytest.raises(ModelError, match="nope.joblib"):
        launch.run_replay(session, model=tmp_path / "nope.joblib", status=said.append)
    assert launch.run_replay(session, model=ROOT / "models" / "risk.joblib", status=said.append) == 0
    assert any("not used" in s and "risk as recorded" in s for s in said), said
