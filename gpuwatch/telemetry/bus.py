"""Bounded, thread-safe channels with sequence numbers: writers never block, each reader keeps its own
cursor and learns how many items it missed if it fell behind (nothing is silently lost)."""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from itertools import islice
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Channel(Generic[T]):
    """A ring buffer of the last `capacity` items, each numbered from 0 upwards."""

    def __init__(self, capacity: int) -> None:
        self._items: deque[T] = deque(maxlen=capacity)
        self._next = 0  # sequence number of the next item appended
        self._lock = threading.Lock()

    def append(self, item: T) -> int:
        with self._lock:
            self._items.append(item)
            self._next += 1
            return self._next - 1

    @property
    def next_seq(self) -> int:
        return self._next

    def since(self, seq: int) -> tuple[list[T], int, int]:
        """Items numbered >= seq: (items, next cursor, how many were overwritten before being read)."""
        with self._lock:
            first = self._next - len(self._items)
            start = max(seq, first)
            # only the new items, from the right end: a reader that keeps up copies a few, not the ring
            items = list(islice(reversed(self._items), self._next - start))[::-1] if start < self._next else []
            return items, self._next, start - seq if seq < first else 0

    def latest(self, n: int = 1) -> list[T]:
        with self._lock:
            if n >= len(self._items):
                return list(self._items)
            return list(islice(reversed(self._items), n))[::-1]

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class Event:
    """A fact worth a marker: OOM, GPU lost, XID, guard action, mark... `ts_us` is UTC microseconds."""

    kind: str
    message: str
    severity: str = "info"  # info | warning | error
    gpu: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    ts_us: int = field(default_factory=lambda: time.time_ns() // 1000)

    def row(self) -> dict[str, Any]:
        return {
            "ts": self.ts_us, "kind": self.kind, "severity": self.severity, "gpu": self.gpu,
            "message": self.message, "detail": json.dumps(self.detail, default=str),
        }


@dataclass
class Tick:
    """One sampler tick: `rows` holds one samples-schema row per GPU (one row with gpu=None if none)."""

    tick: int
    ts_us: int
    rows: list[dict[str, Any]]


class Bus:
    """The channels every part of gpuwatch shares: samples (ticks), workload steps, events, and the
    failure risk the scorer publishes (one dict per GPU and scoring: ts, gpu, kind, risk, alarm,
    threshold, model, reasons; the `risk` table of docs/SCHEMA.md)."""

    def __init__(self, capacity: int = 36_000) -> None:
        self.ticks: Channel[Tick] = Channel(capacity)  # 1 h at 10 Hz
        self.steps: Channel[dict[str, Any]] = Channel(capacity)
        self.events: Channel[Event] = Channel(10_000)
        self.risk: Channel[dict[str, Any]] = Channel(capacity)

    def emit(self, kind: str, message: str, severity: str = "info", gpu: int | None = None,
             **detail: Any) -> Event:
        ev = Event(kind, message, severity, gpu, detail)
        self.events.append(ev)
        return ev
