"""The app: a live screen and a replay screen (replay and follow), each with its own keys and help, over the
same panels (ui/dashboard.py), reading a TelemetrySource; the App picks the screen and turns a crash into one
line."""

from __future__ import annotations

from textual.app import App
from textual.binding import Binding
from textual.screen import Screen

from gpuwatch.contract import GuardMode, Precision
from gpuwatch.recording.source import TelemetrySource
from gpuwatch.units import parse_goto
from gpuwatch.ui import render as R
from gpuwatch.ui.dashboard import Dashboard
from gpuwatch.ui.screens import MIN_SIZE, ConfirmQuit, GotoScreen, TooSmallScreen

PRECISION_CYCLE: tuple[Precision, ...] = ("bf16", "fp16", "fp32", "tf32")  # the p key's order (contract.PRECISIONS)
GUARD_CYCLE: tuple[GuardMode, ...] = ("on", "observe", "off")  # the G key's order (contract.GUARD_MODES)
# The footer whole at 80 columns: each pair of keys under one word
SEEK = Binding.Group("±10s")
SPEED = Binding.Group("speed")


class LiveScreen(Dashboard):
    """Live (and a recording played as live by `watch --source`): the workload's and the guard's keys.
    Panels redraw once a second (keys and new events at once): what a 4 Hz redraw cost was most of the
    dashboard's CPU (benchmarks/bench_tui.py cost, docs/BENCHMARKS.md)."""

    REDRAW_EVERY_S = 1.0

    BINDINGS = [
        Binding("space", "toggle_pause_view", "pause view"),
        Binding("plus,equals_sign", "batch_up", "batch+"),
        Binding("minus", "batch_down", "batch-"),
        Binding("p", "precision", "precision"),
        Binding("w", "workload_pause", "workload ‖", show=False),
        Binding("m", "mark", "mark"),
        Binding("G", "guard_mode", "guard", show=False),
        Binding("a", "hand_back", "hand back", show=False),
    ]

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in ("batch_up", "batch_down", "precision", "workload_pause", "hand_back") and self.workload is None:
            return False
        if action == "guard_mode" and (self.session is None or self.session.guard is None):
            return False
        if action == "mark" and (self.session is None or self.session.bus is None):
            return False
        return True

    def header_extra(self) -> str:
        return self.session.status().recorder_header() if self.session is not None else "not recording"

    def action_toggle_pause_view(self) -> None:
        self.view_paused = not self.view_paused
        self.refresh_data(force=True)

    def action_batch_up(self) -> None:
        b = self.workload.batch
        self._set_batch(max(b + 1, int(b * 1.25)))

    def action_batch_down(self) -> None:
        self._set_batch(max(1, int(self.workload.batch * 0.8)))

    def _set_batch(self, batch: int) -> None:
        self.workload.set_batch_size(batch)
        self.note(f"batch → {batch} (next step)")

    def action_precision(self) -> None:
        cur = self.workload.precision
        nxt = PRECISION_CYCLE[(PRECISION_CYCLE.index(cur) + 1) % len(PRECISION_CYCLE)] if cur in PRECISION_CYCLE else "bf16"
        self.workload.set_precision(nxt)
        self.note(f"precision → {nxt} (next step)")

    def action_workload_pause(self) -> None:
        w = self.workload
        if w.state == "paused" or w.paused:
            w.resume()
            self.note("workload resumed")
        else:
            w.pause()
            self.note("workload paused (after this step)")

    def action_guard_mode(self) -> None:
        g = self.session.guard
        nxt = GUARD_CYCLE[(GUARD_CYCLE.index(g.cfg.mode) + 1) % len(GUARD_CYCLE)]
        g.set_mode(nxt)
        self.note(f"guard {nxt}")
        self.refresh_data(force=True)

    def action_hand_back(self) -> None:
        self.workload.hand_back()
        self.note("control handed back to the guard" if self.session.guard else "no guard in this run")

    def action_mark(self) -> None:
        self.session.bus.emit("mark", "operator mark")
        self.note("marked")


