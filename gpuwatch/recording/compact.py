"""`gpuwatch compact SESSION`: a session whose recorder was killed (kill -9, power, the OOM killer) holds its
last rows in Arrow stream files that replay reads but DuckDB does not; `compact_session` merges them into
one Parquet file per table, the way a clean stop does, and keeps what meta.json said about a session that
was not closed cleanly. The CLI only parses the folder and prints the line this returns."""

from __future__ import annotations

import errno
import json
import os
from datetime import datetime, timezone
from pathlib import Path

from gpuwatch.errors import GpuwatchError, RecordingError, UsageError
from gpuwatch.recording import schema
from gpuwatch.recording.layout import os_why, session_locked, table_files
from gpuwatch.recording.reader import SessionReader, read_table_file, table_max
from gpuwatch.recording.writer import Recorder, write_json_atomic
from gpuwatch.telemetry.bus import Bus

__all__ = ["compact_session"]


def compact_session(folder: Path) -> str:
    """Compact `folder` in place; returns the one status line to show. UsageError: no such folder (or a
    symbolic link loop), not a session, or one still being recorded; GpuwatchError: a damaged file or a
    meta.json replay would refuse (the reader's line: a list, an unknown schema version...), nothing changed."""
    folder = Path(folder)
    try:
        os.stat(folder)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UsageError(f"{folder}: symbolic link loop") from None
        if e.errno == errno.ENOENT:
            raise UsageError(f"{folder}: no such folder") from None
        raise UsageError(f"{folder}: cannot read ({os_why(e)})") from None
    if not folder.is_dir() or not (folder / "meta.json").is_file():
        raise UsageError(f"{folder}: not a session folder (no meta.json)")
    if session_locked(folder):
        raise UsageError(f"{folder}: still being recorded by a running gpuwatch; stop it first")
    SessionReader(folder)  # meta.json as every reader checks it: RecordingError (one line) before anything
    files = [p for t in schema.TABLES for p in table_files(folder, t)]
    parts = [p for p in files if p.name not in {f"{t}.parquet" for t in schema.TABLES}]
    if not parts:
        for p in files:  # compact in name: each file must also read whole (a truncated one said "already compact")
            try:
                read_table_file(p)
            except RecordingError as e:
                raise GpuwatchError(f"{folder}: already compacted, but {e}; nothing was changed") from None
        return f"{folder}: already compact; nothing to do"
    try:
        old = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise GpuwatchError(f"{folder / 'meta.json'}: cannot be read ({e}); nothing was changed") from None
    rec = Recorder(Bus(), folder.parent, {}, name=folder.name,
                   resume={"at": datetime.now(timezone.utc).isoformat(), "by": "gpuwatch compact"})
    rec.start()
    rec.stop()
    if rec.error:
        raise GpuwatchError(f"{folder}: {rec.error}")
    if isinstance(old, dict) and not old.get("complete"):
        # compaction closes the files, it does not make a killed session whole: keep what meta.json said
        _keep_incomplete(folder, old)
    return (f"{folder}: compacted {len(parts)} file(s) into one Parquet file per table "
            f"({rec.rows} sample rows, {rec.bytes / 2**20:.1f} MiB)")


def _keep_incomplete(folder: Path, old: dict) -> None:
    """After compacting a session that was not closed cleanly: meta.json keeps complete: false, the reason
    and the rows lost, and its end is the last sample recorded (not the time of compaction)."""
    meta = json.loads((folder / "meta.json").read_text())
    lost = dict(old.get("lost_rows") or {})
    for t, n in (meta.get("lost_rows") or {}).items():
        lost[t] = lost.get(t, 0) + n
    why = old.get("incomplete_reason") or "the recorder was killed (no clean stop); the last second may be missing"
    meta.update(complete=False, incomplete_reason=f"{why}; compacted later by gpuwatch compact",
                lost_rows={t: n for t, n in lost.items() if n})
    last = table_max(folder, "samples", "ts")
    if last is not None:  # none (no samples table): keep the end compaction wrote
        meta["end"] = last.isoformat()
    write_json_atomic(meta, folder / "meta.json")
