"""The Arrow IPC framing of a session's open stream files: writing one record batch per flush with one
write(), and reading back every complete message of a file that may still be growing or was cut short.

A stream file is one valid Arrow IPC stream without its end marker: the schema message, then one
record batch message per flush. Each message is framed as 0xFFFFFFFF, int32 metadata length L, L bytes
of flatbuffer metadata (8-byte aligned), then the body, whose length the metadata says. A reader adds
the 8-byte end marker in memory. Why streams: a kill -9 never leaves half a write() behind, so at most
the last flush is lost and the file is always one valid stream; an append costs 0.64 ms of CPU where a
Parquet file per flush cost 6.5 ms (docs/BENCHMARKS.md). The newest compat level writes strings as
Arrow string views: the cheapest for polars to write (no conversion); the file is read back by polars
(this gpuwatch or a newer one) and becomes Parquet at the next roll or compaction, which DuckDB and
every other tool reads.
"""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path

import polars as pl

from gpuwatch.atomic import unlink_quietly
from gpuwatch.errors import FATAL
from gpuwatch.recording.layout import read_regular

IPC_COMPAT = pl.CompatLevel.newest()
IPC_CONT = b"\xff\xff\xff\xff"
IPC_EOS = IPC_CONT + b"\x00\x00\x00\x00"  # the end marker a reader adds in memory


def ipc_bytes(df: pl.DataFrame) -> tuple[bytes, bytes]:
    """(schema message, record batch message(s)) of `df` as an Arrow IPC stream."""
    buf = io.BytesIO()
    df.write_ipc_stream(buf, compat_level=IPC_COMPAT)
    data = buf.getbuffer()
    if data[:4] != IPC_CONT or data[-8:] != IPC_EOS:  # polars' framing changed: never write what we cannot read
        raise ValueError("polars wrote an Arrow IPC stream without the continuation framing")
    head = 8 + int.from_bytes(data[4:8], "little")
    return bytes(data[:head]), bytes(data[head:-8])


def ipc_messages(data: bytes | memoryview, start: int = 0) -> tuple[list[tuple[int, int, int]], str | None]:
    """The complete messages of an Arrow IPC stream from byte `start`: [(offset, end, header type)]
    (1 schema, 2 dictionary batch, 3 record batch), and why scanning stopped before the end of `data`
    (None: at the end, or at a message not yet complete - a torn or still growing tail - or at the end
    marker; a line: the framing is broken there)."""
    mv = memoryview(data)
    out: list[tuple[int, int, int]] = []
    pos, n = start, len(mv)
    while pos + 8 <= n:
        if mv[pos:pos + 4] != IPC_CONT:
            return out, f"no message framing at byte {pos}"
        size = int.from_bytes(mv[pos + 4:pos + 8], "little", signed=True)
        if size == 0:  # the end-of-stream marker
            return out, None
        if size < 0 or size % 8 or size > 1 << 24:
            return out, f"bad message length {size} at byte {pos}"
        if pos + 8 + size > n:
            return out, None
        try:
            htype, body = _message_header(mv[pos + 8:pos + 8 + size])
        except (IndexError, ValueError) as e:
            return out, f"bad message metadata at byte {pos} ({e})"
        end = pos + 8 + size + body
        if end > n:
            return out, None
        out.append((pos, end, htype))
        pos = end
    return out, None