class ReplayScreen(Dashboard):
    """A recorded session (or one still being written, followed): time travel."""

    BINDINGS = [
        Binding("space", "play", "play/pause"),
        Binding("left", "seek(-1)", "-1s", show=False),
        Binding("right", "seek(1)", "+1s", show=False),
        Binding("left_square_bracket,shift+left", "seek(-10)", "-10s", group=SEEK),
        Binding("right_square_bracket,shift+right", "seek(10)", "+10s", group=SEEK),
        Binding("comma", "step(-1)", "step-", show=False),
        Binding("full_stop", "step(1)", "step+", show=False),
        Binding("minus", "speed(0)", "slower", group=SPEED),
        Binding("plus,equals_sign", "speed(1)", "faster", group=SPEED),
        Binding("n", "event(1)", "next event"),
        Binding("N", "event(-1)", "prev event", show=False),
        Binding("g", "goto", "go to"),
        Binding("home", "home", "start", show=False),
        Binding("end", "end", "end", show=False),
        Binding("l", "loop", "loop", show=False),
        Binding("f", "live_edge", "live edge", show=False),
    ]
    HELP_MODE = "replay"

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "live_edge":
            return bool(self.source.follow)
        return True

    def header_extra(self) -> str:
        src = self.source
        pos = (src.cursor_us() or 0) - src.start_us
        total = src.end_us - src.start_us
        state = "▶" if src.playing else "‖"
        extra = f"{state} {src.speed:g}x  {pos / 1e6:,.1f}/{total / 1e6:,.1f} s" + ("  loop" if src.loop else "")
        if src.follow:
            if src.writer_done:
                extra += "  writer finished"
            elif src.writer_gone:
                extra += "  writer gone (not closed)"
            else:
                extra += "  at live edge" if src.at_edge else "  f: to live edge"
        return extra

    def _moved(self, note: str | None = None) -> None:
        if note:
            self.note(note, timeout=2)
        self.refresh_data(force=True)

    def action_play(self) -> None:
        self.source.toggle_play()
        self._moved()

    def action_seek(self, seconds: float) -> None:
        self.source.seek(seconds)
        self._moved()

    def action_step(self, n: int) -> None:
        self.source.step(n)
        self._moved()

    def action_speed(self, faster: int) -> None:
        self._moved(f"speed {self.source.set_speed(bool(faster)):g}x")

    def action_event(self, direction: int) -> None:
        ev = self.source.jump_event(direction)
        self._moved(R.ellipsize(f"{ev['kind']}: {ev['message']}", 60) if ev else "no more events")

    def action_home(self) -> None:
        self.source.seek_to(self.source.start_us)
        self._moved()

    def action_end(self) -> None:
        self.source.seek_to(self.source.end_us)
        self._moved()

    def action_loop(self) -> None:
        self.source.loop = not self.source.loop
        self._moved(f"loop {'on' if self.source.loop else 'off'}")

    def action_live_edge(self) -> None:
        self.source.seek_to(self.source.end_us)
        self.source.playing = True
        self._moved("following the live edge")

    def action_goto(self) -> None:
        def done(value: str | None) -> None:
            if value:
                src = self.source
                t = parse_goto(value, src.start_us, src.end_us, src.cursor_us() or src.start_us)
                if t is None:
                    self.note(f"cannot go to {value!r}", severity="error")
                else:
                    self.source.seek_to(t)
                    self._moved()
        self.app.push_screen(GotoScreen(), done)


class GpuwatchApp(App):
    """The App only picks the screen (live or replay) and turns a crash into one line."""

    CSS_PATH = "app.tcss"
    TITLE = "gpuwatch"
    # Textual's own ctrl+q quit at once, workload or not, where q asks first while a workload runs (a new user's
    # finding): both go through the dashboard's question
    BINDINGS = [Binding("ctrl+q", "request_quit", "quit", show=False, priority=True)]

    def action_request_quit(self) -> None:
        if isinstance(self.screen, ConfirmQuit):
            return  # already asking
        if self.dashboard in self.screen_stack:
            self.dashboard.action_request_quit()
        else:
            self.exit()

    def __init__(self, source: TelemetrySource, session=None, refresh_hz: float = 4.0,
                 interval_s: float | None = None) -> None:
        super().__init__()
        self.crashed: BaseException | None = None
        self.source, self.session = source, session
        kind = LiveScreen if source.kind == "live" else ReplayScreen
        self.dashboard: Dashboard = kind(source, session, refresh_hz,
                                         interval_s or getattr(source, "interval_s", 0.1))

    def get_default_screen(self) -> Screen:
        return self.dashboard

    def on_resize(self, event) -> None:
        self.fit_to(event.size)

    def fit_to(self, size) -> None:
        """Smaller than MIN_SIZE: the too-small screen on top (its size kept current); big enough again:
        taken away, showing what was under it (the dashboard, or the help that was open)."""
        if self.dashboard not in self.screen_stack:  # not yet shown: its on_mount comes back here
            return
        small = size.width < MIN_SIZE.width or size.height < MIN_SIZE.height
        top = self.screen
        if small and isinstance(top, TooSmallScreen):
            top.show_size(size)
        elif small and not any(isinstance(s, TooSmallScreen) for s in self.screen_stack):
            self.push_screen(TooSmallScreen(size, self.dashboard.action_request_quit))
        elif not small and isinstance(top, TooSmallScreen):
            self.pop_screen()

    @property
    def mode(self) -> str:
        return "live" if self.source.kind == "live" else "replay"

    @property
    def plot_gpu(self):
        return self.dashboard.plot_gpu

    def _print_error_renderables(self) -> None:
        """An uncaught exception: the caller writes the traceback to a log file and prints one line
        (Textual would print a full traceback to the restored terminal)."""
        if self._exception is not None:
            self.crashed = self._exception
            self._exit_renderables.clear()
            return
        super()._print_error_renderables()


def make_app(source: TelemetrySource, session=None, **kw) -> GpuwatchApp:
    """The App with its collaborators injected: tests pass a replay or a hand-fed live source."""
    return GpuwatchApp(source, session=session, **kw)
