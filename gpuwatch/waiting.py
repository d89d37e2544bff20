"""Waiting in the main thread for the end of a run: a deadline, a condition, or SIGINT/SIGTERM/SIGHUP (a
dropped SSH link sends SIGHUP to a foreground run), with one wake-up per poll so a headless run costs
nothing while it waits. The exit status of a run ended by a signal is 128 + its number."""

from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

SIGNAL_EXIT = {s.name: 128 + s for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}  # 130, 143, 129


def wait_until(deadline: float | None, done=None, poll_s: float = 0.5, on_tick: Callable[[], None] | None = None,
               tick_s: float = 0.0, on_hup: Callable[[], None] | None = None) -> str:
    """Sleep until the deadline, `done()` (checked every `poll_s`) or SIGINT/SIGTERM/SIGHUP (a dropped
    SSH link sends SIGHUP to a foreground run). One wake-up per poll, so a headless run costs nothing
    while it waits. Only the main thread can install handlers; elsewhere signals are left alone.
    `on_tick()` (if given, with `tick_s` > 0) runs every `tick_s` seconds inside the same wait, so the
    handlers stay installed between progress lines; what it raises is not this wait's business."""
    next_tick = time.monotonic() + tick_s if on_tick is not None and tick_s > 0 else None
    stop = threading.Event()
    why = {"sig": None}

    def handler(signum, _frame):
        if signum == signal.SIGHUP and on_hup is not None:  # a headless run outlives its terminal
            on_hup()
            return
        why["sig"] = signal.Signals(signum).name
        stop.set()
    old = {}
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            old[s] = signal.signal(s, handler)
    try:
        while not stop.is_set():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return "deadline"
            if done is not None and done():
                return "done"
            timeout = left
            if done is not None:
                timeout = poll_s if left is None else min(left, poll_s)
            if next_tick is not None:
                now = time.monotonic()
                if now >= next_tick:
                    try:
                        on_tick()
                    except Exception:  # noqa: BLE001 - a progress line must never end the run
                        pass
                    next_tick = max(next_tick + tick_s, now + tick_s / 2)
                to_tick = max(0.0, next_tick - time.monotonic())
                timeout = to_tick if timeout is None else min(timeout, to_tick)
            stop.wait(timeout if timeout is not None else 3600)
        return why["sig"] or "SIGINT"
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT/SIGTERM/SIGHUP held back for the block (closing a recording must not be cut short: torchrun
    sends SIGTERM to rank 0 the moment another rank fails, and in CI that once landed in the compaction),
    then handed, once the handlers before the block are back, to whichever handled them - so what a signal
    does is unchanged, only later. Only the main thread can install handlers; elsewhere the block runs as is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    old = {s: signal.signal(s, lambda signum, _f: got.append(signum))
           for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for signum in dict.fromkeys(got):  # each one once, in the order they came
            signal.raise_signal(signum)
