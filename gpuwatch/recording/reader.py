"""Open a recorded session (a folder) or a single Parquet or stream file, validating what it reads.

A session's open tables are Arrow IPC stream files (`samples-000001.arrows`, see ipc.py): they are read
up to their last complete record batch (a torn tail is left out) and, when followed, only the bytes
they gained since the last read are decoded. Which files make a table is `layout.select_files`, the
rules every reader shares (replay, follow, resume, compaction).

A corrupt or truncated segment, a file that is not Parquet, a wrong schema, a FIFO or a folder named
like a segment is reported as one line naming the file; every intact segment is still read. Only when
nothing at all can be read (or meta.json is unreadable, malformed or of an unknown schema version) does
opening fail, with `RecordingError` (one line, naming the file). `SessionReader(...)`, `load_new()`
and `open_recording(...)` raise nothing else.
`SessionReader.load_new()` reads only files (and stream batches) that appeared since the last call: that is how
`replay --follow` keeps up with a session another process is still writing.
A session whose meta.json says `complete: false` is reported by `incomplete_reason` (one line).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, cast

import polars as pl

from gpuwatch.errors import RecordingError
from gpuwatch.recording import schema
from gpuwatch.recording.ipc import IPC_CONT, read_ipc_prefix
from gpuwatch.recording.layout import (CHUNK_RE, COMPACT_RE, SEGMENT_RE, STREAM_RE, check_frame, data_names,
                                       fatal_exc, first_flush, one_line, os_why, read_regular, select_files,
                                       stat_regular, table_files)

__all__ = ["Recording", "SessionReader", "TablesReader", "StreamState", "PartialRead", "column_max", "open_recording", "read_stream_new",
           "read_table_file", "table_max", "validate_meta"]

META_MAX_BYTES = 16 * 2**20  # a meta.json is a few KiB; anything this big is not one
STALE_S = 60.0  # an incomplete session with no data this long is taken as stopped, not still recording


def _readable() -> str:
    return " and ".join(str(v) for v in schema.READABLE_VERSIONS)


@dataclass
class StreamState:
    """How far a stream file has been read: its schema message, the end of the last whole batch read."""

    head: bytes | None = None
    end: int = 0
    batches: int = 0
    problem: str | None = None  # the framing broke here: nothing after it is read


def read_stream_new(path: Path, state: StreamState, table: str | None = None
                    ) -> tuple[str | None, pl.DataFrame | None]:
    """The record batches a stream file gained since `state` (which is advanced): (table, frame), frame
    None when there is nothing new. A torn or still growing tail is left for the next call; a file that is
    gone (rolled into a chunk meanwhile) is nothing new. Raises RecordingError (one line naming the file)
    when the file cannot be read at all or its framing broke (once; later calls return nothing)."""
    if state.problem is not None:
        return table, None
    data = read_regular(path, state.end)
    if data is None:
        return table, None
    if state.head is None and data and data[:4] != IPC_CONT:
        state.problem = "not an Arrow IPC stream"
        raise RecordingError(f"{path}: {state.problem}")
    try:
        df, head, end, n, why = read_ipc_prefix(data, 0, state.head)
    except ValueError as e:
        state.problem = f"not an Arrow IPC stream ({one_line(e, 80)})"
        raise RecordingError(f"{path}: {state.problem}") from None
    state.head = head
    at = state.end
    state.end, state.batches = at + end, state.batches + n
    if why is not None:  # later batches would not line up: stop reading this file
        state.problem = why
    out = None
    if df is not None:
        table, out = check_frame(path, df, table)
    if why is not None:
        raise PartialRead(table, out, f"{path}: {why}; {state.batches} batches read, the rest skipped")
    return table, out


class PartialRead(RecordingError):
    """A stream file read up to a damaged batch: the frame before it, and the warning."""

    def __init__(self, table: str | None, df: pl.DataFrame | None, msg: str) -> None:
        super().__init__(msg)
        self.table, self.df = table, df


def read_table_file(path: Path, table: str | None = None) -> tuple[str, pl.DataFrame]:
    """Read one Parquet or stream file of a session; raises RecordingError (one line, naming the file)."""
    if path.suffix == ".arrows":
        stat_regular(path)
        try:
            t, df = read_stream_new(path, StreamState(), table)
        except PartialRead as e:
            t, df = e.table, e.df
            if df is None:
                raise RecordingError(str(e)) from None
        if df is None:
            raise RecordingError(f"{path}: no complete record batch")
        return cast(str, t), df  # a record batch always comes with its table's name
    stat_regular(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced between stat and open
                raise RecordingError(f"{path}: not a regular file")
            with os.fdopen(fd, "rb", closefd=False) as fh:
                head = fh.read(4)
                fh.seek(0, 2)
                size = fh.tell()
                fh.seek(max(0, size - 4))
                tail = fh.read(4)
        finally:
            os.close(fd)
    except OSError as e:
        raise RecordingError(f"{path}: cannot read ({os_why(e)})") from None
    if size == 0:
        raise RecordingError(f"{path}: empty file (0 bytes)")
    if head != b"PAR1" or tail != b"PAR1" or size < 12:
        what = "truncated Parquet file" if head == b"PAR1" else "not a Parquet file"
        raise RecordingError(f"{path}: {what}")
    try:
        version = pl.read_parquet_metadata(path).get("gpuwatch_schema_version")
        df = pl.read_parquet(path)
    except BaseException as e:  # polars raises several types (and panics) for corrupt pages
        if fatal_exc(e):
            raise
        raise RecordingError(f"{path}: corrupt Parquet ({one_line(e)})") from None
    if version is not None and version not in {str(v) for v in schema.READABLE_VERSIONS}:
        raise RecordingError(f"{path}: schema version {version[:20]!r}, this gpuwatch reads {_readable()}")
    return check_frame(path, df, table)


# meta.json fields gpuwatch reads, and the JSON types each may have (None: null allowed)
_INT, _NUM, _STR, _BOOL, _LIST, _DICT = (int,), (int, float), (str,), (bool,), (list,), (dict,)
_META_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "start": (_STR, True), "end": (_STR, True), "complete": (_BOOL, True), "host": (_STR, True),
    "platform": (_STR, True), "pid": (_INT, True), "cpu_count": (_INT, True), "gpu_backend": (_STR, True),
    "sampler": (_STR, True), "gpu_note": (_STR, True), "driver_version": (_STR, True),
    "gpus": (_LIST, True), "versions": (_DICT, True), "argv": (_LIST, True), "config": (_DICT, True),
    "rows": (_INT, True), "bytes": (_INT, True), "dropped": (_INT, True),
    "incomplete_reason": (_STR, True), "lost_rows": (_DICT, True), "single_file": (_BOOL, True),
}
_GPU_FIELDS: dict[str, tuple[type, ...]] = {
    "index": _INT, "name": _STR, "uuid": _STR, "pci_bus_id": _STR, "mem_total_bytes": _INT,
    "power_limit_w": _NUM, "temp_slowdown_c": _NUM,
}
_NAMES = {int: "a whole number", float: "a number", str: "text", bool: "true or false",
          list: "a list", dict: "an object"}


def _json_type(v: Any) -> str:
    return {bool: "a boolean", int: "a number", float: "a number", str: "text", list: "a list",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)


def _fits(v: Any, types: tuple[type, ...], nullable: bool = True) -> bool:
    if v is None:
        return nullable
    if isinstance(v, bool) and bool not in types:
        return False
    if isinstance(v, float) and float in types:
        return v == v and abs(v) != float("inf")
    return isinstance(v, types)


def validate_meta(meta: Any, where: Path) -> dict[str, Any]:
    """Check the parsed meta.json; RecordingError (one line naming the file) if gpuwatch cannot use it."""
    if not isinstance(meta, dict):
        raise RecordingError(f"{where}: not a JSON object ({_json_type(meta)})")
    if "schema_version" not in meta:
        raise RecordingError(f"{where}: schema_version missing, this gpuwatch reads {_readable()}")
    version = meta["schema_version"]
    if isinstance(version, bool) or version not in schema.READABLE_VERSIONS:
        shown = repr(version)[:40]
        raise RecordingError(f"{where}: schema version {shown}, this gpuwatch reads {_readable()}")
    for key, (types, nullable) in _META_FIELDS.items():
        if key in meta and not _fits(meta[key], types, nullable):
            raise RecordingError(f"{where}: {key!r} is {_json_type(meta[key])}, expected "
                                 f"{_NAMES[types[0]]}")
    for i, g in enumerate(meta.get("gpus") or []):
        if not isinstance(g, dict):
            raise RecordingError(f"{where}: gpus[{i}] is {_json_type(g)}, expected an object")
        for key, types in _GPU_FIELDS.items():
            if key in g and not _fits(g[key], types):
                raise RecordingError(f"{where}: gpus[{i}].{key} is {_json_type(g[key])}, expected {_NAMES[types[0]]}")
    loads = (meta.get("config") or {}).get("workloads")
    if loads is not None:
        if not isinstance(loads, list) or not all(isinstance(w, dict) for w in loads):
            raise RecordingError(f"{where}: config.workloads is not a list of objects")
        for i, w in enumerate(loads):
            faults = w.get("faults")
            if faults is not None and not isinstance(faults, dict):
                raise RecordingError(f"{where}: config.workloads[{i}].faults is {_json_type(faults)}, expected an object")
            lim = (faults or {}).get("memory_limit_bytes")
            if not _fits(lim, _INT):
                raise RecordingError(f"{where}: config.workloads[{i}].faults.memory_limit_bytes is "
                                     f"{_json_type(lim)}, expected a whole number")
    return meta


@dataclass
class Recording:
    path: Path
    meta: dict[str, Any]
    samples: pl.DataFrame
    steps: pl.DataFrame
    events: pl.DataFrame
    risk: pl.DataFrame = field(default_factory=lambda: schema.empty("risk"))
    warnings: list[str] = field(default_factory=list)
    incomplete_reason: str | None = None  # None when the session was closed cleanly (or is one file)

    @property
    def complete(self) -> bool:
        return bool(self.meta.get("complete"))

    @property
    def gpus(self) -> list[int]:
        return sorted(g for g in self.samples["gpu"].unique().to_list() if g is not None)


class TablesReader:
    """A session held in memory, not in a folder (a counterfactual-cap copy, predict/counterfactual.py): what a
    `ReplaySource` reads of a reader - `path` (its name; nothing is there), `meta`, `warnings` and `load_new`
    (the tables once, then nothing new)."""

    def __init__(self, path: Path | str, meta: dict[str, Any], tables: dict[str, pl.DataFrame]) -> None:
        self.path = Path(path)
        self.meta = meta
        self.warnings: list[str] = []
        self._tables: dict[str, pl.DataFrame] | None = {t: tables.get(t, schema.empty(t)) for t in schema.TABLES}

    def load_new(self) -> dict[str, pl.DataFrame]:
        out, self._tables = self._tables, None
        return out if out is not None else {t: schema.empty(t) for t in schema.TABLES}


class SessionReader:
    """Incremental reader of one session folder (or one file)."""

    def __init__(self, path: Path | str) -> None:
        try:
            self.path = Path(path)
        except TypeError:
            raise RecordingError(f"{path!r}: not a path") from None
        self.meta: dict[str, Any] = {}
        self.warnings: list[str] = []
        self._seen: set[str] = set()
        self._rows: dict[str, dict[str, int]] = {t: {} for t in schema.TABLES}  # rows returned per file
        self._streams: dict[str, StreamState] = {}  # how far each stream file has been read
        self._last_us: int | None = None  # the newest sample or event read so far
        self._loaded_once = False
        self.no_meta: str | None = None  # the warning a folder without meta.json gets (None: it has one)
        try:
            st = os.stat(self.path)
        except OSError as e:
            if e.errno == errno.ENOENT:
                raise RecordingError(f"{self.path}: no such file or folder") from None
            if e.errno == errno.ELOOP:
                raise RecordingError(f"{self.path}: symbolic link loop") from None
            raise RecordingError(f"{self.path}: cannot read ({os_why(e)})") from None
        except ValueError as e:  # e.g. a NUL byte in the path
            raise RecordingError(f"{path!r}: bad path ({one_line(e)})") from None
        if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
            raise RecordingError(f"{self.path}: not a session folder or a Parquet file (a FIFO, socket or device)")
        self._is_file = stat.S_ISREG(st.st_mode)
        self.guard(self.read_meta)

    def guard(self, fn, *a):
        """Run `fn`; anything but RecordingError becomes one (one line naming the session)."""
        try:
            return fn(*a)
        except RecordingError:
            raise
        except BaseException as e:
            if fatal_exc(e):
                raise
            if isinstance(e, OSError):
                raise RecordingError(f"{getattr(e, 'filename', None) or self.path}: cannot read ({os_why(e)})") from None
            raise RecordingError(f"{self.path}: unreadable ({type(e).__name__}: {one_line(e)})") from None

    def read_meta(self) -> dict[str, Any]:
        if self._is_file:
            self.meta = {"schema_version": schema.SCHEMA_VERSION, "single_file": True}
            return self.meta
        mp = self.path / "meta.json"
        try:
            os.stat(mp)
            present = True
        except FileNotFoundError:
            present = False
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise RecordingError(f"{mp}: symbolic link loop") from None
            raise RecordingError(f"{mp}: cannot read ({os_why(e)})") from None
        if not present:
            if not any(self._parquet_names()):
                raise RecordingError(f"{self.path}: not a gpuwatch session (no meta.json, no Parquet files)")
            self.no_meta = f"{mp}: missing; reading the Parquet files alone"
            self.warnings.append(self.no_meta)
            self.meta = {"schema_version": schema.SCHEMA_VERSION, "complete": False,
                         "incomplete_reason": "no meta.json"}
            return self.meta
        st = stat_regular(mp)
        if st.st_size > META_MAX_BYTES:
            raise RecordingError(f"{mp}: {st.st_size} bytes, too big to be a gpuwatch meta.json")
        try:
            fd = os.open(mp, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
            with os.fdopen(fd, "rb") as fh:
                raw = fh.read(META_MAX_BYTES + 1)
        except OSError as e:
            raise RecordingError(f"{mp}: cannot read ({os_why(e)})") from None
        if not raw.strip():
            raise RecordingError(f"{mp}: empty file")
        try:
            meta = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise RecordingError(f"{mp}: not JSON (not UTF-8 text)") from None
        except (ValueError, RecursionError) as e:
            raise RecordingError(f"{mp}: not JSON ({one_line(e, 100)})") from None
        self.meta = validate_meta(meta, mp)
        return self.meta

    def _parquet_names(self) -> list[str]:
        return data_names(self.path)

    def _files(self) -> list[tuple[str, Path]]:
        """Data files to read now, in read order (see `select_files`): files not read before, and the
        open stream files every time (they grow)."""
        if self._is_file:
            return [] if str(self.path) in self._seen else [("", self.path)]
        chosen, unknown = select_files(self._parquet_names())
        for n in unknown:
            if n not in self._seen:
                self.warnings.append(f"{self.path / n}: not a gpuwatch file name; skipped")
                self._seen.add(n)
        out = [(t, self.path / n) for t, names in chosen.items() for n in names
               if n not in self._seen or STREAM_RE.match(n)]
        return sorted(out, key=lambda tp: (first_flush(tp[1].name), tp[1].name))

    def _already_read(self, table: str, name: str) -> int:
        """Rows of a new chunk or compacted file that earlier reads returned from the segments or the
        stream it merged (a follower read them before the writer rolled or compacted): its prefix."""
        got = self._rows[table]
        if m := CHUNK_RE.match(name):
            a, b = int(m.group(2)), int(m.group(3))
            return sum(n for f, n in got.items()
                       if (s := SEGMENT_RE.match(f) or STREAM_RE.match(f)) and a <= int(s.group(2)) <= b)
        if COMPACT_RE.match(name):
            return sum(got.values())
        return 0

    def load_new(self) -> dict[str, pl.DataFrame]:
        """Read files not read before; returns one frame per table (possibly empty). Rows are returned
        once, also when the writer later merges segments into a chunk or compacts the session.
        Raises only RecordingError, and only on the first call: later (a follower's polls), a folder
        that cannot be listed is a warning and no new rows."""
        try:
            out = self.guard(self._load_new)
        except RecordingError as e:
            if not self._loaded_once:
                raise
            if str(e) not in self.warnings:
                self.warnings.append(str(e))
            return {t: schema.empty(t) for t in schema.TABLES}
        self._loaded_once = True
        return out

    def _load_new(self) -> dict[str, pl.DataFrame]:
        frames: dict[str, list[pl.DataFrame]] = {t: [] for t in schema.TABLES}
        for table, p in self._files():
            if STREAM_RE.match(p.name) and not self._is_file:
                state = self._streams.setdefault(p.name, StreamState())
                try:
                    t, df = read_stream_new(p, state, table)
                except PartialRead as e:  # a damaged batch: the ones before it are read, once
                    self.warnings.append(str(e))
                    t, df = e.table, e.df
                except RecordingError as e:
                    self.warnings.append(str(e))
                    self._seen.add(p.name)
                    continue
                if df is None or t is None:
                    continue
                self._rows[t][p.name] = self._rows[t].get(p.name, 0) + df.height
            else:
                self._seen.add(p.name if p.parent == self.path else str(p))
                try:
                    t, df = read_table_file(p, table or None)
                except RecordingError as e:
                    self.warnings.append(str(e))
                    continue
                df = df.slice(self._already_read(t, p.name))
                self._rows[t][p.name] = df.height
            frames[t].append(df)
            if t in ("samples", "events", "steps") and df.height:
                last = cast("datetime | None", df["ts"].max())
                if last is not None:
                    us = int(last.timestamp() * 1e6)
                    self._last_us = us if self._last_us is None else max(self._last_us, us)
        return {t: pl.concat(f, how="vertical_relaxed") if f else schema.empty(t) for t, f in frames.items()}

    @property
    def incomplete_reason(self) -> str | None:
        """None for a session closed cleanly (and for a single file); else one line saying why not."""
        if self._is_file or self.meta.get("complete") is True:
            return None
        last = ""
        if self._last_us is not None:
            last = f"last data {datetime.fromtimestamp(self._last_us / 1e6, timezone.utc):%Y-%m-%d %H:%M:%S} UTC"
        why = self.meta.get("incomplete_reason")
        if why:
            return f"incomplete: {why}" + (f" ({last})" if last else "")
        if self._last_us is not None and time.time() - self._last_us / 1e6 < STALE_S:
            return f"incomplete: still being recorded, or stopped without closing the session ({last})"
        return ("incomplete: the recording process stopped without closing the session"
                + (f" ({last})" if last else " (no data)"))


def column_max(path: Path, column: str) -> Any:
    """The largest value of `column` in one data file (None if empty); a Parquet file's from that column
    alone. Raises like the file's reader (RecordingError, polars' errors)."""
    if path.suffix == ".parquet":
        return pl.scan_parquet(path).select(pl.col(column).max()).collect().item()
    return read_table_file(path)[1][column].max()


def table_max(folder: Path | str, table: str, column: str) -> Any:
    """The largest value of `column` over the files of `table` in a session folder (None if none has
    one); a damaged file is skipped (the others still say how far the data went)."""
    best = None
    for p in table_files(folder, table):
        try:
            v = column_max(p, column)
        except Exception:  # noqa: BLE001 - a damaged file: the others still count
            continue
        if v is not None:
            best = v if best is None else max(best, v)
    return best


def nothing_read(reader: SessionReader, what: str = "no table") -> str:
    """One line saying why a session gave nothing to show (`what`: "no table", "no samples"): a folder
    without meta.json whose files hold no gpuwatch table is no session; else every file that could not be
    read, by name (several damaged tables: all of them, not the first)."""
    where = f"{reader.path}{os.sep}"
    found = [w for w in reader.warnings if w != reader.no_meta]
    problems = [w.removeprefix(where) for w in found]  # each names its file, in the session named once
    if reader.no_meta is not None:
        return (f"{reader.path}: not a gpuwatch session (no meta.json"
                + (f"; {'; '.join(problems)})" if problems else "; no samples, steps or events in its Parquet files)"))
    if len(problems) > 1:
        return f"{reader.path}: {what} could be read ({len(problems)} files): {'; '.join(problems)}"
    if found:
        return found[0]
    return f"{reader.path}: no samples recorded"


def open_recording(path: Path | str) -> Recording:
    """Open a session folder or one Parquet file. Raises RecordingError (only) if nothing can be read."""
    reader = SessionReader(path)
    frames = reader.load_new()

    def build() -> Recording:
        if frames["samples"].is_empty() and frames["events"].is_empty() and frames["steps"].is_empty():
            raise RecordingError(nothing_read(reader))
        return Recording(
            path=reader.path, meta=reader.meta, warnings=reader.warnings,
            samples=frames["samples"].sort("ts", "gpu"), steps=frames["steps"].sort("ts"),
            events=frames["events"].sort("ts"), risk=frames["risk"].sort("ts", "gpu"),
            incomplete_reason=reader.incomplete_reason,
        )

    return reader.guard(build)
