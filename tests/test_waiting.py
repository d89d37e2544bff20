"""`waiting.signals_deferred`: a signal that comes while a recording closes acts after the close, not in it."""

from __future__ import annotations

import signal

from gpuwatch.waiting import signals_deferred


def test_a_signal_in_the_block_reaches_its_handler_after_the_block_once():
    seen: list[str] = []
    old = signal.signal(signal.SIGTERM, lambda s, f: seen.append("handler"))
    try:
        with signals_deferred():
            signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGTERM)
            seen.append("block ran to its end")
        seen.append("after")
    finally:
        signal.signal(signal.SIGTERM, old)
    assert seen == ["block ran to its end", "handler", "after"]


def test_the_handlers_before_the_block_are_back_after_it():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    with signals_deferred():
        pass
    assert {s: signal.getsignal(s) for s in before} == before
