"""One interface over live telemetry, a recorded session (replay, time travel) and a session still
being written by another process (follow). The UI and the scorer read a `TelemetrySource` and never
know which kind it is (the way Meta's `below` treats live, pause and replay as one cursor).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import polars as pl

from gpuwatch.recording import schema
from gpuwatch.recording.frames import epoch_us, of_gpu, own_of_rows, own_used, split_by_gpu, stack
from gpuwatch.recording.reader import SessionReader, TablesReader, nothing_read
from gpuwatch.recording.recorded import (fill_plans, first_plan, recorded_caps, recorded_interval, recorded_pid,
                                         recorded_steps, recorded_workload, sorted_by_time, StepCount)
from gpuwatch.recording.window import WINDOW_EVENTS_S, WINDOW_S, WINDOW_STEPS, GpuMeta, Window, WindowArrays, cut_tables
from gpuwatch.telemetry.bus import Bus

SPEEDS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)




class TelemetrySource(Protocol):
    kind: str  # live | replay | follow
    label: str
    gpus: list[GpuMeta]
    interval_s: float

    def window(self, gpu: int | None, seconds: float = WINDOW_S, n_steps: int = WINDOW_STEPS,
               events_s: float = WINDOW_EVENTS_S) -> Window: ...
    def risk(self, gpu: int | None, n: int) -> list[dict[str, Any]]: ...  # last n risk rows up to the cursor

    def poll(self) -> bool: ...  # advance (playback, follow); True if the cursor's data changed
    def cursor_us(self) -> int | None: ...
    def latest(self) -> dict[int | None, dict[str, Any]]: ...  # one row per GPU at the cursor
    def series(self, column: str, gpu: int | None, n: int) -> list[Any]: ...  # last n values up to the cursor
    def events(self, n: int) -> list[dict[str, Any]]: ...  # last n events up to the cursor
    def steps(self, n: int) -> list[dict[str, Any]]: ...  # last n workload steps up to the cursor


class LiveSource:
    """Reads the in-process bus (ring buffers) that the sampler and the workload fill. Windows are cut
    from frames kept incrementally (each call converts only the rows that arrived since the last),
    so the scorer can ask ten times a second."""

    kind = "live"
    # How far back each table is kept for windows: samples a few windows' worth, steps long enough
    # for the last WINDOW_STEPS slow steps, events as long as a window looks back for them.
    KEEP_S = {"samples": 4 * WINDOW_S, "steps": WINDOW_EVENTS_S, "events": WINDOW_EVENTS_S}

    def __init__(self, bus: Bus, gpus: list[GpuMeta], label: str = "live", interval_s: float = 0.1,
                 sample_columns: tuple[str, ...] | None = None) -> None:
        """`sample_columns`: the sample columns windows need (None: all). The scorer's windows need a
        third of them, and converting the rest of each tick (per-core CPU, the process lists) was most
        of what keeping windows cost: ~0.3 ms of a live round against ~0.05 ms for the subset."""
        self.bus, self.gpus, self.label, self.interval_s = bus, gpus, label, interval_s
        full = schema.TABLES["samples"]
        if sample_columns is not None and any(m.pid is None for m in gpus):
            sample_columns = (*sample_columns, "gpu_procs")  # the process is found from NVML's list (frames.own_memory)
        self._sample_schema = full if sample_columns is None else {k: v for k, v in full.items()
                                                                   if k in sample_columns or k in ("ts", "gpu")}
        self._seen = -1
        self._lock = threading.Lock()
        self._cur = {"ticks": bus.ticks.next_seq - len(bus.ticks), "steps": bus.steps.next_seq - len(bus.steps),
                     "events": bus.events.next_seq - len(bus.events)}
        self._per: dict[str, dict[Any, tuple[pl.DataFrame, np.ndarray]]] = {}
        self._own_live: dict[Any, tuple[np.ndarray, np.ndarray]] = {}  # per GPU: frames.own_of_rows
        self._empty: dict[str, tuple[pl.DataFrame, np.ndarray]] = {}

    def _catch_up(self) -> None:
        """Convert only the rows that arrived since the last call; keep them per GPU (samples, steps)
        with a numpy time index, trimmed to the last KEEP_S, so a window is two binary searches and the
        memory held is bounded (at 10 Hz: 1,200 sample rows per GPU; a soak showed the cost of more)."""
        from gpuwatch.recording.writer import to_frame

        ticks, self._cur["ticks"], _ = self.bus.ticks.since(self._cur["ticks"])
        steps, self._cur["steps"], _ = self.bus.steps.since(self._cur["steps"])
        events, self._cur["events"], _ = self.bus.events.since(self._cur["events"])
        if ticks:
            rows = [r for t in ticks for r in t.rows]
            self._append("samples", pl.from_dicts(rows, schema=self._sample_schema, strict=False))  # to_frame's, fewer columns
            self._own_rows(rows)
        if steps:
            self._append("steps", to_frame(steps, "steps"))
        if events:
            self._append("events", to_frame([e.row() for e in events], "events"), by_gpu=False)

    def _append(self, table: str, df: pl.DataFrame, by_gpu: bool = True) -> None:
        parts = split_by_gpu(df) if by_gpu else {(None,): df}
        for key, part in parts.items():
            g = key[0]
            old = self._per.setdefault(table, {}).get(g)
            new = part if old is None else stack(old[0], part)
            ts = epoch_us(part["ts"]) if old is None else np.concatenate([old[1], epoch_us(part["ts"])])
            keep = int(np.searchsorted(ts, ts[-1] - int(self.KEEP_S[table] * 1e6), side="right"))
            if keep > new.height // 2:  # trim rarely (a copy), not on every call
                new, ts = new.slice(keep), ts[keep:]
            self._per[table][g] = (new.rechunk() if new.n_chunks() > 16 else new, ts)

    def _own_rows(self, rows: list[dict[str, Any]]) -> None:
        """The workload's own memory of the new sample rows, from the row dicts (no polars query), kept
        per GPU in step with the samples frame (the same rows, trimmed alike)."""
        for m in self.gpus:
            if m.pid is None or m.index not in self._per.get("samples", {}):
                continue
            own, listed = own_of_rows([r for r in rows if r.get("gpu") == m.index], m.pid)
            o0, l0 = self._own_live.get(m.index, (np.empty(0), np.empty(0, dtype=bool)))
            n = self._per["samples"][m.index][0].height
            self._own_live[m.index] = (np.concatenate([o0, own])[-n:], np.concatenate([l0, listed])[-n:])

    def _get(self, table: str, g) -> tuple[pl.DataFrame, np.ndarray]:
        got = self._per.get(table, {}).get(g)
        if got is None:  # an empty table, built once (a frame from a schema costs ~0.1 ms; not in a
            got = self._empty.get(table)  # setdefault's argument, which was built on every call)
            if got is None:
                df = pl.DataFrame(schema=self._sample_schema) if table == "samples" else schema.empty(table)
                got = self._empty[table] = (df, np.array([], dtype=np.int64))
        return got

    def window(self, gpu: int | None, seconds: float = WINDOW_S, n_steps: int = WINDOW_STEPS,
               events_s: float = WINDOW_EVENTS_S) -> Window:
        with self._lock:
            self._catch_up()
            (sm, sts), (st, stts), (ev, evts) = self._get("samples", gpu), self._get("steps", gpu), self._get("events", None)
            own = self._own_live.get(gpu)
        last = self.bus.ticks.latest(1)
        end = last[0].ts_us if last else time.time_ns() // 1000
        hi = int(np.searchsorted(sts, end, side="right"))
        lo = int(np.searchsorted(sts, end - seconds * 1e6, side="right"))
        shi = int(np.searchsorted(stts, end, side="right"))
        ehi = int(np.searchsorted(evts, end, side="right"))
        elo = int(np.searchsorted(evts, end - events_s * 1e6, side="right"))
        events = ev.slice(elo, ehi - elo)
        if gpu is not None:
            events = of_gpu(events, gpu, keep_null=True)
        own = (own[0][lo:hi], own[1][lo:hi]) if own is not None and own[0].size == sm.height else None
        return Window(gpu, end, self.interval_s, sm.slice(lo, hi - lo), st.slice(max(0, shi - n_steps), min(shi, n_steps)),
                      events, _meta_of(self.gpus, gpu), own)

    def risk(self, gpu: int | None, n: int) -> list[dict[str, Any]]:
        return [r for r in self.bus.risk.latest(n * max(1, len(self.gpus))) if r.get("gpu") == gpu][-n:]

    feed: "RecordedFeed | None" = None  # watch --source: the rest of the recording, fed in step

    def poll(self) -> bool:
        if self.feed is not None:
            self.feed.pump()
        seq = self.bus.ticks.next_seq + self.bus.events.next_seq + self.bus.steps.next_seq
        changed, self._seen = seq != self._seen, seq
        return changed

    def cursor_us(self) -> int | None:
        last = self.bus.ticks.latest(1)
        return last[0].ts_us if last else None

    def latest(self) -> dict[int | None, dict[str, Any]]:
        last = self.bus.ticks.latest(1)
        if not last:
            return {}
        if self.feed is not None and self.feed.host_row:  # the recorded host, not this machine
            return {r["gpu"]: {**r, **self.feed.host_row} for r in last[0].rows}
        return {r["gpu"]: r for r in last[0].rows}

    def series(self, column: str, gpu: int | None, n: int) -> list[Any]:
        out = []
        for t in self.bus.ticks.latest(n):
            out.append(next((r.get(column) for r in t.rows if r.get("gpu") == gpu), None))
        return out

    def events(self, n: int) -> list[dict[str, Any]]:
        return [e.row() for e in self.bus.events.latest(n)]

    def steps(self, n: int) -> list[dict[str, Any]]:
        return self.bus.steps.latest(n)


class ReplaySource:
    """A recorded session with a cursor: play/pause, speed, seek, step, jump to events, loop.
    With `follow=True` it keeps reading files the recording process adds and stays at the live edge
    until the user moves away from it."""

    TAIL_MERGE_MIN = 36_000  # rows a GPU's tail may hold before it merges into the body (1 h at 10 Hz)

    def __init__(self, path: Path | str, follow: bool = False, speed: float = 1.0,
                 clock=time.monotonic, reader: SessionReader | TablesReader | None = None) -> None:
        """`reader`: a session already in memory (reader.TablesReader; `path` is then its name)."""
        self.reader = reader if reader is not None else SessionReader(path)
        self.follow = follow
        self.kind = "follow" if follow else "replay"
        self.label = self.reader.path.name
        self.clock = clock
        self.interval_s = recorded_interval(self.reader.meta)
        self.steps_df, self.events_df, self.risk_df = (schema.empty(t) for t in ("steps", "events", "risk"))
        self._risk_ts = np.array([], dtype=np.int64)
        self.ticks_ts = np.array([], dtype=np.int64)
        self._events_ts = self._steps_ts = np.array([], dtype=np.int64)
        self._by_gpu: dict[Any, pl.DataFrame] = {}  # what reads use: body + tail, per GPU
        self._body: dict[Any, pl.DataFrame] = {}
        self._tail: dict[Any, pl.DataFrame | None] = {}
        self._ts: dict[Any, np.ndarray] = {}  # per GPU: its rows' times in us, for searchsorted
        self._own: dict[Any, tuple[np.ndarray, np.ndarray]] = {}  # per GPU: frames.own_used, once
        self._cut: dict[Any, tuple] = {}  # per GPU: what window_at cuts from (_cut_of), once
        self._load(self.reader.load_new())
        if not self._by_gpu and not follow:
            from gpuwatch.errors import RecordingError

            r = self.reader
            raise RecordingError(nothing_read(r, "no samples") if isinstance(r, SessionReader) and r.warnings
                                 else f"{r.path}: no samples")
        self.playing = follow
        self.writer_done = follow and bool(self.reader.meta.get("complete"))  # followed after it ended
        self.writer_gone = False  # follow: no process holds the session's lock (killed) and nothing new comes
        self._last_lock_check = 0.0
        self.speed = speed
        self.loop = False
        self.at_edge = follow
        self._t = self.ticks_ts[0] if self.ticks_ts.size and not follow else (self.ticks_ts[-1] if self.ticks_ts.size else 0)
        self._last_clock = clock()
        self._last_follow = 0.0
        self._changed = True
        gm = {g.get("index"): g for g in self.reader.meta.get("gpus", [])}
        gpu_ids = sorted(g for g in self._by_gpu if g is not None) or list(gm)
        caps = recorded_caps(self.reader.meta)
        self.gpus = [GpuMeta(i, gm.get(i, {}).get("name", f"GPU {i}"), gm.get(i, {}).get("mem_total_bytes"),
                             gm.get(i, {}).get("power_limit_w"), gm.get(i, {}).get("temp_slowdown_c"),
                             mem_limit_bytes=caps.get(i), pid=recorded_pid(self.reader.meta, i),
                             workload=recorded_workload(self.reader.meta, i))
                     for i in gpu_ids]

    # -- data ----------------------------------------------------------------------------------------
    def _load(self, frames: dict[str, pl.DataFrame]) -> bool:
        """Add newly read rows. Samples are kept once, split by GPU (what every read wants); rows that
        come after everything held (follow's usual case) are appended without re-sorting what is
        there, so following a day-long session costs the new rows, not the whole day, each poll:
        they go to a small tail per GPU, merged into the body only when the tail reaches an eighth
        of it (so the copy is rare and its cost per row is constant)."""
        new = any(not f.is_empty() for f in frames.values())
        if not new:
            return False
        s = frames["samples"]
        if not s.is_empty():
            s = sorted_by_time(s)
            ts = epoch_us(s["ts"])
            after = not self.ticks_ts.size or ts[0] > self.ticks_ts[-1]
            gpu = s["gpu"]
            for g in gpu.unique(maintain_order=True).to_list():
                mask = (gpu.is_null() if g is None else gpu == g).fill_null(False)
                part, part_ts = s.filter(mask), ts[mask.to_numpy()]
                body, tail = self._body.get(g), self._tail.get(g)
                if body is None:
                    body, self._ts[g] = part, part_ts
                elif after:
                    tail = part if tail is None else pl.concat([tail, part])
                    if tail.n_chunks() > 32:
                        tail = tail.rechunk()
                    if tail.height > max(body.height // 8, self.TAIL_MERGE_MIN):
                        body, tail = pl.concat([body, tail]).rechunk(), None
                    self._ts[g] = np.concatenate([self._ts[g], part_ts])
                else:  # rows from before what is held (rare): merge and sort everything once
                    body, tail = sorted_by_time(pl.concat([body, *([tail] if tail is not None else []), part])).rechunk(), None
                    self._ts[g] = epoch_us(body["ts"])
                self._body[g], self._tail[g] = body, tail
                self._by_gpu[g] = body if tail is None else pl.concat([body, tail], rechunk=False)
            self._own.clear()
            ticks = ts[np.r_[True, ts[1:] != ts[:-1]]]  # all GPUs of a tick share its time
            self.ticks_ts = np.concatenate([self.ticks_ts, ticks]) if after else np.unique(
                np.concatenate([self.ticks_ts, ticks]))
        if not frames["events"].is_empty():
            self.events_df = sorted_by_time(pl.concat([self.events_df, frames["events"]]))
            self._events_ts = epoch_us(self.events_df["ts"])
        if not frames["steps"].is_empty() or not frames["events"].is_empty():
            steps = sorted_by_time(pl.concat([self.steps_df, frames["steps"]]))
            self.steps_df = fill_plans(steps, self.events_df)
            self._steps_ts = epoch_us(self.steps_df["ts"])
        if not frames.get("risk", schema.empty("risk")).is_empty():
            self.risk_df = sorted_by_time(pl.concat([self.risk_df, frames["risk"]]))
            self._risk_ts = epoch_us(self.risk_df["ts"])
        self._cut.clear()  # window_at's per-GPU tables (_cut_of): cut again from what is held now (after it is held)
        return True

    risk_note: str | None = None  # where the risk rows came from when not recorded with the session
    writer_done = False  # follow: the recording process closed the session (session_end seen)
    writer_gone = False  # follow: the recording process is gone without closing it

    def times(self, gpu: int | None) -> np.ndarray | None:
        """GPU `gpu`'s sample times (UTC us, sorted), or None where it has no rows: what scoring and
        training walk a recording by."""
        return self._ts.get(gpu)

    def samples(self, gpu: int | None) -> pl.DataFrame | None:
        """GPU `gpu`'s sample rows, all read so far (not only up to the cursor); None where it has none."""
        return self._by_gpu.get(gpu)

    @property
    def sample_rows(self) -> int:
        """How many sample rows were read so far, every GPU's (and the host-only rows) together."""
        return sum(df.height for df in self._by_gpu.values())

    def step_count(self) -> StepCount:
        """How many steps the replayed session ran and where that is known from (recording/recorded.py
        recorded_steps): its steps table, else its workload_stop events where steps.parquet is missing.
        `.status` is the workload's status word for the replay screen ('recorded', or why not)."""
        return recorded_steps(self.reader.path, self.reader.meta, self.steps_df, self.events_df)

    def set_risk(self, df: pl.DataFrame, note: str) -> None:
        """Risk rows computed after the fact (an older session scored on the fly, maybe on another
        thread: the rows and their times are swapped in together, and reads clip to both)."""
        df = sorted_by_time(df)
        ts = epoch_us(df["ts"])
        self.risk_df, self._risk_ts = df, ts
        self.risk_note = note
        self._changed = True

    def touch(self) -> None:
        """Something shown changed outside the cursor's data (a note): redraw at the next poll."""
        self._changed = True

    def window(self, gpu: int | None, seconds: float = WINDOW_S, n_steps: int = WINDOW_STEPS,
               events_s: float = WINDOW_EVENTS_S) -> Window:
        """The window at the cursor (the same cut as live; `ts` columns are datetimes in both)."""
        end = int(self._t) if len(self.ticks_ts) else 0
        return self.window_at(gpu, end, seconds, n_steps, events_s)

    def window_at(self, gpu: int | None, end_us: int, seconds: float = WINDOW_S, n_steps: int = WINDOW_STEPS,
                  events_s: float = WINDOW_EVENTS_S) -> Window:
        """A window ending at any moment, without moving the cursor (training and `score` walk a
        recording with this, so they cut exactly what replay would show at that moment)."""
        cut = self._cut.get(gpu)
        if cut is None:
            cut = self._cut[gpu] = self._cut_of(gpu)
        body, ts, sc, steps_g, steps_at, tc, ev_g, ev_ts, ec = cut
        hi = int(ts.searchsorted(end_us, side="right"))
        lo = int(ts.searchsorted(end_us - seconds * 1e6, side="right"))
        samples = body.slice(lo, hi - lo)
        # the GPU's last n_steps steps among the last n_steps x GPUs rows of all GPUs' steps up to the moment
        si = int(self._steps_ts.searchsorted(end_us, side="right"))
        k = int(steps_at.searchsorted(si))
        a = max(int(steps_at.searchsorted(max(0, si - n_steps * max(1, len(self.gpus))))), k - n_steps)
        steps = steps_g.slice(a, k - a)
        ei = int(ev_ts.searchsorted(end_us, side="right"))
        ej = int(ev_ts.searchsorted(end_us - events_s * 1e6, side="right"))
        ev = ev_g.slice(ej, ei - ej)
        meta = _meta_of(self.gpus, gpu)
        own = self._own_of(gpu, body, meta)
        first = None
        if not steps.height and meta is not None and meta.workload is not None:
            evg = of_gpu(self.events_df, gpu, keep_null=True) if gpu is not None else self.events_df
            first = first_plan(self.steps_df.filter(pl.col("gpu") == gpu) if gpu is not None else self.steps_df,
                               evg, end_us)
        # following a session still being recorded, every load brings rows and new tables, and converting the
        # whole recording's columns for the next window cost 38-127 ms (100 k-361 k samples) where the window's own
        # frames cost ~4 ms: the converted columns pay only where a recording's tables stay (replay, score, training)
        arrays = None if self.follow else WindowArrays(sc, lo, hi, tc, a, k, ec, ej, ei, (samples, steps, ev))
        return Window(gpu, end_us, self.interval_s, samples, steps, ev, meta,
                      (own[0][lo:hi], own[1][lo:hi]) if own is not None else None, first, arrays)

    def _cut_of(self, gpu: int | None) -> tuple:
        """window_at's per-GPU tables (window.cut_tables), once per GPU until new rows come."""
        body = self._by_gpu.get(gpu)
        return cut_tables(schema.empty("samples") if body is None else body,
                          self._ts.get(gpu, np.array([], dtype=np.int64)), self.steps_df, self.events_df, gpu)

    def _own_of(self, gpu: int | None, body: pl.DataFrame, meta: GpuMeta | None) -> tuple[np.ndarray, np.ndarray] | None:
        """The workload's own memory per sample of this GPU, computed once (not once per window)."""
        if meta is None or meta.pid is None or "gpu_procs" not in body.columns:
            return None
        if gpu not in self._own:
            self._own[gpu] = own_used(body["gpu_procs"], meta.pid)
        return self._own[gpu]

    def risk(self, gpu: int | None, n: int) -> list[dict[str, Any]]:
        df, ts = self.risk_df, self._risk_ts
        i = min(int(np.searchsorted(ts, self._t, side="right")), df.height)
        part = df.slice(max(0, i - n * max(1, len(self.gpus))), min(i, n * max(1, len(self.gpus))))
        rows = part.filter(part["gpu"] == gpu).tail(n).to_dicts() if gpu is not None else part.tail(n).to_dicts()
        for r in rows:
            r["ts"] = int(r["ts"].timestamp() * 1e6)
        return rows

    def _col(self, column: str, gpu: int | None) -> tuple[np.ndarray, pl.Series]:
        """A GPU's row times (one array per GPU, extended as rows arrive) and one of its columns."""
        df = self._by_gpu.get(gpu)
        if df is None:
            return np.array([], dtype=np.int64), pl.Series([])
        return self._ts[gpu], df[column]

    # -- cursor ----------------------------------------------------------------------------------------
    @property
    def start_us(self) -> int:
        return int(self.ticks_ts[0]) if len(self.ticks_ts) else 0

    @property
    def end_us(self) -> int:
        return int(self.ticks_ts[-1]) if len(self.ticks_ts) else 0

    def cursor_us(self) -> int | None:
        return int(self._t) if len(self.ticks_ts) else None

    def seek_to(self, t_us: float) -> None:
        self._t = float(min(max(t_us, self.start_us), self.end_us))
        self.at_edge = self.follow and self._t >= self.end_us
        self._changed = True

    def seek(self, seconds: float) -> None:
        self.seek_to(self._t + seconds * 1e6)

    def step(self, n: int) -> None:
        """Move by n samples (ticks)."""
        i = int(np.searchsorted(self.ticks_ts, self._t, side="right")) - 1
        j = min(max(i + n, 0), len(self.ticks_ts) - 1)
        self.playing = False
        self.seek_to(self.ticks_ts[j])

    def jump_event(self, direction: int) -> dict[str, Any] | None:
        ts = self._events_ts
        if direction > 0:
            i = int(np.searchsorted(ts, self._t + 1, side="left"))
        else:
            i = int(np.searchsorted(ts, self._t - 1, side="left")) - 1
        if 0 <= i < len(ts):
            self.seek_to(ts[i])
            return self.events_df.row(i, named=True)
        return None

    def set_speed(self, faster: bool) -> float:
        i = SPEEDS.index(self.speed) if self.speed in SPEEDS else 2
        self.speed = SPEEDS[min(max(i + (1 if faster else -1), 0), len(SPEEDS) - 1)]
        return self.speed

    def toggle_play(self) -> bool:
        self.playing = not self.playing
        if self.playing and self._t >= self.end_us and not self.follow:
            self._t = self.start_us
        self._last_clock = self.clock()
        return self.playing

    def poll(self) -> bool:
        now = self.clock()
        if self.follow and now - self._last_follow >= 0.5:
            self._last_follow = now
            edge = self.at_edge
            if self._load(self.reader.load_new()):
                self._changed = True
                self.writer_gone = False
                self.writer_done = bool(self.events_df.height) and "session_end" in self.events_df["kind"].to_list()[-8:]
                if edge:
                    self._t = self.end_us
            elif not self.writer_done and now - self._last_lock_check >= 5.0 and self.reader.path.is_dir():
                from gpuwatch.recording.layout import session_locked

                self._last_lock_check = now
                gone = not session_locked(self.reader.path)
                self._changed |= gone != self.writer_gone
                self.writer_gone = gone
        if self.playing:
            if self.follow and self.at_edge:
                self._t = self.end_us
            else:
                self._t += (now - self._last_clock) * 1e6 * self.speed
                if self._t >= self.end_us:
                    if self.loop:
                        self._t = self.start_us
                    elif self.follow:
                        self._t, self.at_edge = self.end_us, True
                    else:
                        self._t, self.playing = self.end_us, False
            self._changed = True
        self._last_clock = now
        changed, self._changed = self._changed, False
        return changed

    # -- reads at the cursor ------------------------------------------------------------------------------
    def latest(self) -> dict[int | None, dict[str, Any]]:
        out = {}
        for g, df in self._by_gpu.items():
            ts, _ = self._col("ts", g)
            i = int(np.searchsorted(ts, self._t, side="right")) - 1
            if i >= 0:
                out[g] = df.row(i, named=True)
                out[g]["ts"] = int(ts[i])
        return out

    def series(self, column: str, gpu: int | None, n: int) -> list[Any]:
        ts, col = self._col(column, gpu)
        i = int(np.searchsorted(ts, self._t, side="right"))
        return col.slice(max(0, i - n), min(n, i)).to_list()

    def _upto(self, ts: np.ndarray) -> int:
        """Rows at or before the cursor; at the session's end, all of them (a session's last events -
        workload_stop, session_end - come after its last sample, and follow never showed them)."""
        if len(self.ticks_ts) and self._t >= self.end_us:
            return len(ts)
        return int(np.searchsorted(ts, self._t, side="right"))

    def events(self, n: int) -> list[dict[str, Any]]:
        i = self._upto(self._events_ts)
        rows = self.events_df.slice(max(0, i - n), min(n, i)).to_dicts()
        for r in rows:
            r["ts"] = int(r["ts"].timestamp() * 1e6)
        return rows

    def steps(self, n: int) -> list[dict[str, Any]]:
        i = self._upto(self._steps_ts)
        return self.steps_df.slice(max(0, i - n), min(n, i)).to_dicts()


class RecordedFeed:
    """`watch --source SESSION`: the sampler replays the session's GPU samples as live (one recorded
    row a tick, looping); this feeds the rest of what the session recorded - its steps, events, risk
    (guard actions are events) and its host's figures - to the live bus in step with those rows, so
    the no-GPU demo shows the product, not an idle GPU. Recorded times are moved to the tick's time;
    each loop of the recording feeds them again."""

    HOST_PREFIXES = ("host_", "proc_")

    def __init__(self, bus: Bus, path: Path | str) -> None:
        from gpuwatch.recording.reader import open_recording

        rec = open_recording(path)
        self.bus, self.meta = bus, rec.meta
        self.host = str(rec.meta.get("host") or "")
        gpus = rec.gpus
        first = rec.samples.filter(rec.samples["gpu"] == gpus[0]) if gpus else rec.samples
        self._rec_ts = epoch_us(first["ts"])
        host_cols = [c for c in first.columns if c.startswith(self.HOST_PREFIXES)]
        self._host = first.select(host_cols).to_dicts()
        self.caps = recorded_caps(rec.meta)
        self.has_risk = not rec.risk.is_empty()

        def rows(df: pl.DataFrame) -> tuple[np.ndarray, list[dict[str, Any]]]:
            df = sorted_by_time(df) if df.height else df
            return epoch_us(df["ts"]), df.to_dicts()
        self._tables = {"steps": rows(rec.steps), "events": rows(rec.events), "risk": rows(rec.risk)}
        self._next = {t: 0 for t in self._tables}
        self._first_tick: int | None = None
        self._cycle = 0
        self._shift = 0
        self.host_row: dict[str, Any] = {}
        self._lock = threading.Lock()

    def pump(self) -> int:
        """Feed what was recorded up to the recorded moment of the latest tick; returns rows fed."""
        last = self.bus.ticks.latest(1)
        if not last or not self._rec_ts.size:
            return 0
        with self._lock:
            t = last[0]
            if self._first_tick is None:
                self._first_tick = t.tick
            cycle, pos = divmod(t.tick - self._first_tick, self._rec_ts.size)
            fed = 0
            if cycle != self._cycle:  # the recording looped: finish the last loop, then again from its start
                fed += self._feed_upto(2**62, self._shift)
                self._cycle, self._next = cycle, {k: 0 for k in self._next}
            rec_now = int(self._rec_ts[pos])
            self._shift = t.ts_us - rec_now
            self.host_row = self._host[pos] if self._host else {}
            return fed + self._feed_upto(rec_now, self._shift)

    def _feed_upto(self, rec_now: int, shift: int) -> int:
        fed = 0
        for table, (ts, rows) in self._tables.items():
            i = self._next[table]
            while i < len(rows) and ts[i] <= rec_now:
                self._feed(table, rows[i], int(ts[i]) + shift)
                i += 1
                fed += 1
            self._next[table] = i
        return fed

    def _feed(self, table: str, row: dict[str, Any], ts_us: int) -> None:
        from gpuwatch.telemetry.bus import Event

        if table == "events":
            try:
                detail = json.loads(row.get("detail") or "{}")
            except ValueError:
                detail = {}
            self.bus.events.append(Event(row["kind"], row["message"] or "", row.get("severity") or "info",
                                         row.get("gpu"), detail if isinstance(detail, dict) else {}, ts_us))
        else:
            getattr(self.bus, table).append({**row, "ts": ts_us})


def _meta_of(gpus: list[GpuMeta], gpu: int | None) -> GpuMeta | None:
    return next((m for m in gpus if m.index == gpu), None)