def _message_header(meta: memoryview) -> tuple[int, int]:
    """(header type, body length) from a Message flatbuffer (fields: version, header_type, header,
    bodyLength, custom_metadata)."""
    def u(off: int, size: int, signed: bool = False) -> int:
        if off < 0 or off + size > len(meta):
            raise ValueError("offset out of range")
        return int.from_bytes(meta[off:off + size], "little", signed=signed)

    root = u(0, 4)
    vtable = root - u(root, 4, signed=True)
    vsize = u(vtable, 2)
    fields = [u(vtable + 4 + 2 * i, 2) for i in range(max(0, (vsize - 4) // 2))]
    htype = u(root + fields[1], 1) if len(fields) > 1 and fields[1] else 0
    body = u(root + fields[3], 8, signed=True) if len(fields) > 3 and fields[3] else 0
    if htype not in (1, 2, 3) or body < 0 or body % 8:
        raise ValueError(f"header type {htype}, body {body}")
    return htype, body


def read_ipc_prefix(data: bytes, start: int = 0, head: bytes | None = None
                    ) -> tuple[pl.DataFrame | None, bytes | None, int, int, str | None]:
    """Read the complete record batches of a stream file's bytes `data` (from byte `start`, after a
    schema message `head` read before; from the file's start when `head` is None).
    Returns (frame or None when no new batch, schema message, end offset of the last complete message,
    batches read, why the rest was skipped or None). A torn or still growing tail is left for later;
    raises ValueError when not even the schema message can be read."""
    if head is None:
        msgs, why = ipc_messages(data, 0)
        if not msgs or msgs[0][2] != 1:
            if why is None and (len(data) < 8 or data[:4] == IPC_CONT):
                return None, None, 0, 0, None  # the schema message is still being written
            raise ValueError(why or "no schema message at the start")
        head, start, msgs = bytes(data[:msgs[0][1]]), msgs[0][1], msgs[1:]
    else:
        msgs, why = ipc_messages(data, start)
    if any(t != 3 for *_, t in msgs):
        bad = next(i for i, (*_, t) in enumerate(msgs) if t != 3)
        msgs, why = msgs[:bad], f"unexpected message type {msgs[bad][2]} at byte {msgs[bad][0]}"
    if not msgs:
        return None, head, start, 0, why
    end = msgs[-1][1]
    try:
        df = pl.read_ipc_stream(head + bytes(data[start:end]) + IPC_EOS)
    except BaseException as e:  # a batch that frames well but does not decode: keep the batches before it
        if isinstance(e, FATAL):
            raise
        lo, hi, df = 0, len(msgs) - 1, None  # binary search for the longest prefix polars reads
        while lo < hi:
            mid = (lo + hi + 1) // 2
            try:
                df = pl.read_ipc_stream(head + bytes(data[start:msgs[mid - 1][1]]) + IPC_EOS)
                lo = mid
            except BaseException as e2:
                if isinstance(e2, FATAL):
                    raise
                hi = mid - 1
        text = " ".join(str(e).split())[:100] or type(e).__name__
        reason = f"corrupt record batch after {lo} batches ({text})"
        if lo == 0:
            return None, head, start, 0, reason
        df = pl.read_ipc_stream(head + bytes(data[start:msgs[lo - 1][1]]) + IPC_EOS)
        return df, head, msgs[lo - 1][1], lo, reason
    return df, head, end, len(msgs), why


class StreamFile:
    """One table's open stream file: created with its schema message and first batch in one write,
    then one write per flush (O_APPEND). A write that fails (a full disk) is cut back off the file, so
    what is on disk is always whole messages; if even that fails the file is closed (`broken`) and the
    next flush starts a new stream file (readers read the broken one up to its torn tail)."""

    def __init__(self, path: Path, first: int) -> None:
        self.path, self.first = path, first
        self.fd: int | None = None
        self.head: bytes | None = None  # the schema message
        self.size = 0
        self.batches = 0
        self.broken = False

    def append(self, df: pl.DataFrame) -> int:
        """Append `df` as one record batch; returns the bytes added. Raises on failure, leaving the
        file as it was (or `broken`)."""
        if df.n_chunks() > 1:
            df = df.rechunk()
        head, batch = ipc_bytes(df)
        if self.head is not None and head != self.head:
            raise ValueError(f"{self.path}: the table's schema changed within a stream")
        payload = batch if self.fd is not None else head + batch
        created = self.fd is None
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644) if self.fd is None else self.fd
        self.fd = fd
        try:
            _write_all(fd, payload)
        except BaseException:
            try:
                if created:
                    self.close()
                    unlink_quietly(self.path)
                else:
                    os.ftruncate(fd, self.size)
            except OSError:
                self.broken = True
                self.close()
            raise
        self.head = head
        self.size += len(payload)
        self.batches += 1
        return len(payload)

    def close(self) -> None:
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None


def _write_all(fd: int, data: bytes) -> None:
    """One write() (a killed process never leaves half of it; a short write is a full disk: retried
    for the rest, which then raises)."""
    mv = memoryview(data)
    while mv:
        n = os.write(fd, mv)
        if n <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        mv = mv[n:]


def read_stream_file(path: Path) -> tuple[pl.DataFrame | None, int, str | None]:
    """Every complete batch of a stream file: (frame or None, batches, why the rest was skipped). A regular
    file only (RecordingError otherwise: a FIFO named like a stream must not block)."""
    data = read_regular(path) or b""
    df, _head, end, n, why = read_ipc_prefix(data)
    if why is None and end < len(data):  # a writer that is gone left a torn last write (a kill never does)
        why = f"a torn tail of {len(data) - end} bytes"
    return df, n, why
