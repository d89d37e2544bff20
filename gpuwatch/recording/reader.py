"""Open a recorded session (a folder) or a single Parquet file, validating what it reads.

A corrupt or truncated segment, a file that is not Parquet, or a wrong schema is reported as one line
naming the file; every intact segment is still read. Only when nothing at all can be read (or the
session's schema version is unknown) does opening fail, with `RecordingError`.
`SessionReader.load_new()` reads only files that appeared since the last call: that is how
`replay --follow` keeps up with a session another process is still writing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from gpuwatch.errors import RecordingError
from gpuwatch.recording import schema
from gpuwatch.recording.writer import CHUNK_RE, COMPACT_RE, SEGMENT_RE


def _readable() -> str:
    return " and ".join(str(v) for v in schema.READABLE_VERSIONS)


def _table_of(df_schema: pl.Schema) -> str | None:
    if "risk" in df_schema and "alarm" in df_schema:
        return "risk"
    if "tick" in df_schema:
        return "samples"
    if "step" in df_schema:
        return "steps"
    if "kind" in df_schema:
        return "events"
    return None


def read_table_file(path: Path, table: str | None = None) -> tuple[str, pl.DataFrame]:
    """Read one Parquet file of a session; raises RecordingError (one line, naming the file)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4)
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(0, size - 4))
            tail = fh.read(4)
    except OSError as e:
        raise RecordingError(f"{path}: cannot read ({e.strerror or e})") from None
    if head != b"PAR1" or tail != b"PAR1":
        what = "truncated Parquet file" if head == b"PAR1" else "not a Parquet file"
        raise RecordingError(f"{path}: {what}")
    try:
        version = pl.read_parquet_metadata(path).get("gpuwatch_schema_version")
        df = pl.read_parquet(path)
    except Exception as e:  # polars raises several types for corrupt pages
        raise RecordingError(f"{path}: corrupt Parquet ({str(e).splitlines()[0][:120]})") from None
    if version is not None and version not in {str(v) for v in schema.READABLE_VERSIONS}:
        raise RecordingError(f"{path}: schema version {version}, this gpuwatch reads {_readable()}")
    table = table or _table_of(df.schema)
    if table is None:
        raise RecordingError(f"{path}: not a gpuwatch table (columns: {', '.join(df.columns[:6])})")
    problems = schema.check_schema(df.schema, table)
    if problems:
        raise RecordingError(f"{path}: wrong schema for {table}: {problems[0]}")
    return table, schema.conform(df, table)


@dataclass
class Recording:
    path: Path
    meta: dict[str, Any]
    samples: pl.DataFrame
    steps: pl.DataFrame
    events: pl.DataFrame
    risk: pl.DataFrame = field(default_factory=lambda: schema.empty("risk"))
    warnings: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return bool(self.meta.get("complete"))

    @property
    def gpus(self) -> list[int]:
        return sorted(g for g in self.samples["gpu"].unique().to_list() if g is not None)


