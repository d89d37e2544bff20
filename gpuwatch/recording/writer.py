"""The crash-safe session recorder: drains the bus into a session folder (layout.py says what the files
are) once a second, on its own thread; the sampler never waits for the disk.

Each flush appends one record batch per table to that table's open Arrow IPC stream file with one
write() (ipc.py), so `kill -9` loses at most the last flush interval. Every `roll_every` flushes the
stream becomes one fsynced Parquet chunk and a new stream starts (bounded file sizes, little for a
follower to read); a clean stop compacts everything into one Parquet file per table. Parquet files and
meta.json are written through the one atomic-file helper (`gpuwatch.atomic`).

A write that fails (a full disk, a removed folder, anything polars raises) never leaves the thread: it
becomes one `recorder_error` event and one line in `Recorder.error`, the rows that were not written are
held (up to an hour, like the bus ring) and the write is retried every `retry_s` seconds; when it
succeeds a `recorder_resumed` event says so and nothing was lost or written twice. Rows that could not
be kept are counted, and the session's meta.json then stays `complete: false` with an
`incomplete_reason`.
"""

from __future__ import annotations

import errno as _errno
import json
import os
import re
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, cast

import polars as pl

from gpuwatch.atomic import unlink_quietly, write_file
from gpuwatch.errors import RecordingError
from gpuwatch.recording import schema
from gpuwatch.recording.ipc import StreamFile, read_stream_file
from gpuwatch.recording.layout import (CHUNK_RE, LOCK_NAME, SEGMENT_RE, STREAM_RE, check_frame, data_names,
                                       data_part, first_flush, lock_session, session_name,
                                       stat_regular, unlock_session)
from gpuwatch.telemetry.bus import Bus
from gpuwatch.threads import start_thread

__all__ = ["Recorder", "append_stream", "classify_error", "read_part", "to_frame", "write_atomic", "write_json_atomic"]
FILE_META = {"gpuwatch_schema_version": str(schema.SCHEMA_VERSION)}
HOLD_S = 3600.0  # unwritten rows held while the disk fails (the bus ring holds as much)
_BUS_CHANNEL = {"samples": "ticks", "steps": "steps", "events": "events", "risk": "risk"}


def write_atomic(df: pl.DataFrame, path: Path, level: int = 3, fsync: bool = True) -> int:
    """Write `df` as a gpuwatch Parquet file (zstd `level`, column statistics, the schema version in its
    metadata) through the one atomic-file helper (`gpuwatch.atomic.write_file`): no reader ever sees half
    of it. Returns its size."""
    return write_file(path, lambda tmp: df.write_parquet(tmp, compression="zstd", compression_level=level,
                                                         statistics=True, metadata=FILE_META), fsync=fsync)


def write_json_atomic(obj: dict, path: Path) -> None:
    """Write `obj` as indented JSON (meta.json) through the one atomic-file helper."""
    write_file(path, json.dumps(obj, indent=2, default=str) + "\n")


def append_stream(stream: StreamFile, df: pl.DataFrame) -> int:
    """The recorder's once-a-flush write (a module function, so tests can make it fail)."""
    return stream.append(df)


def read_part(path: Path) -> pl.DataFrame:
    """A segment, chunk or stream file as written (for rolls, compaction and resume). A stream file is
    read like the reader reads it (a regular file only, never blocking on a FIFO; the schema of the table
    its name says), and one that is damaged before its end raises: rows are never dropped by a merge that
    then deletes the file."""
    if path.suffix == ".arrows":
        stat_regular(path)
        try:
            df, n, why = read_stream_file(path)
        except ValueError as e:
            raise RecordingError(f"{path}: not an Arrow IPC stream ({e})") from None
        if why is not None:
            raise RecordingError(f"{path}: {why} after {n} batches - not merged, nothing deleted "
                                 "(the readable rows still replay)")
        if df is None:
            return pl.DataFrame()
        m = STREAM_RE.match(path.name)
        return check_frame(path, df, m.group(1) if m else None)[1]
    return pl.read_parquet(path)


