"""The crash-safe session recorder.

A session is a folder `<root>/<UTC start>-<host>/`:
  meta.json                       host, GPUs, driver, versions, command line, config, schema version
  samples-000001.parquet ...      one segment per table per flush (~1 s), written to a temp name and
  steps-000001.parquet            renamed, so a reader never sees half a file and `kill -9` loses at most
  events-000001.parquet           the last flush interval
  samples-c000001-000300.parquet  every `roll_every` segments are merged into one chunk (bounded file count)
  samples.parquet ...             after a clean stop: one compacted file per table, segments removed

Writing runs on its own thread; the sampler never waits for the disk. Any OSError (a full disk, a
removed folder) stops recording with a `recorder_error` event; the process carries on.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import polars as pl

from gpuwatch.recording import schema
from gpuwatch.telemetry.bus import Bus
from gpuwatch.threads import start_thread

SEGMENT_RE = re.compile(rf"^({schema.TABLE_RE})-(\d{{6}})\.parquet$")
CHUNK_RE = re.compile(rf"^({schema.TABLE_RE})-c(\d{{6}})-(\d{{6}})\.parquet$")
COMPACT_RE = re.compile(rf"^({schema.TABLE_RE})\.parquet$")
FILE_META = {"gpuwatch_schema_version": str(schema.SCHEMA_VERSION)}


def write_atomic(df: pl.DataFrame, path: Path, level: int = 3, fsync: bool = True) -> int:
    """Write `df` to `path` via a temp file and a rename, so no reader sees half a file.
    `fsync` also survives a power loss; without it a killed process still loses nothing written
    (the page cache belongs to the kernel), which is what the 1 s segments need."""
    tmp = path.with_name(f".{path.name}.tmp")
    df.write_parquet(tmp, compression="zstd", compression_level=level, statistics=True,
                     metadata=FILE_META)
    if fsync:
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path.stat().st_size


def write_json_atomic(obj: dict, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def session_name(start: datetime, host: str | None = None) -> str:
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", host or socket.gethostname())[:40]
    return f"{start:%Y%m%dT%H%M%SZ}-{host}"


class Recorder:
    """Drains the bus into a session folder every `flush_interval` seconds."""

    def __init__(self, bus: Bus, root: Path | str, meta: dict[str, Any], flush_interval: float = 1.0,
                 roll_every: int = 300, name: str | None = None) -> None:
        self.bus, self.flush_interval, self.roll_every = bus, flush_interval, roll_every
        start = datetime.now(timezone.utc)
        self.dir = Path(root) / (name or session_name(start))
        self.meta = {"schema_version": schema.SCHEMA_VERSION, "start": start.isoformat(),
                     "complete": False, **meta}
        self._cursor = {"samples": bus.ticks.next_seq, "steps": bus.steps.next_seq,
                        "events": bus.events.next_seq, "risk": bus.risk.next_seq}
        self._seg = {t: 0 for t in schema.TABLES}
        self._unrolled: dict[str, list[Path]] = {t: [] for t in schema.TABLES}
        self.rows = 0  # sample rows on disk
        self.bytes = 0
        self.dropped = 0  # ticks overwritten in the ring before the recorder read them
        self.error: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._kick = threading.Event()
        self.wait_s = flush_interval  # longest wait between flushes; see kick()
        self._thread: threading.Thread | None = None

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> "Recorder":
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
        except OSError as e:
            self._fail(e)
            return self
        self._thread = start_thread(self._run, "gpuwatch-recorder")
        return self

    def _run(self) -> None:
        while self.error is None:
            self._kick.wait(self.wait_s)
            self._kick.clear()
            if self._stop.is_set():
                return
            self.flush()

    def kick(self) -> None:
        """Flush now. A sampler that delivers ticks a second at a time kicks the recorder as each batch
        arrives (and `wait_s` is raised so the timer only covers a silent sampler): one wake-up a
        second for both, and a batch is on disk as soon as it is here."""
        self._kick.set()

    def stop(self, compact: bool = True) -> None:
        """Final flush; then merge every segment into one file per table and mark the session complete."""
        self._stop.set()
        self._kick.set()
        if self._thread:
            self._thread.join(timeout=10)
        if self.error is not None:
            return
        self.flush()
        if compact and self.error is None:
            try:
                self._compact()
                self.meta.update(complete=True, end=datetime.now(timezone.utc).isoformat(),
                                 rows=self.rows, bytes=self.bytes, dropped=self.dropped)
                write_json_atomic(self.meta, self.dir / "meta.json")
            except OSError as e:
                self._fail(e)

    # -- writing ------------------------------------------------------------------------------------
    def _drain(self) -> dict[str, pl.DataFrame]:
        ticks, self._cursor["samples"], lost = self.bus.ticks.since(self._cursor["samples"])
        self.dropped += lost
        steps, self._cursor["steps"], _ = self.bus.steps.since(self._cursor["steps"])
        events, self._cursor["events"], _ = self.bus.events.since(self._cursor["events"])
        risk, self._cursor["risk"], _ = self.bus.risk.since(self._cursor["risk"])
        rows = [r for t in ticks for r in t.rows]
        frames = {"samples": rows, "steps": steps, "events": [e.row() for e in events], "risk": risk}
        return {t: to_frame(r, t) for t, r in frames.items() if r}

    def flush(self) -> None:
        with self._lock:
            if self.error is not None:
                return
            try:
                for table, df in self._drain().items():
                    self._seg[table] += 1
                    path = self.dir / f"{table}-{self._seg[table]:06d}.parquet"
                    self.bytes += write_atomic(df, path, level=1, fsync=False)
                    self._unrolled[table].append(path)
                    if table == "samples":
                        self.rows += df.height
                    if len(self._unrolled[table]) >= self.roll_every:
                        self._roll(table)
            except OSError as e:
                self._fail(e)

    def _roll(self, table: str) -> None:
        """Merge the open segments of `table` into one chunk file, then delete them."""
        paths = self._unrolled[table]
        first, last = _seq(paths[0]), _seq(paths[-1])
        self._merge(table, paths, self.dir / f"{table}-c{first:06d}-{last:06d}.parquet", level=3, sort=False)
        self._unrolled[table] = []

    def _compact(self) -> None:
        for table in schema.TABLES:
            parts = sorted(self.dir.glob(f"{table}-*.parquet"))
            self._merge(table, parts, self.dir / f"{table}.parquet", level=9, sort=True)

    def _merge(self, table: str, parts: list[Path], out: Path, level: int, sort: bool) -> None:
        """Write `parts` as one file `out` (fsynced), then delete them; keeps `bytes` true."""
        df = pl.concat([pl.read_parquet(p) for p in parts], how="vertical_relaxed") if parts else schema.empty(table)
        new = write_atomic(df.sort("ts") if sort else df, out, level=level)
        for p in parts:
            self.bytes -= p.stat().st_size
            p.unlink()
        self.bytes += new

    def _fail(self, e: OSError) -> None:
        self.error = f"recording stopped: {e.strerror or e} ({getattr(e, 'filename', None) or self.dir})"
        self.bus.emit("recorder_error", self.error, "error", errno=e.errno)

    @property
    def state(self) -> str:
        if self.error:
            return "error"
        return "stopped" if self._stop.is_set() else "recording"


def _seq(p: Path) -> int:
    return int(SEGMENT_RE.match(p.name).group(2))


def to_frame(rows: list[dict[str, Any]], table: str) -> pl.DataFrame:
    """Rows (dicts, `ts` as UTC microseconds) -> a DataFrame with exactly the table's schema."""
    return pl.from_dicts(rows, schema=schema.TABLES[table], strict=False)
