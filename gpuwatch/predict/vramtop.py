"""A baseline: vramtop's OOM rule, re-implemented from its description in its source, scored at its 1 s refresh.

vramtop (a 2026 GPU-memory TUI) predicts OOMs in `src/vramtop/analysis/oom_predictor.py` (repository
Kranium2002/vramtop, commit 838fe6197ccf6927eb3821050dcda8a8b569ad1d). Its rule, as read there (this is a
re-implementation, not its code):
- every refresh (1 s) it takes the memory in use and the rate since the last refresh (MB/s) and keeps the
  last 5 rates; memory "grows" when at least 60 % of them and their median exceed 5 MB/s;
- consecutive growing refreshes are counted (the count and the min/max median rate reset when growth stops);
- with at least 10 of them, memory in use >= 50 % of the total and a confidence (count / 30) >= 0.3, it
  shows "OOM in ~low-high" (free memory / the fastest and slowest median rate), when low is under an hour
  (critical under 300 s);
- not growing but >= 85 % in use, it shows "Low VRAM (N %)" (a warning).
It sees the whole GPU, not a `--gpu-memory-limit`; here it is given the effective limit as the total and the
process's own memory as the used (what it would see if the cap were the card), so it is judged on the same
basis as every other rule. Two alarms: `time-to-OOM` (the "OOM in" display) and `any` (that or Low VRAM).
"""

from __future__ import annotations

from collections import deque

import numpy as np

REFRESH_S = 1.0
WINDOW = 5
GROWTH_FRACTION = 0.6
MIN_RATE_MB_S = 5.0
MIN_SUSTAINED = 10
MIN_USED_PCT = 50.0
LOW_VRAM_PCT = 85.0
MIN_CONFIDENCE = 0.3
CAP_S = 3600.0
MB = 2**20


def states(ts_us: np.ndarray, used: np.ndarray, limit: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(time-to-OOM shown, Low VRAM shown) at each moment of `ts_us`: the rule evaluated at refreshes 1 s
    apart (the first moment at least REFRESH_S after the previous refresh), each state held until the next.
    `used` and `limit` in bytes per moment (NaN: no reading; that refresh is skipped)."""
    oom = np.zeros(ts_us.size, dtype=bool)
    low = np.zeros(ts_us.size, dtype=bool)
    rates: deque[float] = deque(maxlen=WINDOW)
    grow_n, lo_rate, hi_rate = 0, None, None
    last_t: float | None = None
    last_u = 0.0
    cur = (False, False)
    for i in range(ts_us.size):
        t, u, lim = float(ts_us[i]) / 1e6, float(used[i]), float(limit[i])
        if last_t is not None and t - last_t < REFRESH_S - 1e-6 or not (u == u and lim == lim and lim > 0):
            oom[i], low[i] = cur
            continue
        if last_t is not None:
            rates.append((u - last_u) / MB / max(t - last_t, 1e-3))
        last_t, last_u = t, u
        pct = 100.0 * u / lim
        growing, med = False, 0.0
        if len(rates) >= 3:
            med = sorted(rates)[len(rates) // 2]
            growing = sum(r > MIN_RATE_MB_S for r in rates) / len(rates) >= GROWTH_FRACTION and med > MIN_RATE_MB_S
        if growing:
            grow_n += 1
            lo_rate = med if lo_rate is None else min(lo_rate, med)
            hi_rate = med if hi_rate is None else max(hi_rate, med)
        else:
            grow_n, lo_rate, hi_rate = 0, None, None
        shows_oom = (growing and grow_n >= MIN_SUSTAINED and pct >= MIN_USED_PCT
                     and min(1.0, grow_n / 30.0) >= MIN_CONFIDENCE
                     and max(lim - u, 0.0) / MB / max(hi_rate or 0.0, 1e-3) <= CAP_S)
        cur = (shows_oom, (not growing) and pct >= LOW_VRAM_PCT)
        oom[i], low[i] = cur
    return oom, low


def alarms(ts_us: np.ndarray, used_frac: np.ndarray, headroom_gib: np.ndarray, any_warning: bool) -> np.ndarray:
    """The rule's alarm over a timeline's moments, from its memory features (used / limit, limit - used):
    the limit is one figure per timeline (the median of what the moments give), the used is used x limit."""
    with np.errstate(divide="ignore", invalid="ignore"):
        each = np.where(1.0 - used_frac > 1e-6, headroom_gib * 2**30 / (1.0 - used_frac), np.nan)
    ok = np.isfinite(each)
    limit = np.full(ts_us.size, float(np.median(each[ok])) if ok.any() else np.nan)
    oom, low = states(ts_us, used_frac * limit, limit)
    return oom | low if any_warning else oom
