"""The dashboard's text whole at 80x24 (the smallest size it is laid out for), and a plain "terminal too
small" screen below it instead of panels and a help cut mid-word. Checked on the rendered screen."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

from gpuwatch.control.policy import GuardConfig
from gpuwatch.recording.source import ReplaySource
from gpuwatch.runtime import session_status
from gpuwatch.ui.app import make_app
from gpuwatch.ui.screens import HelpScreen, TooSmallScreen

from conftest import RAMP
from uihelpers import live_source, screen_lines, settled_lines

GUARDED = RAMP.parent / "sample-h200-guard-ramp-train"
REPLAY_FOOTER = "q quit  ? help  space play/pause  [ ] ±10s  - + speed  n next event  g go to"


def _cut(line: str) -> bool:
    return line.rstrip().endswith(("…", "▏")) or "▏" in line


async def test_replay_footer_is_whole_at_80_columns():
    """It read `+ faste▏^p palette`: the palette's key covered the last keys."""
    app = make_app(ReplaySource(RAMP))
    async with app.run_test(size=(80, 24)) as pilot:
        footer = (await settled_lines(pilot, app, lambda ls: bool(ls and ls[-1].strip())))[-1]
        assert footer.strip() == REPLAY_FOOTER, footer
    app = make_app(ReplaySource(RAMP))
    async with app.run_test(size=(160, 50)) as pilot:  # room for it: the palette's key too
        footer = (await settled_lines(pilot, app, lambda ls: bool(ls and ls[-1].strip())))[-1]
        assert footer.strip().startswith(REPLAY_FOOTER) and footer.rstrip().endswith("^p palette"), footer


def _fake_session(bus):
    """The part of a Session the live screen reads: a running workload and a guard, so that every
    live key is in the footer."""
    w = SimpleNamespace(state="running", cfg=SimpleNamespace(preset="v2-lite", mode="train", gpu_index=None),
                        device_name="H200", unrecovered=None, manual=False, batch=8, precision="bf16", paused=False,
                        describe=lambda: {"preset": "v2-lite", "mode": "train", "gpu_index": None})
    g = SimpleNamespace(cfg=GuardConfig(mode="on", rule="model"), actions=0, misses=0, unable=None, stopped={})
    return SimpleNamespace(workload=w, workloads=[w], guard=g, recorder=None, model_note="no risk model", bus=bus,
                           status=lambda: session_status("no risk model", g, None, [w]))


async def test_live_footer_with_a_workload_and_a_guard_is_whole_at_80_columns():
    src, bus = live_source()
    app = make_app(src, session=_fake_session(bus))
    async with app.run_test(size=(80, 24)) as pilot:
        footer = (await settled_lines(pilot, app, lambda ls: bool(ls and ls[-1].strip())))[-1]
        assert not _cut(footer), footer
        for key in ("q quit", "? help", "space pause view", "+ batch+", "- batch-", "p precision", "m mark"):
            assert key in footer, (key, footer)


async def test_process_panel_header_is_whole_at_80_columns():
    """It read `(sorted by memory; o: so…`."""
    src, _ = live_source()
    app = make_app(src)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("t")
        for key in ("memory", "pid", "user", "command", "gpu"):
            head = next(ln for ln in screen_lines(app) if "PID" in ln and "COMMAND" in ln)
            assert head.rstrip().endswith(f"sorted by {key}; o: sort"), head
            await pilot.press("o")


async def test_help_is_two_aligned_columns_and_whole_at_80x24():
    """`home / end start / end` ran together; every key now has its description in one column."""
    app = make_app(ReplaySource(RAMP))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        lines = screen_lines(app)
        screen = "\n".join(lines)
        assert "home / end  start / end" in screen, screen
        rows = {"space": "play / pause", "home / end": "start / end", "enter": "the event at the cursor",
                "q": "quit", "?": "this help", "ctrl+p": "command palette"}
        cols = set()
        for keys, what in rows.items():
            line = next(ln for ln in lines if f" {keys} " in ln and what in ln)
            cols.add(line.index(what))
        assert len(cols) == 1, (cols, screen)  # the descriptions start in one column
        assert "esc closes" in screen and "Replay" in screen  # the top and the bottom of the help: all of it


async def test_live_help_with_every_section_fits_80x24():
    src, bus = live_source()
    app = make_app(src, session=_fake_session(bus))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("question_mark")
        screen = "\n".join(screen_lines(app))
        for what in ("Live", "Workload", "Guard", "pause / resume the view", "hand control back", "esc closes"):
            assert what in screen, (what, screen)


