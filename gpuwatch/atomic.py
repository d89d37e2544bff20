"""The one way gpuwatch replaces a file: every writer in the package (recordings, meta.json, reports, CI
summaries, models and their manifests, profiles) goes through `write_file`, so a reader - replay, a
follower, a CI job, `load_model` checking a hash - sees the old file or the new one, never half of one,
and a failed write leaves neither a torn file nor a stray temp file behind.

How: the content is written to a temp file beside the target (`.NAME.<random>.tmp`: a dot file, so the
session reader skips it, and unique, so two writers of one path never share it), fsynced, renamed over
the target, and the folder is fsynced so the rename itself survives a power loss. `fsync=False` skips
both fsyncs (benchmarks that measure the write alone); a killed process still loses nothing written,
since the page cache belongs to the kernel.

Before a long run, the one precheck of where it will write: `check_output_file` (a file: -o, --junit,
--summary-json, a model, a report) and `check_output_dir` (a recording's folder) create and remove a probe
file there, so a path that cannot be written is one line now, not an error after hours of work.
"""

from __future__ import annotations

import errno
import os
import secrets
import threading
from pathlib import Path
from typing import Callable

from gpuwatch.errors import GpuwatchError, UsageError

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


def os_reason(e: OSError) -> str:
    """An OSError as a short reason: its text and errno name, e.g. `Read-only file system (EROFS)`."""
    name = errno.errorcode.get(e.errno or -1)
    text = e.strerror or str(e) or type(e).__name__
    return f"{text} ({name})" if name else text


def _write_probe(folder: Path) -> Path:
    """Create, write and fsync a probe file in `folder` and return it for the caller to remove (the only
    reliable test: read-only mounts, immutable folders, /proc, quotas and a full disk all show up
    here); OSError where that fails, with nothing left behind."""
    probe = folder / f".gpuwatch-write-test-{os.getpid()}-{threading.get_ident()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"gpuwatch")
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        unlink_quietly(probe)
        raise
    return probe


def check_output_file(path: Path | str | None, flag: str | None = "-o", *, example: str | None = None,
                      create_parent: bool = False, error: type[GpuwatchError] = UsageError) -> None:
    """Raise `error` (one line, naming `flag` and `path`) unless `path` can be written as a file: not a
    folder, its folder there (made first with `create_parent`) and writable. None: nothing to check.
    `example`: a file name suggested inside a folder given by mistake."""
    if path is None:
        return
    where = f"{flag} {path}" if flag else str(path)
    if str(path) in ("", "."):
        raise error(f"{flag or 'output'}: give a file name")
    path = Path(path)
    if path.is_dir():
        raise error(f"{where}: is a folder; give a file name" + (f", e.g. {path / example}" if example else ""))
    parent = path.parent
    try:
        if create_parent:
            parent.mkdir(parents=True, exist_ok=True)
        if not parent.is_dir():
            raise error(f"{where}: no folder {parent} (it does not exist)")
        _write_probe(parent).unlink()
    except OSError as e:
        raise error(f"{where}: cannot write in {parent} ({os_reason(e)})") from None


def check_output_dir(root: Path | str) -> None:
    """Raise UsageError (one line) unless `root` is a folder gpuwatch can create and write in: it is
    created if missing, and a probe file is created and removed there."""
    root = Path(root)
    try:
        if root.exists() and not root.is_dir():
            raise UsageError(f"cannot record to {root}: it exists and is not a folder")
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot create the output folder {root}: {os_reason(e)}") from None
    try:
        probe = _write_probe(root)
    except OSError as e:
        raise UsageError(f"cannot write in the output folder {root}: {os_reason(e)}") from None
    try:
        probe.unlink()
    except OSError as e:
        raise UsageError(f"cannot remove files in the output folder {root}: {os_reason(e)}") from None
