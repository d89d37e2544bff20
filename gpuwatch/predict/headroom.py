"""GPU memory headroom and its trend: the simplest honest early warning of an OOM, and the baseline a
trained risk model has to beat. Pure numpy; the same function serves live, replay and training."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Headroom:
    free_bytes: int
    free_frac: float
    slope_bytes_per_s: float | None  # least-squares slope of used memory over the window
    seconds_to_full: float | None  # at that slope; None when flat or falling


def headroom(used: list, total: int | None, interval_s: float = 0.1, min_points: int = 10) -> Headroom | None:
    """`used`: recent memory-used samples (bytes, oldest first, nulls allowed); `total`: card size."""
    vals = np.array([v for v in used if v is not None], dtype=np.float64)
    if not total or vals.size == 0:
        return None
    free = max(0.0, total - vals[-1])
    slope = None
    ttf = None
    if vals.size >= min_points:
        t = np.arange(vals.size) * interval_s
        slope = float(np.polyfit(t, vals, 1)[0])
        if slope > 1e6:  # > 1 MB/s counts as rising
            ttf = free / slope
    return Headroom(int(free), free / total, slope, ttf)
