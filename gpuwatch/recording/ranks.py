"""What the steps and events of a data-parallel run say, rank by rank (schema v3): each rank's step and
communication time, the straggler, and the collective bandwidth check. Pure Python over step rows and
event rows, so the dashboard (live and replay) and the report compute the same figures."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from typing import Any, Iterable


@dataclass(frozen=True)
class RankStat:
    rank: int
    steps: int  # steps of this rank among the rows given
    last_step: int | None
    step_s: float | None  # median step time over its last steps
    comm_s: float | None  # median time with a gradient all-reduce in flight (overlaps compute)
    comm_bytes: int | None  # gradient bytes all-reduced in its last step
    tokens_per_s: float | None

    @property
    def comm_share(self) -> float | None:
        return self.comm_s / self.step_s if self.comm_s is not None and self.step_s else None


@dataclass(frozen=True)
class Straggler:
    rank: int
    step_s: float
    median_s: float  # the median over ranks of their median step time

    @property
    def excess(self) -> float:
        return self.step_s / self.median_s - 1 if self.median_s else 0.0


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def rank_stats(rows: Iterable[dict[str, Any]], last: int = 20) -> list[RankStat]:
    """One entry per rank over each rank's `last` most recent rows; [] unless two or more ranks ran."""
    by: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("rank") is not None:
            by.setdefault(int(r["rank"]), []).append(r)
    if len(by) < 2:
        return []
    out = []
    for k in sorted(by):
        mine = by[k][-last:]
        out.append(RankStat(k, len(by[k]), mine[-1].get("step"), _median([r.get("step_time_s") for r in mine]),
                            _median([r.get("comm_time_s") for r in mine]), mine[-1].get("comm_bytes"),
                            _median([r.get("tokens_per_s") for r in mine])))
    return out


def straggler(stats: list[RankStat]) -> Straggler | None:
    """The slowest rank (median step time) against the median of all ranks."""
    timed = [(s.step_s, s) for s in stats if s.step_s is not None]
    if len(timed) < 2:
        return None
    step_s, slow = max(timed, key=lambda ts: ts[0])
    return Straggler(slow.rank, step_s, statistics.median(t for t, _s in timed))


def collectives(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The `collective` events' details (op, rows, busbw at the largest size, peak...), in order."""
    out = []
    for e in events:
        if e.get("kind") != "collective":
            continue
        d = e.get("detail")
        if isinstance(d, str):
            try:
                d = json.loads(d)
            except ValueError:
                continue
        if isinstance(d, dict) and d.get("op"):
            out.append({**d, "message": e.get("message")})
    return out
