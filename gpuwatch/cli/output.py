"""What the command line says besides a command's own output: one line on stderr, `gpuwatch: ...`."""

from __future__ import annotations

import sys

__all__ = ["status"]


def status(msg: str) -> None:
    print(f"gpuwatch: {msg}", file=sys.stderr, flush=True)