def classify_error(exc: BaseException, folder: Path) -> tuple[str, str]:
    """(errno name or the exception's type, one line) for a failed write in `folder`. Polars reports a
    full disk as a ComputeError ("... No space left on device (os error 28)"), so the text is checked,
    and where it says nothing the free space of the folder is."""
    code = exc.errno if isinstance(exc, OSError) else None
    text = " ".join(str(exc).split()) or type(exc).__name__
    if code is None and (m := re.search(r"os error (\d+)", text)):
        code = int(m.group(1))
    if code is None and "No space left" in text:
        code = _errno.ENOSPC
    if code is None and "quota exceeded" in text.lower():
        code = _errno.EDQUOT
    if code is None:
        try:
            st = os.statvfs(folder)
            if st.f_bavail * st.f_frsize < 64 * 1024 or (st.f_files and st.f_favail == 0):
                code = _errno.ENOSPC
        except OSError:
            pass
    name = _errno.errorcode.get(code, "") if code is not None else ""
    if code in (_errno.ENOSPC, _errno.EDQUOT):
        what = "disk full" if code == _errno.ENOSPC else "disk quota exceeded"
        return name, f"{what} ({name}: {os.strerror(code)}) in {folder}"
    if code is not None:
        return name or str(code), f"{os.strerror(code)} ({name or code}) in {folder}"
    first = text[:160]
    return type(exc).__name__, f"{type(exc).__name__}: {first} in {folder}"