async def test_risk_line_says_once_why_there_is_no_risk():
    """At the start of the guarded replay it read `risk: not scored yet at this moment; risk no risk
    scored; headroom 100.0% (100 …`: two reasons, and cut."""
    app = make_app(ReplaySource(GUARDED))
    async with app.run_test(size=(80, 24)) as pilot:
        lines = await settled_lines(pilot, app, lambda ls: any(ln.startswith("risk") for ln in ls))
        line = next(ln for ln in lines if ln.startswith("risk"))
        assert line.startswith("risk: not scored yet at this moment; headroom "), line
        assert "no risk scored" not in line and line.count("risk") == 1 and not _cut(line), line
    src, _ = live_source()  # no model anywhere: said once too
    app = make_app(src)
    async with app.run_test(size=(80, 24)) as pilot:
        lines = await settled_lines(pilot, app, lambda ls: any(ln.startswith("risk") for ln in ls))
        line = next(ln for ln in lines if ln.startswith("risk"))
        assert line.startswith("risk: no risk scored; headroom "), line


async def test_a_terminal_smaller_than_80x24_says_so_until_resized_back():
    """At 60x20 the help was clipped mid-word with no way to close it in sight."""
    src = ReplaySource(RAMP)
    app = make_app(src)
    async with app.run_test(size=(60, 20)) as pilot:
        await pilot.pause(0.1)
        assert isinstance(app.screen, TooSmallScreen)
        assert "terminal too small (60x20, needs 80x24)" in "\n".join(screen_lines(app))
        await pilot.press("question_mark", "space")  # the dashboard's keys wait; the screen stays
        assert isinstance(app.screen, TooSmallScreen) and not src.playing
        await pilot.resize_terminal(79, 30)
        await pilot.pause(0.1)
        assert "terminal too small (79x30, needs 80x24)" in "\n".join(screen_lines(app))
        await pilot.resize_terminal(80, 24)
        await pilot.pause(0.1)
        assert not isinstance(app.screen, TooSmallScreen)
        assert "REPLAY" in screen_lines(app)[0]
        await pilot.press("question_mark")  # the help open, then the terminal shrinks, then grows back
        await pilot.resize_terminal(60, 20)
        await pilot.pause(0.1)
        assert isinstance(app.screen, TooSmallScreen)
        await pilot.resize_terminal(100, 30)
        await pilot.pause(0.1)
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        await pilot.resize_terminal(60, 20)
        await pilot.pause(0.1)
        await pilot.press("q")  # q quits from the too-small screen
    assert app.return_code == 0


async def test_q_on_the_too_small_screen_asks_first_while_a_workload_runs():
    src, bus = live_source()
    app = make_app(src, session=_fake_session(bus))
    async with app.run_test(size=(60, 20)) as pilot:
        await pilot.pause(0.1)
        await pilot.press("q")
        screen = "\n".join(screen_lines(app))
        assert "Stop it and quit?" in screen and "yes / no" in screen, screen  # the question fits 60 columns
        await pilot.press("n")
        assert isinstance(app.screen, TooSmallScreen) and app.is_running
        await pilot.press("q", "y")
    assert app.return_code == 0


async def test_replay_of_a_session_without_its_steps_file_says_so(tmp_path):
    """Defect 4 (the replay half): a session whose meta.json names a workload but whose steps.parquet
    is gone showed `workload: recorded`, as if its steps were there."""
    d = tmp_path / "session"
    shutil.copytree(RAMP, d)
    (d / "steps.parquet").unlink()
    for path, want in ((d, "workload: steps table missing"), (RAMP, "workload: recorded")):
        app = make_app(ReplaySource(path))
        async with app.run_test(size=(80, 24)) as pilot:
            lines = await settled_lines(pilot, app, lambda ls: any(ln.startswith("work") for ln in ls))
            work = next(ln for ln in lines if ln.startswith("work"))
            assert work.strip() == want, work


