"""The dashboard's panels and their refresh, shared by the live and the replay screen (ui/app.py): what each panel
shows, read from a TelemetrySource - the GPU, history, workload, risk, host and event panels - and the keys both
screens have. Data collection never runs here; a screen pulls the latest samples at 4 Hz and re-renders only the
panels whose text changed; the history plots (the costliest panel) at most once a second of data."""

from __future__ import annotations

import time
from typing import Any

import polars as pl
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer, Static

from gpuwatch.recording.frames import shown_limit, used_against_cap
from gpuwatch.recording.source import TelemetrySource
from gpuwatch.ui import render as R
from gpuwatch.ui.screens import ConfirmQuit, EventScreen, HelpScreen

# Textual's "^p palette" in the footer only where there is room for it beside the keys (ctrl+p opens the
# palette at any width; the help says so).
PALETTE_MIN_WIDTH = 100
PANELS = ("header", "gpus", "plots", "work", "risk", "host", "events")


class Panel(Static):
    """One panel of the dashboard: its lines cut to the width (with an ellipsis), redrawn only when
    what it shows changed."""

    def __init__(self, wid: str) -> None:
        super().__init__(id=wid, markup=False)
        self.key: str | None = None
        self.n_lines = -1

    def show(self, text: Text, width: int) -> bool:
        lines = text.split("\n")
        for line in lines:
            line.truncate(width, overflow="ellipsis")
        text = Text("\n").join(lines)
        text.no_wrap = True  # each line is cut to the width above: never wrapped into two (a list one row too
        # long for its panel scrolled its newest row out of sight)
        key = text.plain + str(len(text.spans))
        if key == self.key:
            return False
        self.key = key
        # the same number of lines (each cut to the width): the same size, so no layout pass
        self.update(text, layout=len(lines) != self.n_lines)
        self.n_lines = len(lines)
        return True

    def on_resize(self, event) -> None:
        """The event list takes the rows the panels above leave: when they grow or shrink it is drawn again
        for its new height (drawn for the old one, its newest rows - the ones a jump lands on - fell below)."""
        if self.id == "events" and isinstance(self.screen, Dashboard):
            self.screen.redraw_bottom()


