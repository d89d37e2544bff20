"""Sessions in object storage (`gpuwatch train s3://bucket/prefix ...`): the session folders under a URL
(each one that holds meta.json) are copied to a local folder for the run, through fsspec - s3:// with
s3fs installed (the usual AWS credentials: environment, ~/.aws, instance role), gs:// with gcsfs, az://
with adlfs - and read there as any local session (the recording reader reads local files only). The copy
lives as long as the run; the disk it takes is the sessions' size (compressed Parquet, ~200 KB per
recorded minute and GPU at 10 Hz).
"""

from __future__ import annotations

import tempfile
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Iterator

from gpuwatch.errors import UsageError

__all__ = ["is_url", "local_copies"]


def is_url(text: str | Path) -> bool:
    """A path with a scheme other than file:// (s3://, gs://, memory://, ...)."""
    t = str(text)
    return "://" in t and not t.startswith("file://") and t.split("://", 1)[0].isidentifier()


@contextmanager
def local_copies(paths: list) -> Iterator[list[Path]]:
    """`paths` with every URL among them replaced by a local folder holding its sessions (the URL itself,
    where it is one, else every session under it, at their relative places); the rest unchanged."""
    if not any(is_url(p) for p in paths):
        yield [Path(p) for p in paths]
        return
    with tempfile.TemporaryDirectory(prefix="gpuwatch-remote-") as d:
        yield [_fetch(str(p), Path(d) / f"{i:04d}") if is_url(p) else Path(p) for i, p in enumerate(paths)]


def _fetch(url: str, dest: Path) -> Path:
    try:
        import fsspec
        fs, root = fsspec.core.url_to_fs(url)
    except ImportError as e:
        raise UsageError(f"{url}: reading object storage needs fsspec and its store's package "
                         f"(s3fs for s3://): {str(e).splitlines()[0]}") from None
    except ValueError as e:
        raise UsageError(f"{url}: {str(e).splitlines()[0]}") from None
    root = root.rstrip("/")
    try:
        metas = [m for m in fs.find(root) if PurePosixPath(m).name == "meta.json"]
    except (OSError, PermissionError) as e:
        raise UsageError(f"{url}: cannot list it ({str(e).splitlines()[0][:160]})") from None
    sessions = sorted({str(PurePosixPath(m).parent) for m in metas})
    outer = [s for s in sessions if not any(s.startswith(o + "/") for o in sessions if o != s)]  # never into one
    if not outer:
        raise UsageError(f"{url}: no session under it (a session folder holds meta.json)")
    name = PurePosixPath(root).name or "sessions"
    for s in outer:
        rel = PurePosixPath(s).relative_to(root) if s != root else PurePosixPath()
        local = dest / name / rel
        local.mkdir(parents=True, exist_ok=True)
        for f in fs.find(s):
            part = PurePosixPath(f).relative_to(s)
            (local / part).parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(f, str(local / part))
    return dest / name