def test_a_capped_workload_beside_others_shows_its_own_memory_against_its_cap():
    """Blind set 2905 ran five capped workloads side by side on one GPU: the GPU panel read `mem 6.8/4 GiB 180%`
    - both listed processes' memory against this one's 3.79 GiB cap. With a cap and the workload's process
    listed, the bar is that process's own memory (`own`), and `procs` still counts the whole GPU's."""
    from gpuwatch.ui import render as R

    src = ReplaySource(RAMP.parent / "heldout-h100-2026-12-06-blind-2905" / "ho-03-small-decode-decode-ramp-b152-s512")
    src.seek_to(src.end_us)
    meta = src.gpus[0]
    row = src.latest()[meta.index]
    line = R.gpu_lines(row, meta, 80, False)[0].plain
    own = next(p["used_bytes"] for p in row["gpu_procs"] if p["pid"] == meta.pid)
    assert len(row["gpu_procs"]) == 2 and " own " in line and " mem " not in line, line
    pct = int(line.rsplit(" ", 1)[1].rstrip("%"))
    # NVML's per-process figure holds the CUDA context beside what torch's cap limits: 104 % here, not 180 %
    assert pct == round(100 * own / meta.effective_limit_bytes) and pct < 110, line
    # given torch's reserved bytes after the last step, the bar meets the cap plus the memory outside torch - the
    # limit the risk and `gpuwatch report` measure against: a new user read 104 % as over the cap
    reserved = float(src.steps_df["torch_reserved_bytes"][-1])
    line = R.gpu_lines(row, meta, 80, False, reserved)[0].plain
    pct = int(line.rsplit(" ", 1)[1].rstrip("%"))
    assert pct <= 100 and f"/{(meta.effective_limit_bytes + own - reserved) / 2**30:.1f} GiB" in line, line
    meta_uncapped = type(meta)(meta.index, meta.name, meta.mem_total_bytes, pid=meta.pid)
    assert " mem " in R.gpu_lines(row, meta_uncapped, 80, False)[0].plain  # no cap: the GPU's memory, as before


async def test_after_a_jump_the_event_list_ends_with_the_newest_event_at_80x24():
    """A new user, replaying set 2906's cache loop: after a jump the event list stopped two events short of the
    cursor - drawn for the rows a formula gave (10 at 80x24, 8 on screen), its newest rows fell below the panel.
    The list is drawn for the panel's own height, again whenever it changes size."""
    for size in ((80, 24), (100, 30)):
        src = ReplaySource(RAMP.parent / "heldout-h200-2026-12-06-blind-2906" / "ho-02-loop-cache-b6-s96-768-e2")
        app = make_app(src)
        async with app.run_test(size=size) as pilot:
            await pilot.pause(0.3)
            src.playing = False
            ev = src.events_df
            src.seek_to(int(ev["ts"][ev.height // 2].timestamp() * 1e6) + 2_000_000)
            app.screen.refresh_data(force=True)
            await pilot.pause(0.3)
            newest = src.events(1)[-1]["kind"]
            panel = app.screen.query_one("#events")
            lines = await settled_lines(pilot, app, lambda ls: panel.n_lines <= panel.content_size.height)
            assert panel.n_lines <= panel.content_size.height, (size, panel.n_lines, panel.content_size)
            listed = [ln.split()[1] for ln in lines if ln[:2].isdigit() and ln[2:3] == ":"]
            assert listed and listed[-1] == newest, (size, listed, newest)


def test_a_capped_workload_not_yet_listed_beside_others_reads_the_whole_gpu_against_the_card():
    """Set 2905's decode ramp for its first 9.6 s: NVML lists the other workloads on the GPU but not this one yet.
    The bar read `mem 12.6/4 GiB 334%` (the whole GPU against this workload's cap); now the whole GPU against
    the card, and the history plot leaves those samples out instead of mixing them with the process's own."""
    from gpuwatch.recording.frames import used_against_cap
    from gpuwatch.ui import render as R

    src = ReplaySource(RAMP.parent / "heldout-h100-2026-12-06-blind-2905" / "ho-03-small-decode-decode-ramp-b152-s512")
    meta = src.gpus[0]
    procs = src.samples(meta.index)["gpu_procs"].to_list()
    i = next(k for k, p in enumerate(procs) if p and len(p) > 1 and all(q["pid"] != meta.pid for q in p))
    src.seek_to(int(src.times(meta.index)[i]))
    row = src.latest()[meta.index]
    line = R.gpu_lines(row, meta, 80, False)[0].plain
    pct = int(line.rsplit(" ", 1)[1].rstrip("%"))
    assert " mem " in line and f"/{meta.mem_total_bytes / 2**30:.0f} GiB" in line and pct < 100, line
    used = src.samples(meta.index)["gpu_mem_used_bytes"].to_list()
    vals, kind = used_against_cap(used[: i + 200], procs[: i + 200], meta.pid, True)
    assert kind == "own" and vals[i] is None and any(v is not None for v in vals)
