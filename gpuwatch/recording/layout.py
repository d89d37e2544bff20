"""A session folder's layout, shared by everything that writes or reads one (the recorder, the reader,
follow, `stress --resume`, `gpuwatch compact`): the file names, which files make a table, the lock a
recording process holds, and reading a session's files without ever blocking or raising more than one
line. The writer and the reader both build on this module and on `ipc.py`, never on each other.

A session is a folder `<root>/<UTC start>-<host>/`:
  meta.json                       host, GPUs, driver, versions, command line, config, schema version
  samples-000001.arrows           the open stream of each table (an Arrow IPC stream, see ipc.py); the
  steps-000001.arrows ...         number is the first flush it holds
  samples-c000001-000300.parquet  a chunk: the flushes 1-300 of a stream, rolled into Parquet
  samples.parquet ...             after a clean stop: one compacted file per table
  samples-000001.parquet          a segment: one flush per Parquet file (sessions written before streams)
  .gpuwatch.lock                  held (flock) by the process recording the session
Dot files (the lock, temp files of atomic writes) are never data.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import stat
from datetime import datetime
from pathlib import Path

import polars as pl

from gpuwatch.errors import FATAL, RecordingError
from gpuwatch.recording import schema

SEGMENT_RE = re.compile(rf"^({schema.TABLE_RE})-(\d{{6}})\.parquet$")  # sessions before the streams
STREAM_RE = re.compile(rf"^({schema.TABLE_RE})-(\d{{6}})\.arrows$")
CHUNK_RE = re.compile(rf"^({schema.TABLE_RE})-c(\d{{6}})-(\d{{6}})\.parquet$")
COMPACT_RE = re.compile(rf"^({schema.TABLE_RE})\.parquet$")
LOCK_NAME = ".gpuwatch.lock"  # held (flock) by the process recording the session; the reader skips dot files


def session_name(start: datetime, host: str | None = None) -> str:
    """The folder name of a session started at `start` (UTC) on `host` (this host by default)."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", host or socket.gethostname())[:40]
    return f"{start:%Y%m%dT%H%M%SZ}-{host}"


def data_part(name: str) -> re.Match | None:
    """The match of a segment, stream or chunk name (group 1 the table, group 2 its first flush); None
    for a compacted file and for names that are no data file."""
    return SEGMENT_RE.match(name) or STREAM_RE.match(name) or CHUNK_RE.match(name)


def first_flush(name: str) -> int:
    """Read order: the first flush a data file holds (0 for a compacted file: it holds them all)."""
    m = data_part(name)
    return int(m.group(2)) if m else 0


# -- which files make a table -----------------------------------------------------------------------------
def data_names(folder: Path) -> list[str]:
    """The names in a session folder that may be data files (Parquet or Arrow stream, no dot files)."""
    return sorted(n for n in os.listdir(folder) if n.endswith((".parquet", ".arrows")) and not n.startswith("."))


