"""Modal screens: help, quit confirmation, go-to-time."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Static

LIVE_HELP = """[b]Live[/b]
  space      pause / resume the view (recording goes on)
  m          mark this moment (an event in the recording)
  s          show the plots of the next GPU
  q          quit (asks first while a workload runs)"""

WORKLOAD_HELP = """
[b]Workload[/b]
  + / -      batch size up / down (applied before the next step)
  p          precision: cycle bf16 → fp16 → fp32 → tf32
  w          pause / resume the workload"""

GUARD_HELP = """
[b]Guard[/b]
  G          guard: on → observe (log only) → off
  a          hand control back to the guard after a manual +/-/p"""

REPLAY_HELP = """[b]Replay[/b]
  space      play / pause
  , / .      one sample back / forward
  ← / →      seek -1 s / +1 s
  [ / ]      seek -10 s / +10 s (also shift+← / shift+→)
  - / +      speed 0.25x … 16x
  n / N      next / previous event
  home / end start / end
  g          go to a time (12:03:04, +90s, -5m, 50%)
  l          loop on / off
  f          back to the live edge (follow)
  s          show the plots of the next GPU
  q          quit"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "close")]

    def __init__(self, mode: str, workload: bool = False, guard: bool = False) -> None:
        super().__init__()
        self.mode, self.workload, self.guard = mode, workload, guard

    def compose(self) -> ComposeResult:
        body = REPLAY_HELP
        if self.mode == "live":  # only the keys that do something in this run
            body = LIVE_HELP + (WORKLOAD_HELP if self.workload else "") + (GUARD_HELP if self.guard else "")
        yield Vertical(Static(body + "\n\n  ?          this help   (esc closes)"), id="dialog")


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