class Recorder:
    """Drains the bus into a session folder every `flush_interval` seconds."""

    def __init__(self, bus: Bus, root: Path | str, meta: dict[str, Any], flush_interval: float = 1.0,
                 roll_every: int = 300, name: str | None = None, retry_s: float = 5.0,
                 resume: dict[str, Any] | None = None) -> None:
        """`resume`: continue the existing session folder `root/name` (see `_reopen`); the dict is
        appended to its meta.json's `resumed` list (at, after_s, ...)."""
        self.bus, self.flush_interval, self.roll_every = bus, flush_interval, roll_every
        self.retry_s = retry_s
        start = datetime.now(timezone.utc)
        self.dir = Path(root) / (name or session_name(start))
        self.meta = {"schema_version": schema.SCHEMA_VERSION, "start": start.isoformat(),
                     "complete": False, **meta}
        self._cursor = {"samples": bus.ticks.next_seq, "steps": bus.steps.next_seq,
                        "events": bus.events.next_seq, "risk": bus.risk.next_seq}
        self._seg = {t: 0 for t in schema.TABLES}  # the last flush number written per table
        self._stream: dict[str, StreamFile | None] = {t: None for t in schema.TABLES}  # the open stream files
        self._pending: dict[str, list[pl.DataFrame]] = {t: [] for t in schema.TABLES}  # drained, not written
        self.rows = 0  # sample rows on disk
        self.bytes = 0
        self.dropped = 0  # ticks overwritten in the ring before the recorder read them
        self.lost: dict[str, int] = {t: 0 for t in schema.TABLES}  # rows drained but never written
        self.error: str | None = None  # the current problem, one line (None while writing works)
        self.incomplete_reason: str | None = None  # why meta.json will say complete: false
        self._error_key: str | None = None
        self._error_line: str | None = None  # `error` without the retry note, for meta.json
        self._error_since: float | None = None
        self._fatal = False  # the session folder could not even be created: nothing to retry
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._kick = threading.Event()
        self.wait_s = flush_interval  # longest wait between flushes; see kick()
        self._thread: threading.Thread | None = None
        self._resume = resume
        self._lock_fd: int | None = None

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self, thread: bool = True) -> "Recorder":
        """Create (or reopen) the session folder and start the flush thread (`thread=False`: the caller flushes)."""
        if self._resume is not None:
            try:
                self._lock_fd = lock_session(self.dir)
                self._reopen(self._resume)
            except Exception as e:
                self._fatal = True
                self._fail(e, "recording stopped (the session folder could not be reopened)")
                return self
            self._thread = start_thread(self._run, "gpuwatch-recorder") if thread else None
            return self
        try:
            self.dir.parent.mkdir(parents=True, exist_ok=True)
            base, n = self.dir, 1
            while True:  # two sessions started in the same second on one host get -2, -3, ...
                try:
                    self.dir.mkdir()
                    break
                except FileExistsError:
                    n += 1
                    self.dir = base.with_name(f"{base.name}-{n}")
            write_json_atomic(self.meta, self.dir / "meta.json")
            self._lock_fd = lock_session(self.dir)
        except Exception as e:
            self._fatal = True
            self._fail(e, "recording stopped (the session folder could not be created)")
            return self
        self._thread = start_thread(self._run, "gpuwatch-recorder") if thread else None
        return self

    def _reopen(self, entry: dict[str, Any]) -> None:
        """Continue writing an existing session folder (`gpuwatch stress --resume`). Its meta.json is kept
        (start, config, the first command line) and gets `complete: false` and `entry` appended to
        `resumed`. A compacted table (`samples.parquet`, a clean stop) is renamed to the chunk name
        `samples-c000000-000000.parquet` (it covers no segment number; any segments or chunks it already
        holds are removed), because the reader prefers a compacted file over every segment of its table.
        The stream files a killed process left become chunks (their complete batches; one a chunk already
        covers is removed). New streams are numbered after the highest flush on disk, so nothing is
        overwritten or read twice; a clean stop compacts everything again."""
        old = json.loads((self.dir / "meta.json").read_text())
        if not isinstance(old, dict):
            raise ValueError(f"{self.dir / 'meta.json'}: not a JSON object")
        for tmp in self.dir.glob(".*.tmp"):  # a write a crash interrupted (never read)
            unlink_quietly(tmp)
        names = data_names(self.dir)
        for table in schema.TABLES:
            mine = [n for n in names if (m := data_part(n)) and m.group(1) == table]
            if f"{table}.parquet" in names:
                for n in mine:  # a crash during compaction: the compacted file holds them
                    (self.dir / n).unlink()
                os.replace(self.dir / f"{table}.parquet", self.dir / f"{table}-c000000-000000.parquet")
                mine = [f"{table}-c000000-000000.parquet"]
            chunks = [(int(m.group(2)), int(m.group(3))) for n in mine if (m := CHUNK_RE.match(n))]
            top = max((b for _, b in chunks), default=0)
            for n in [n for n in mine if STREAM_RE.match(n)]:  # streams of a killed process become chunks
                mine.remove(n)
                first = int(STREAM_RE.match(n).group(2))  # type: ignore[union-attr]  # it matched just above
                if any(a <= first <= b for a, b in chunks):  # killed between writing its chunk and deleting it
                    (self.dir / n).unlink()
                    continue
                try:
                    df, batches, why = read_stream_file(self.dir / n)
                except ValueError:  # not even its schema is readable: left as it is (the reader names it)
                    top = max(top, first)
                    continue
                if why is not None:  # damaged before its end: refuse rather than drop what follows the damage
                    raise RecordingError(f"{self.dir / n}: {why} after {batches} batches - not merged, nothing "
                                         "deleted (the readable rows still replay)")
                if not batches:
                    (self.dir / n).unlink()
                    continue
                chunk = f"{table}-c{first:06d}-{first + batches - 1:06d}.parquet"
                counted = self.bytes
                self._merge(table, [self.dir / n], self.dir / chunk, level=3, sort=False)
                self.bytes = counted  # counted below, with every other file
                mine.append(chunk)
                top = max(top, first + batches - 1)
            for n in mine:
                m = SEGMENT_RE.match(n)
                top = max(top, int(m.group(2)) if m else int(CHUNK_RE.match(n).group(3)))  # type: ignore[union-attr]
            self._seg[table] = top
            for n in mine:
                path = self.dir / n
                self.bytes += path.stat().st_size
                if table == "samples":
                    self.rows += pl.scan_parquet(path).select(pl.len()).collect().item()
        previous = "closed cleanly" if old.get("complete") else (old.get("incomplete_reason") or "interrupted")
        entry = {**entry, "previous_close": previous}
        for key in ("end", "rows", "bytes", "dropped", "lost_rows", "incomplete_reason"):
            old.pop(key, None)
        old.update(complete=False, resumed=[*(old.get("resumed") or []), entry])
        self.meta = old
        write_json_atomic(self.meta, self.dir / "meta.json")

    def _run(self) -> None:
        while True:
            try:
                if self.error is not None:
                    if self._stop.wait(self.retry_s):  # failing: retry every retry_s, kicks or not
                        return
                else:
                    self._kick.wait(self.wait_s)
                    self._kick.clear()
                    if self._stop.is_set():
                        return
                self.flush()
            except Exception as e:  # never leave the thread (flush catches; this is the last net)
                try:
                    self._fail(e, "recording paused")
                except Exception:
                    pass
                if self._stop.wait(self.retry_s):
                    return

    def kick(self) -> None:
        """Flush now. A sampler that delivers ticks a second at a time kicks the recorder as each batch
        arrives (and `wait_s` is raised so the timer only covers a silent sampler): one wake-up a
        second for both, and a batch is on disk as soon as it is here."""
        self._kick.set()

    def stop(self, compact: bool = True) -> None:
        """Final flush; then merge every chunk and stream file into one file per table and mark the
        session complete (`compact=False`: the stream files are closed and left as they are).
        If the disk still fails, the rows not written are counted as lost and meta.json (if it can be
        written) says why the session is incomplete. Never raises."""
        self._stop.set()
        self._kick.set()
        if self._thread:
            self._thread.join(timeout=10)
        if self._fatal:
            unlock_session(self._lock_fd)
            self._lock_fd = None
            return
        try:
            self.flush()
            with self._lock:
                held = {t: sum(df.height for df in fs) for t, fs in self._pending.items()}
                for t, n in held.items():
                    self.lost[t] += n
                    self._pending[t] = []
                if any(held.values()):
                    self._note_lost(f"still failing at stop: {self._error_line}")
                if compact and self.error is None:
                    try:
                        self._compact()
                    except Exception as e:
                        self._fail(e, "compaction failed (every row is still in the streams and chunks)")
                if self.dropped:
                    self._note_lost(f"{self.dropped} ticks overwritten in the bus before they were written")
                if any(self.lost.values()):
                    self.incomplete_reason = (f"{self._describe_lost(self.lost)} never written "
                                              f"({self.incomplete_reason})")
                elif self.error is not None and self.incomplete_reason is None:
                    self.incomplete_reason = f"not closed cleanly: {self._error_line} (every row written is in the streams and chunks)"
                complete = compact and self.error is None and self.incomplete_reason is None
                self.meta.update(complete=complete, end=datetime.now(timezone.utc).isoformat(),
                                 rows=self.rows, bytes=self.bytes, dropped=self.dropped,
                                 lost_rows={t: n for t, n in self.lost.items() if n})
                if self.incomplete_reason:
                    self.meta["incomplete_reason"] = self.incomplete_reason
                if compact or self.incomplete_reason:
                    write_json_atomic(self.meta, self.dir / "meta.json")
        except Exception as e:  # meta.json could not be rewritten: it still says complete: false
            self._fail(e, "could not close the session")
        finally:
            self._close_streams()
            if self._lock_fd is not None:
                unlink_quietly(self.dir / LOCK_NAME)  # the folder holds what it held before locks
            unlock_session(self._lock_fd)
            self._lock_fd = None

    # -- writing ------------------------------------------------------------------------------------
    def _drain(self) -> None:
        """Move everything new on the bus into `_pending` (as frames); the cursors advance only past
        rows that are now held here, so nothing is read twice or skipped."""
        for table, ch in _BUS_CHANNEL.items():
            channel = getattr(self.bus, ch)
            items, nxt, lost = channel.since(self._cursor[table])
            if table == "samples":
                self.dropped += lost
                rows = [r for t in items for r in t.rows]
            else:
                rows = [e.row() for e in items] if table == "events" else items
                self.lost[table] += lost
                if lost:
                    self._note_lost(f"{table} rows overwritten in the bus before they were written")
            self._cursor[table] = nxt
            if rows:
                try:
                    self._pending[table].append(to_frame(rows, table))
                except Exception as e:  # a malformed row: drop this batch, say so, go on
                    self.lost[table] += len(rows)
                    self._note_lost(f"{table} rows could not be converted "
                                    f"({type(e).__name__}: {' '.join(str(e).split())[:120]})")
                    self.bus.emit("recorder_error", f"{len(rows)} {table} rows dropped: not convertible",
                                  "error", table=table, rows=len(rows), exception=type(e).__name__)
        self._trim_pending()

    def _trim_pending(self) -> None:
        """Hold at most HOLD_S of unwritten rows per table (like the bus ring); older ones are lost."""
        for table, frames in self._pending.items():
            while len(frames) > 1:
                first, last = cast("datetime | None", frames[0]["ts"].min()), cast("datetime | None", frames[-1]["ts"].max())
                if first is None or last is None or (last - first).total_seconds() <= HOLD_S:
                    break
                gone = frames.pop(0)
                self.lost[table] += gone.height
                self._note_lost(f"writing failed for longer than the {HOLD_S:g} s hold: {self._error_line}")

    def flush(self) -> None:
        """Drain the bus and write what is held; never raises. A failure keeps the rows held for the
        next try (segment numbers are only used by files that were written)."""
        with self._lock:
            if self._fatal:
                return
            try:
                self._drain()
                for table in schema.TABLES:
                    frames = self._pending[table]
                    if frames:
                        df = frames[0] if len(frames) == 1 else pl.concat(frames, how="vertical_relaxed")
                        stream = self._stream[table]
                        if stream is None or stream.broken:  # a broken one stays on disk as it is
                            stream = self._stream[table] = StreamFile(
                                self.dir / f"{table}-{self._seg[table] + 1:06d}.arrows", self._seg[table] + 1)
                        self.bytes += append_stream(stream, df)
                        self._seg[table] += 1
                        self._pending[table] = []
                        if table == "samples":
                            self.rows += df.height
                    stream = self._stream[table]
                    if stream is not None and not stream.broken and stream.batches >= self.roll_every:
                        self._roll(table)  # retried each flush until it works (the rows are on disk)
            except Exception as e:
                self._fail(e, "recording paused")
                return
            if self.error is not None:
                self._resumed()

    def _roll(self, table: str) -> None:
        """Turn the open stream file of `table` into one Parquet chunk (fsynced), then delete it; the
        next flush starts a new stream file."""
        stream = self._stream[table]
        if stream is None:
            return
        out = self.dir / f"{table}-c{stream.first:06d}-{stream.first + stream.batches - 1:06d}.parquet"
        if stream.batches:
            self._merge(table, [stream.path], out, level=3, sort=False, keep=True)
        stream.close()
        self._stream[table] = None
        self.bytes -= stream.size
        unlink_quietly(stream.path)

    def _close_streams(self) -> None:
        for table, stream in self._stream.items():
            if stream is not None:
                stream.close()
                self._stream[table] = None

    def _compact(self) -> None:
        self._close_streams()
        for table in schema.TABLES:
            parts = sorted((p for p in self.dir.glob(f"{table}-*") if data_part(p.name)),
                           key=lambda p: (first_flush(p.name), p.name))
            self._merge(table, parts, self.dir / f"{table}.parquet", level=9, sort=True)

    def _merge(self, table: str, parts: list[Path], out: Path, level: int, sort: bool, keep: bool = False) -> None:
        """Write `parts` as one file `out` (fsynced), then delete them (unless `keep`: the caller does);
        keeps `bytes` true."""
        frames = [df for df in (read_part(p) for p in parts) if df.width]
        df = pl.concat(frames, how="vertical_relaxed") if frames else schema.empty(table)
        new = write_atomic(df.sort("ts", maintain_order=True) if sort else df, out, level=level)
        if not keep:
            for p in parts:
                self.bytes -= p.stat().st_size
                p.unlink()
        self.bytes += new

    # -- errors -------------------------------------------------------------------------------------
    def _fail(self, e: BaseException, what: str) -> None:
        name, line = classify_error(e, self.dir)
        retry = "" if self._fatal or self._stop.is_set() else f"; retrying every {self.retry_s:g} s"
        self.error = f"{what}: {line}{retry}"
        self._error_line = f"{what}: {line}"
        if self._error_since is None:
            self._error_since = time.monotonic()
        key = f"{what}|{name}"
        if key != self._error_key:  # one event per distinct problem, not one per retry
            self._error_key = key
            self.bus.emit("recorder_error", self.error, "error", errno=name, folder=str(self.dir),
                          exception=type(e).__name__, retry_s=None if retry == "" else self.retry_s)

    def _resumed(self) -> None:
        took = time.monotonic() - (self._error_since or time.monotonic())
        lost = {t: n for t, n in self.lost.items() if n}
        msg = (f"recording resumed after {took:.0f} s; "
               + (f"{self._describe_lost(lost)} lost" if lost else "no rows lost"))
        was = self.error
        self.error, self._error_key, self._error_since = None, None, None
        self.bus.emit("recorder_resumed", msg, "warning" if lost else "info", after_s=round(took, 1),
                      error=was, lost_rows=lost)

    def _note_lost(self, reason: str) -> None:
        if self.incomplete_reason is None:
            self.incomplete_reason = reason

    @staticmethod
    def _describe_lost(counts: dict[str, int]) -> str:
        return ", ".join(f"{n} {t} rows" for t, n in counts.items() if n) or "no rows"

    @property
    def state(self) -> str:
        if self.error:
            return "error"
        return "stopped" if self._stop.is_set() else "recording"


def to_frame(rows: list[dict[str, Any]], table: str) -> pl.DataFrame:
    """Rows (dicts, `ts` as UTC microseconds) -> a DataFrame with exactly the table's schema."""
    return pl.from_dicts(rows, schema=schema.TABLES[table], strict=False)
