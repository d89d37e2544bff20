"""Modal screens: help, quit confirmation, go-to-time, an event in full; and the screen a terminal
smaller than the dashboard needs gets instead of a clipped one."""

from __future__ import annotations

import json
from typing import Any

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.geometry import Size
from textual.screen import ModalScreen, Screen
from textual.widgets import Input, Static

# The help: (section, [(keys, what they do)]), shown as two aligned columns (the keys never run into
# their description; a long description wraps under itself).
Section = tuple[str, list[tuple[str, str]]]
LIVE_HELP: Section = ("Live", [
    ("space", "pause / resume the view (recording goes on)"),
    ("m", "mark this moment (an event in the recording)"),
    ("s", "show the plots of the next GPU"),
    ("enter", "the newest event in full (↑/↓ older/newer)"),
    ("t", "processes on every GPU instead of the events (o: sort by memory, pid, user, command, GPU)"),
    ("q", "quit (asks first while a workload runs)"),
])
WORKLOAD_HELP: Section = ("Workload", [
    ("+ / -", "batch size up / down (applied before the next step)"),
    ("p", "precision: cycle bf16 → fp16 → fp32 → tf32"),
    ("w", "pause / resume the workload"),
])
GUARD_HELP: Section = ("Guard", [
    ("G", "guard: on → observe (log only) → off"),
    ("a", "hand control back to the guard after a manual +/-/p"),
])
REPLAY_HELP: Section = ("Replay", [
    ("space", "play / pause"),
    (", / .", "one sample back / forward"),
    ("← / →", "seek -1 s / +1 s"),
    ("[ / ]", "seek -10 s / +10 s (also shift+← / shift+→)"),
    ("- / +", "speed 0.25x … 16x"),
    ("n / N", "next / previous event"),
    ("home / end", "start / end"),
    ("g", "go to a time (12:03:04, +90s, -5m, 50%)"),
    ("l", "loop on / off"),
    ("f", "back to the live edge (follow)"),
    ("s", "show the plots of the next GPU"),
    ("enter", "the event at the cursor in full (↑/↓ older/newer)"),
    ("t", "processes on every GPU instead of the events (o: sort)"),
    ("q", "quit"),
])
ALWAYS_HELP: list[tuple[str, str]] = [("?", "this help   (esc closes)"), ("ctrl+p", "command palette")]


def help_table(sections: list[Section]) -> Table:
    """The sections as one grid: a bold title, then a key column as wide as the widest keys and the
    descriptions beside it; a blank row between sections; the keys that always work last."""
    width = max(len(k) for _, rows in sections for k, _ in rows + ALWAYS_HELP)
    grid = Table.grid(padding=(0, 2))
    grid.add_column(width=width + 2, no_wrap=True)  # 2: the keys indented under the title
    grid.add_column(ratio=1)
    for i, (title, rows) in enumerate(sections):
        if i:
            grid.add_row("", "")
        grid.add_row(Text(title, style="bold"), "")
        for keys, what in rows:
            grid.add_row(Text(f"  {keys}"), Text(what))
    grid.add_row("", "")
    for keys, what in ALWAYS_HELP:
        grid.add_row(Text(f"  {keys}"), Text(what))
    return grid


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "close")]

    def __init__(self, mode: str, workload: bool = False, guard: bool = False) -> None:
        super().__init__()
        self.mode, self.workload, self.guard = mode, workload, guard

    def sections(self) -> list[Section]:
        if self.mode == "live":  # only the keys that do something in this run
            return [LIVE_HELP] + ([WORKLOAD_HELP] if self.workload else []) + ([GUARD_HELP] if self.guard else [])
        return [REPLAY_HELP]

    def compose(self) -> ComposeResult:
        yield Vertical(Static(help_table(self.sections()), id="help-body"), id="dialog")


class ConfirmQuit(ModalScreen[bool]):
    BINDINGS = [Binding("y", "yes", "yes"), Binding("n,escape", "no", "no")]

    def compose(self) -> ComposeResult:
        yield Vertical(Static("A workload is running. Stop it and quit?  [b]y[/b]es / [b]n[/b]o"), id="dialog")

    def action_yes(self) -> None:
        self.dismiss(True)

    def action_no(self) -> None:
        self.dismiss(False)


class GotoScreen(ModalScreen[str | None]):
    BINDINGS = [Binding("escape", "cancel", "cancel")]

    def compose(self) -> ComposeResult:
        yield Vertical(Static("Go to (HH:MM:SS UTC, +90s, -5m, 50%):"), Input(id="goto"), id="dialog")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip())

    def action_cancel(self) -> None:
        self.dismiss(None)


class EventScreen(ModalScreen[None]):
    """One event whole: the line the events panel ellipsizes, wrapped, and every detail recorded with
    it; ↑/↓ move to the older/newer event of those the panel had."""

    BINDINGS = [Binding("escape,enter,q", "dismiss", "close"), Binding("up,k", "move(-1)", "older"),
                Binding("down,j", "move(1)", "newer")]

    def __init__(self, events: list[dict[str, Any]], index: int = -1) -> None:
        super().__init__()
        self.events = events
        self.index = index % len(events) if events else 0

    def compose(self) -> ComposeResult:
        yield Vertical(Static(self._body(), id="event-body", markup=False), id="dialog")

    def _body(self) -> Text:
        from gpuwatch.ui.render import SEVERITY_STYLE, event_text

        if not self.events:
            return Text("no events at this moment", style="dim")
        e = self.events[self.index]
        t = Text(event_text(e), style=SEVERITY_STYLE.get(e.get("severity"), ""))
        try:
            detail = json.loads(e.get("detail") or "{}")
        except (TypeError, ValueError):
            detail = {}
        for k, v in (detail.items() if isinstance(detail, dict) else []):
            t.append(f"\n  {k}: {v if isinstance(v, (str, int, float)) or v is None else json.dumps(v)}", style="")
        t.append(f"\n\n  event {self.index + 1} of {len(self.events)}   ↑/↓ older/newer   esc closes", style="dim")
        return t

    def action_move(self, step: int) -> None:
        if self.events:
            self.index = min(max(self.index + step, 0), len(self.events) - 1)
            self.query_one("#event-body", Static).update(self._body())


MIN_SIZE = Size(80, 24)  # the panels, the footer and the help are laid out for this much


class TooSmallScreen(Screen[None]):
    """Below MIN_SIZE the panels would be cut and the help clipped mid-word with its close key out of
    sight: this says so instead, until the terminal is resized back (the App takes it away); q still
    quits (asking first while a workload runs), the dashboard goes on underneath."""

    BINDINGS = [Binding("q", "quit_app", "quit")]

    def __init__(self, size: Size, on_quit) -> None:
        super().__init__()
        self.term_size, self.on_quit = size, on_quit

    def compose(self) -> ComposeResult:
        yield Static(self._body(), id="too-small")

    def _body(self) -> Text:
        w, h = self.term_size
        t = Text(f"terminal too small ({w}x{h}, needs {MIN_SIZE.width}x{MIN_SIZE.height})", style="bold yellow")
        t.append("\nresize it, or q to quit", style="dim")
        return t

    def show_size(self, size: Size) -> None:
        self.term_size = size
        self.query_one("#too-small", Static).update(self._body())

    def on_screen_resume(self) -> None:
        """Back on top (a question asked over it was answered) in a terminal resized meanwhile."""
        w, h = self.app.size
        if w >= MIN_SIZE.width and h >= MIN_SIZE.height:
            self.call_later(self.dismiss)

    def action_quit_app(self) -> None:
        self.on_quit()