class SessionReader:
    """Incremental reader of one session folder (or one file)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise RecordingError(f"{self.path}: no such file or folder")
        self.meta: dict[str, Any] = {}
        self.warnings: list[str] = []
        self._seen: set[str] = set()
        self._covered: dict[str, list[tuple[int, int]]] = {t: [] for t in schema.TABLES}
        self._rows: dict[str, dict[str, int]] = {t: {} for t in schema.TABLES}  # rows returned per file
        self.read_meta()

    def read_meta(self) -> dict[str, Any]:
        if self.path.is_file():
            self.meta = {"schema_version": schema.SCHEMA_VERSION, "single_file": True}
            return self.meta
        mp = self.path / "meta.json"
        if not mp.exists():
            if not any(self.path.glob("*.parquet")):
                raise RecordingError(f"{self.path}: not a gpuwatch session (no meta.json, no Parquet files)")
            self.warnings.append(f"{mp}: missing; reading the Parquet files alone")
            self.meta = {"schema_version": schema.SCHEMA_VERSION}
            return self.meta
        try:
            self.meta = json.loads(mp.read_text())
        except (OSError, ValueError) as e:
            raise RecordingError(f"{mp}: unreadable ({str(e)[:100]})") from None
        version = self.meta.get("schema_version")
        if version not in schema.READABLE_VERSIONS:
            raise RecordingError(f"{mp}: schema version {version!r}, this gpuwatch reads {_readable()}")
        return self.meta

    def _files(self) -> list[tuple[str, Path]]:
        """New data files in read order: compacted files win over chunks, chunks over segments."""
        if self.path.is_file():
            return [] if str(self.path) in self._seen else [("", self.path)]
        out = []
        names = sorted(p.name for p in self.path.iterdir() if p.suffix == ".parquet" and not p.name.startswith("."))
        compacted = {COMPACT_RE.match(n).group(1) for n in names if COMPACT_RE.match(n)}
        for n in names:
            m = COMPACT_RE.match(n) or CHUNK_RE.match(n) or SEGMENT_RE.match(n)
            if not m:
                if n not in self._seen:
                    self.warnings.append(f"{self.path / n}: not a gpuwatch file name; skipped")
                    self._seen.add(n)
                continue
            table = m.group(1)
            if n in self._seen or (table in compacted and not COMPACT_RE.match(n)):
                continue
            if CHUNK_RE.match(n):
                self._covered[table].append((int(m.group(2)), int(m.group(3))))
            out.append((table, self.path / n))
        # a chunk written just before a crash may duplicate segments that were not yet deleted
        out = [(t, p) for t, p in out if not (SEGMENT_RE.match(p.name) and any(
            a <= int(SEGMENT_RE.match(p.name).group(2)) <= b for a, b in self._covered[t]))]
        return sorted(out, key=lambda tp: _first_segment(tp[1].name))

    def _already_read(self, table: str, name: str) -> int:
        """Rows of a new chunk or compacted file that earlier reads returned from the segments it merged
        (a follower read them before the writer rolled or compacted): they form its prefix."""
        got = self._rows[table]
        if m := CHUNK_RE.match(name):
            a, b = int(m.group(2)), int(m.group(3))
            return sum(n for f, n in got.items() if (s := SEGMENT_RE.match(f)) and a <= int(s.group(2)) <= b)
        if COMPACT_RE.match(name):
            return sum(got.values())
        return 0

    def load_new(self) -> dict[str, pl.DataFrame]:
        """Read files not read before; returns one frame per table (possibly empty). Rows are returned
        once, also when the writer later merges segments into a chunk or compacts the session."""
        frames: dict[str, list[pl.DataFrame]] = {t: [] for t in schema.TABLES}
        for table, p in self._files():
            self._seen.add(p.name if p.parent == self.path else str(p))
            try:
                t, df = read_table_file(p, table or None)
            except RecordingError as e:
                self.warnings.append(str(e))
                continue
            df = df.slice(self._already_read(t, p.name))
            self._rows[t][p.name] = df.height
            frames[t].append(df)
        return {t: pl.concat(f, how="vertical_relaxed") if f else schema.empty(t) for t, f in frames.items()}


def _first_segment(name: str) -> int:
    """Read order: by the first segment a file holds (a compacted file holds them all)."""
    m = SEGMENT_RE.match(name) or CHUNK_RE.match(name)
    return int(m.group(2)) if m else 0


def open_recording(path: Path | str) -> Recording:
    """Open a session folder or one Parquet file. Raises RecordingError if nothing can be read."""
    reader = SessionReader(path)
    frames = reader.load_new()
    if frames["samples"].is_empty() and frames["events"].is_empty() and frames["steps"].is_empty():
        why = reader.warnings[0] if reader.warnings else f"{reader.path}: no samples recorded"
        raise RecordingError(why)
    return Recording(
        path=reader.path, meta=reader.meta, warnings=reader.warnings,
        samples=frames["samples"].sort("ts", "gpu"), steps=frames["steps"].sort("ts"),
        events=frames["events"].sort("ts"), risk=frames["risk"].sort("ts", "gpu"),
    )