class Dashboard(Screen):
    """The panels and their refresh, shared by the live and the replay screen."""

    BINDINGS = [
        Binding("q", "request_quit", "quit"),
        Binding("question_mark", "help", "help"),
        Binding("s", "next_gpu", "next GPU", show=False),
        Binding("enter", "show_event", "event", show=False),
        Binding("t", "toggle_procs", "processes", show=False),
        Binding("o", "proc_sort", "sort", show=False),
    ]
    HELP_MODE = "live"

    def __init__(self, source: TelemetrySource, session=None, refresh_hz: float = 4.0,
                 interval_s: float = 0.1) -> None:
        super().__init__()
        self.source, self.session = source, session
        self.refresh_hz, self.interval_s = refresh_hz, interval_s
        self.view_paused = False
        self.plot_gpu = source.gpus[0].index if source.gpus else None
        self._last_size = None
        self._plots_key: tuple | None = None
        self._last_full = 0.0
        self._last_event: Any = None
        self.show_procs = False  # the bottom panel: events, or every process on every GPU (t)
        self.proc_sort = R.PROC_SORTS[0]
        self._names: dict[int, tuple[str, str]] = {}
        self._steps_missing: bool | None = None  # a replayed session without its steps file (looked up once)

    @property
    def workload(self):
        return self.session.workload if self.session is not None else None

    def compose(self) -> ComposeResult:
        for wid in PANELS:
            yield Panel(wid)
        yield Footer()

    def on_mount(self) -> None:
        self.refresh_data(force=True)
        self.set_interval(1 / self.refresh_hz, self.refresh_data)
        self.call_after_refresh(lambda: self.app.fit_to(self.app.size))  # started in a small terminal

    @property
    def wide(self) -> bool:
        w, h = self.size
        return w >= 120 and h >= 40

    def note(self, message: str, **kw) -> None:
        """A notification that replaces the previous one (seeking, stepping through events or fast
        playback would otherwise stack them up over the header)."""
        self.app.clear_notifications()
        self.notify(message, **kw)

    # -- refresh -------------------------------------------------------------------------------------------
    # Seconds between full redraws while nothing but new samples arrives (None: at every pull). Each
    # redraw costs the Textual compositor milliseconds of CPU; new events are shown at the next pull.
    REDRAW_EVERY_S: float | None = None

    def refresh_data(self, force: bool = False) -> None:
        changed = self.source.poll()
        if self.size != self._last_size:  # a resize re-lays out everything once
            self._last_size, force = self.size, True
            self._plots_key = None
            self.set_class(self.wide, "wide")
            self.query_one(Footer).show_command_palette = self.size.width >= PALETTE_MIN_WIDTH
        if self.view_paused and not force:
            self._set("header", self._header())
            return
        if not (changed or force):
            return
        now = time.monotonic()
        if not force and self.REDRAW_EVERY_S and now - self._last_full < self.REDRAW_EVERY_S:
            last = self.source.events(1)
            if last and last[-1].get("ts") != self._last_event and not self.show_procs:  # news: show it now
                self._last_event = last[-1].get("ts")
                h = self._events_height()
                self._set("events", Text("\n").join(R.event_lines(self.source.events(h), h, self._width())))
            return
        self._last_full = now
        width = self._width()
        latest = self.source.latest()
        rows = [latest.get(g.index) for g in self.source.gpus]
        gpu_text = Text("\n").join(line for g, row in zip(self.source.gpus, rows)
                                   for line in R.gpu_lines(row, g, width, self.wide, self._reserved(g.index))) \
            if self.source.gpus \
            else Text("no GPU: CPU-only mode (host and workload panels still work)", style="yellow")
        self._set("header", self._header())
        self._set("gpus", gpu_text)
        meta = self._plot_meta()
        mem, own = self._mem(meta, 300) if meta else (None, "gpu")  # the headroom fit's
        key = self._plots_moment()
        if force or key != self._plots_key:  # one column a second: rebuilt once a second of data
            self._plots_key = key
            self._set("plots", self._plots(width))
        risk = self._risk(mem, own)
        power = rows[0].get("gpu_power_w") if rows and rows[0] else None
        self._set("work", Text("\n").join(R.workload_lines(self.source.steps(200), self._workload_status(), power, self.wide)))
        host_row = next(iter(latest.values()), None)
        self._set("host", Text("\n").join(R.host_lines(host_row, width, self.wide)))
        self._set("risk", risk)
        self._bottom(latest, width)

    def redraw_bottom(self) -> None:
        """The bottom panel (events or processes) again, for its height now."""
        self._bottom(self.source.latest(), self._width())

    def _bottom(self, latest: dict, width: int) -> None:
        h = self._events_height()
        if self.show_procs:
            rows = R.proc_rows(latest, self._proc_names(latest))
            self._set("events", Text("\n").join(R.proc_lines(rows, self.proc_sort, h, width)))
        else:
            self._set("events", Text("\n").join(R.event_lines(self.source.events(h), h, width)))

    def _proc_names(self, latest: dict) -> dict[int, tuple[str, str]]:
        """User and command of each PID NVML reports that its sample does not carry yet (the sampler adds
        them once a second), looked up once (live: this machine's processes; a replay shows what was
        recorded)."""
        if self.source.kind != "live" or getattr(self.source, "feed", None) is not None:
            return {}
        import psutil

        for row in latest.values():
            for p in (row or {}).get("gpu_procs") or []:
                pid = p.get("pid")
                if pid is None or pid in self._names or p.get("user") is not None or p.get("command") is not None:
                    continue
                try:
                    proc = psutil.Process(pid)
                    self._names[pid] = (proc.username(), " ".join(proc.cmdline()) or proc.name())
                except (psutil.Error, OSError):
                    self._names[pid] = ("?", "? (not visible from here)")
        return self._names

    def _width(self) -> int:
        return self.size.width - (4 if self.wide else 0)

    def _events_height(self) -> int:
        """The rows the event list has on screen: the panel's own height once laid out (it takes what the
        others leave, so a formula over the others' rows went stale whenever one of them grew - at 80x24 it
        said 10 where 8 were shown, and the two newest events, the ones a jump had just landed on, were cut
        off below), the formula before the first layout."""
        h = self.query_one("#events", Panel).content_size.height
        if h > 0:
            return h
        return max(1, self.size.height - 14 - (len(self.source.gpus) - 1) * 3 - (12 if self.wide else 0))

    def _set(self, wid: str, text: Text) -> None:
        width = self.size.width - (4 if self.wide and wid not in ("header", "events") else 0)
        self.query_one(f"#{wid}", Panel).show(text, width)

    def header_extra(self) -> str:
        return ""

    def _header(self) -> Text:
        src = self.source
        return R.header(src.kind, src.label, src.cursor_us(), self.header_extra(), self.view_paused)

    def _plots_moment(self) -> tuple:
        """What the plots depend on: the cursor's second while time runs (live, playback: a column
        is a second, so nothing but the last column's max can change within one), the exact cursor
        when the user steps through a paused replay; the GPU shown; risk filled in after the fact."""
        src = self.source
        t = src.cursor_us() or 0
        running = src.kind == "live" or getattr(src, "playing", False)
        return (t // 1_000_000 if running else t, self.plot_gpu, getattr(src, "risk_note", None))

    def _plots(self, width: int) -> Text:
        """History plots, one column per second (the max of its samples, so no peak is hidden)."""
        g = self.plot_gpu
        src = self.source
        meta = self._plot_meta()
        height = 3 if self.wide else 1
        cols = 2 if self.wide and width >= 140 else 1
        label_w = 9
        plot_w = max(10, (width - label_w * cols - 2 * (cols - 1)) // cols - 8)
        k = max(1, round(1.0 / self.interval_s))
        n = plot_w * k

        def hist(col: str, scale: float = 1.0) -> list:
            return R.bucket_max(src.series(col, g, n), k, scale)
        specs: list[tuple[str, list, float | None, str]] = []
        labels: dict[str, float | None] = {}  # a plot whose label is not its last column's max
        if meta is not None:
            mem, own = self._mem(meta, n)
            total = self._mem_limit(meta, mem, own)  # the workload's cap (and its memory outside torch), or the card
            free = [None if v is None or not total else max(0.0, 1 - v / total) for v in mem]
            rows = src.risk(g, n)
            end = src.cursor_us()
            if rows and end is not None:
                # by time (risk rows do not come one per sample); the label is the latest risk, the
                # same figure as the risk panel beside it
                last = ("risk", R.bucket_time(rows, end, plot_w), 1.0, "bright_red")
                labels["risk"] = rows[-1].get("risk")
            else:
                last = ("headroom", R.bucket_min(free, k), 1.0, "cyan")
            specs += [("util %", hist("gpu_util_pct"), 100, "green"),
                      ("own GiB" if own == "own" else "mem GiB", R.bucket_max(mem, k, 1 / 2**30), total / 2**30 if total else None,
                       "magenta"),
                      ("power W", hist("gpu_power_w"), meta.power_limit_w, "yellow"),
                      ("temp °C", hist("gpu_temp_c"), meta.temp_slowdown_c, "red"), last]
        else:
            specs += [("CPU %", R.bucket_max(src.series("host_cpu_pct", None, n), k), 100, "green")]
        specs.append(("tok/s", [r.get("tokens_per_s") for r in src.steps(plot_w)], None, "bright_green"))
        blocks = []
        for label, vals, hi, style in specs:
            nums = [v for v in vals if v is not None]
            shown = labels[label] if label in labels else nums[-1] if nums else None
            last = R.compact(shown).rjust(7) if shown is not None else "      -"
            lines = R.plot(vals, plot_w, height, 0.0, hi, style)
            blocks.append([Text(f"{label:<{label_w}}" if i == 0 else " " * label_w) + ln + Text(last if i == height - 1 else " " * 7)
                           for i, ln in enumerate(lines)])
        out = []
        for i in range(0, len(blocks), cols):
            group = blocks[i:i + cols]
            for r in range(height):
                out.append(Text("  ").join(b[r] for b in group))
        if not self.wide:
            return Text("\n").join(out)
        title = Text(f"history {'GPU' + str(g) if g is not None else 'host'}: last {plot_w * k * self.interval_s:.0f} s, 1 column = 1 s (max; headroom: min); tok/s per step", style="dim")
        return Text("\n").join([title, *out])

    def _risk(self, mem: list | None = None, own: str = "gpu") -> Text:
        """The risk panel for the plotted GPU (what the scorer published, live or recorded); without a
        risk at this moment, why not (once) and memory headroom and its trend (from `mem`, `_mem`'s)."""
        meta = self._plot_meta()
        if meta is None or mem is None:
            return Text("risk: no GPU", style="dim")
        cap = meta.mem_limit_bytes
        total = self._mem_limit(meta, mem, own)
        rows = self.source.risk(meta.index, 1)
        if rows:
            note = self._guard_status() or getattr(self.source, "risk_note", None) or ""  # e.g. scored on the fly
            return R.risk_model_line(rows[-1], note, self.size.width, R.risk_outlook(self.source, meta.index, rows[-1]))
        why, style = "no risk scored", "yellow"  # one reason, said once
        if self.session is not None:
            why = self.session.model_note
        elif not getattr(self.source, "risk_df", pl.DataFrame()).is_empty():
            why, style = "not scored yet at this moment", "dim"
        elif getattr(self.source, "risk_note", None):  # e.g. being scored in the background
            why = self.source.risk_note
        return R.risk_line(mem, total, self.interval_s, why, style, cap, self._width())

    def _guard_status(self) -> str:
        """The guard's state as the risk panel shows it: mode, rule, actions so far, who has control."""
        return self.session.status().guard_panel() if self.session is not None else ""

    def _reserved(self, gpu) -> float | None:
        """torch's reserved bytes after this GPU's last step (None where no step has run or recorded it)."""
        for r in reversed(self.source.steps(64)):
            if r.get("gpu") == gpu:
                v = r.get("torch_reserved_bytes")
                return float(v) if v is not None else None
        return None

    def _mem_limit(self, meta, mem: list, kind: str) -> float | None:
        """What `mem` (from `_mem`, of that kind) meets, as the GPU panel's bar does (frames.shown_limit)."""
        last = next((v for v in reversed(mem) if v is not None), None) if kind != "gpu" else None
        return shown_limit(meta.mem_limit_bytes, meta.mem_total_bytes, last, self._reserved(meta.index))

    def _mem(self, meta, n: int) -> tuple[list, str]:
        """The last `n` memory figures of `meta`'s GPU as the GPU panel reads them (frames.used_against_cap):
        under a workload's cap its own process's memory, so the history and the headroom line meet the cap
        with the same figure as the panel. Returns them and what they are (used_against_cap's kind)."""
        used = self.source.series("gpu_mem_used_bytes", meta.index, n)
        if not meta.mem_limit_bytes:
            return used, "gpu"
        return used_against_cap(used, self.source.series("gpu_procs", meta.index, n), meta.pid, True)

    def _plot_meta(self):
        """The GpuMeta of the GPU the plots and the risk line show (None when CPU-only)."""
        return next((m for m in self.source.gpus if m.index == self.plot_gpu), None)

    def _recorded_workload(self) -> dict[str, Any]:
        """The first workload's config as the replayed recording's meta.json describes it ({} if none)."""
        holder = getattr(self.source, "reader", None) or getattr(self.source, "feed", None)  # replay / watch --source
        meta = getattr(holder, "meta", None) or {}
        loads = (meta.get("config") or {}).get("workloads") or []
        return loads[0] if loads else {}

    def _recorded_state(self) -> str:
        """"steps table missing" for a replayed session (not one followed: its steps may come later)
        whose meta.json names a workload but whose folder holds no file of its steps; else "recorded"."""
        if self._steps_missing is None:
            from gpuwatch.recording.layout import table_files

            path = getattr(getattr(self.source, "reader", None), "path", None)
            self._steps_missing = bool(path is not None and path.is_dir() and not self.source.follow
                                       and self.source.steps_df.is_empty() and not table_files(path, "steps"))
        return "steps table missing" if self._steps_missing else "recorded"

    def _workload_status(self) -> dict[str, Any] | None:
        live = self.session.status().workloads if self.session is not None else ()
        if not live:
            rec = self._recorded_workload()
            return {"state": self._recorded_state(), "preset": rec.get("preset", ""), "describe": ""} if rec else None
        return {"state": live[0].state, "preset": live[0].preset, "describe": live[0].line}

    # -- keys both screens have ---------------------------------------------------------------------------
    def action_next_gpu(self) -> None:
        ids = [g.index for g in self.source.gpus]
        if ids:
            self.plot_gpu = ids[(ids.index(self.plot_gpu) + 1) % len(ids)]
            self._plots_key = None
            self.refresh_data(force=True)

    def action_toggle_procs(self) -> None:
        self.show_procs = not self.show_procs
        self.note("processes on every GPU (o: sort; t: events)" if self.show_procs else "events")
        self.refresh_data(force=True)

    def action_proc_sort(self) -> None:
        self.proc_sort = R.PROC_SORTS[(R.PROC_SORTS.index(self.proc_sort) + 1) % len(R.PROC_SORTS)]
        self.show_procs = True
        self.refresh_data(force=True)

    def action_show_event(self) -> None:
        """The events the panel shows, the newest (at the cursor) selected, in full."""
        self.app.push_screen(EventScreen(self.source.events(max(50, self._events_height()))))

    def action_help(self) -> None:
        self.app.push_screen(HelpScreen(self.HELP_MODE, workload=self.workload is not None,
                                        guard=self.session is not None and self.session.guard is not None))

    def action_request_quit(self) -> None:
        w = self.workload
        if w is not None and w.state in ("building", "running", "paused"):
            self.app.push_screen(ConfirmQuit(), lambda yes: self.app.exit() if yes else None)
        else:
            self.app.exit()
