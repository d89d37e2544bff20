"""Background threads with names the OS can see: `top -H`, `ps -L` and /proc/<pid>/task/*/comm show
`gw-sampler`, `gw-recorder`, ... instead of a column of `python` (CPython sets native thread names only
from 3.14 on). The benchmarks use these names to say which thread costs what."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading
from typing import Callable

_PR_SET_NAME = 15
_libc = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        _libc = None


def set_native_name(name: str) -> None:
    """Name the calling OS thread (Linux keeps 15 bytes). Does nothing where that is not possible."""
    if _libc is not None:
        try:
            _libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
        except (AttributeError, OSError):
            pass


def start_thread(target: Callable[[], object], name: str) -> threading.Thread:
    """Start a daemon thread called `name` (Python) and `gw-<name>` (OS)."""
    def run() -> None:
        set_native_name("gw-" + name.removeprefix("gpuwatch-"))
        target()

    th = threading.Thread(target=run, name=name, daemon=True)
    th.start()
    return th


_KEEP_LOCK = threading.Lock()


def keep_bounded(cache: dict, key, value, n: int) -> None:
    """Put `key` in `cache` (insertion order), dropping its oldest entries beyond `n`: the feature function's
    caches of results (predict/features.py, predict/trend.py), which the TUI's thread and a background scoring
    thread can fill at once. Under a lock: dropping the oldest reads the dict's order, and a dict another thread
    inserts into meanwhile raises "changed size during iteration" (or KeyError, the entry gone)."""
    with _KEEP_LOCK:
        while len(cache) >= n:
            cache.pop(next(iter(cache)), None)
        cache[key] = value