def select_files(names: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """The file rules of a session folder, shared by every reader (replay, follow, `stress --resume`):
    per table, the files that hold its rows, in read order - the compacted file if there is one (it holds
    everything), else the chunks, and the segments and stream files no chunk covers (a crash between
    writing a chunk and deleting what it merged leaves both); and the names that are no gpuwatch file."""
    out: dict[str, list[str]] = {t: [] for t in schema.TABLES}
    unknown: list[str] = []
    compacted = {m.group(1) for n in names if (m := COMPACT_RE.match(n))}
    chunks: dict[str, list[tuple[int, int]]] = {t: [] for t in schema.TABLES}
    for n in names:
        if m := CHUNK_RE.match(n):
            chunks[m.group(1)].append((int(m.group(2)), int(m.group(3))))
    for n in names:
        m = COMPACT_RE.match(n) or data_part(n)
        if not m:
            unknown.append(n)
            continue
        table = m.group(1)
        if table in compacted and not COMPACT_RE.match(n):
            continue
        if (SEGMENT_RE.match(n) or STREAM_RE.match(n)) and any(a <= int(m.group(2)) <= b for a, b in chunks[table]):
            continue
        out[table].append(n)
    for names_ in out.values():
        names_.sort(key=lambda n: (first_flush(n), n))
    return out, unknown


def table_files(folder: Path | str, table: str) -> list[Path]:
    """The files the reader reads for `table` in the session `folder` (see `select_files`)."""
    folder = Path(folder)
    return [folder / n for n in select_files(data_names(folder))[0][table]]


# -- the recording process's lock -------------------------------------------------------------------------
def lock_session(folder: Path) -> int | None:
    """Take the session's lock (non-blocking); returns the fd to keep, None where the file system has no
    locks. Raises BlockingIOError when another live process holds it (`stress --resume` of a session
    still being recorded). The kernel drops the lock when its process dies, kill -9 included."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        return None
    try:
        fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise
    except OSError:
        os.close(fd)
        return None
    return fd


def session_locked(folder: Path) -> bool:
    """Whether a live process holds the session's lock (creates nothing: no lock file, no recorder)."""
    if not (Path(folder) / LOCK_NAME).exists():
        return False
    try:
        unlock_session(lock_session(Path(folder)))
    except BlockingIOError:
        return True
    return False


def unlock_session(fd: int | None) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


# -- reading a session's files: never block on a FIFO, one line naming the file on failure -------------------
def one_line(e: BaseException, n: int = 120) -> str:
    """An exception as one line of at most `n` characters (its type when it says nothing)."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text[:n]


def os_why(e: OSError) -> str:
    """Why an OS call failed, with the errno name: "Permission denied (EACCES)"."""
    name = errno.errorcode.get(e.errno or -1)
    return f"{e.strerror or one_line(e)}" + (f" ({name})" if name else "")


def fatal_exc(e: BaseException) -> bool:
    """What a reader must let through: Ctrl-C, a stop signal and interpreter exit (polars' panics are
    BaseException too, and are not)."""
    return isinstance(e, FATAL)


def stat_regular(path: Path) -> os.stat_result:
    """stat() that names why `path` cannot be read as a file (never opens it: a FIFO would block)."""
    try:
        st = os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise RecordingError(f"{path}: symbolic link loop") from None
        raise RecordingError(f"{path}: cannot read ({os_why(e)})") from None
    if stat.S_ISDIR(st.st_mode):
        raise RecordingError(f"{path}: is a folder, not a file")
    if not stat.S_ISREG(st.st_mode):
        raise RecordingError(f"{path}: not a regular file (a FIFO, socket or device)")
    return st


def read_regular(path: Path, offset: int = 0) -> bytes | None:
    """The bytes of a regular file from `offset` (never blocks on a FIFO); None if it is gone."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise RecordingError(f"{path}: symbolic link loop") from None
        raise RecordingError(f"{path}: cannot read ({os_why(e)})") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise RecordingError(f"{path}: is a folder, not a file")
        if not stat.S_ISREG(st.st_mode):
            raise RecordingError(f"{path}: not a regular file (a FIFO, socket or device)")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            fh.seek(offset)
            return fh.read()
    except OSError as e:
        raise RecordingError(f"{path}: cannot read ({os_why(e)})") from None
    finally:
        os.close(fd)


def table_of(df_schema: pl.Schema) -> str | None:
    """Which table a frame with these columns belongs to (None: no gpuwatch table)."""
    if "risk" in df_schema and "alarm" in df_schema:
        return "risk"
    if "tick" in df_schema:
        return "samples"
    if "step" in df_schema:
        return "steps"
    if "kind" in df_schema:
        return "events"
    return None


def check_frame(path: Path, df: pl.DataFrame, table: str | None) -> tuple[str, pl.DataFrame]:
    """(table, frame conformed to its schema) for a frame read from `path`; RecordingError (one line
    naming the file) when it is no gpuwatch table or its columns do not fit."""
    table = table or table_of(df.schema)
    if table is None:
        raise RecordingError(f"{path}: not a gpuwatch table (columns: {', '.join(df.columns[:6])})")
    problems = schema.check_schema(df.schema, table)
    if problems:
        raise RecordingError(f"{path}: wrong schema for {table}: {problems[0]}")
    try:
        return table, schema.conform(df, table)
    except BaseException as e:
        if fatal_exc(e):
            raise
        raise RecordingError(f"{path}: columns of the wrong type for {table} ({one_line(e)})") from None
