"""The one way gpuwatch replaces a file: every writer in the package (recordings, meta.json, reports, CI
summaries, models and their manifests, profiles) goes through `write_file`, so a reader - replay, a
follower, a CI job, `load_model` checking a hash - sees the old file or the new one, never half of one,
and a failed write leaves neither a torn file nor a stray temp file behind.

How: the content is written to a temp file beside the target (`.NAME.<random>.tmp`: a dot file, so the
session reader skips it, and unique, so two writers of one path never share it), fsynced, renamed over
the target, and the folder is fsynced so the rename itself survives a power loss. `fsync=False` skips
both fsyncs (benchmarks that measure the write alone); a killed process still loses nothing written,
since the page cache belongs to the kernel.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Callable

Content = bytes | str | Callable[[Path], object]


def unlink_quietly(path: Path | str) -> None:
    """Remove `path` if it is there; a failure to remove it is not the caller's problem."""
    try:
        Path(path).unlink(missing_ok=True)
    except OSError:
        pass


def temp_path(path: Path) -> Path:
    """A fresh temp name beside `path` (same folder, so the rename never crosses a file system)."""
    return path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")


def fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable; a no-op where folders cannot be opened (not POSIX)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a folder; the rename happened all the same
        pass
    finally:
        os.close(fd)


def write_file(path: Path | str, content: Content, *, fsync: bool = True, mode: int | None = None) -> int:
    """Replace `path` with `content` atomically; returns the new file's size in bytes.

    `content`: bytes, text (UTF-8), or a function that writes the temp file it is given (polars,
    joblib). `mode`: the file's permission bits (default: what the process's umask gives a new file).
    On any failure - the write, the fsync, the rename, Ctrl-C - the temp file is removed and the
    exception propagates; the target is untouched."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        if callable(content):
            content(tmp)
        else:
            with open(tmp, "xb") as fh:
                fh.write(content.encode("utf-8") if isinstance(content, str) else content)
        if fsync:
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        unlink_quietly(tmp)
        raise
    if fsync:
        fsync_dir(path.parent)
    return path.stat().st_size
