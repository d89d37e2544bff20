"""Lead from the trend (issue 29): growth the plan does not explain, carried forward in time.

The peak estimator (predict/peak.py) forecasts the planned step from the steps that ran, and carries a
per-step growth of what stays allocated (the median of the last 10 steps' changes: a fixed leak). What it
does not see is growth that comes in jumps or at shape changes - a cache that keeps a tensor per new shape,
a CUDA-graph pool per captured batch size, memory kept across a ramp's restarts - whose per-step median is
0. Here, from the window's steps (their times, shapes, torch allocated after each, peaks, reserved):

- `alloc_rate_same_shape` (bytes/s): for every step, its allocated minus that of the last earlier step of the
  same shape (batch x sequence length); the sum of those differences over the sum of the times between
  them. A steady run: 0; a ramp alone: 0 (each shape's steps hold the same); memory that stays and grows:
  its rate in time, whatever the steps in between did;
- `frag_held_frac`: torch reserved minus the highest peak of the steps since the reserve last changed -
  cached memory that even the step at its peak did not use, and no more than the last step's inactive split
  blocks where the steps record them (schema v6: whole free segments are released at the cap) - over torch's limit. The usable limit is taken net of it where the steps
  show the cache is not reused: the allocator can give that memory back only where whole segments are
  free, and a fragmented cache's are not - beyond the usable limit's own margin, which is there for the same
  rounding and splits (so with no reuse the room is what the reserve can still grow). Where the peak grew and the reserve did not grow with it (the
  growth was met from the cache: a leak into a warm cache, blind set 2902's `ho-01`), that share of it is
  usable and stays on the limit (`reuse`);
- `reserved_ttf_s`: when the process's reserved memory reaches torch's limit at its least-squares slope
  over the last steps (a context figure: reserved reaching the cap is not itself a failure);
- `alloc_ttf_s`: when the planned step's peak reaches the usable limit, net of what fragmentation holds,
  at the same-shape rate: (usable - held - planned peak) / rate;
- `trend_cross_p`: P(that happens within the horizon), 1 / (1 + (ttf / horizon)^4): 0.5 at the horizon,
  ~0.94 at half of it - a probability the risk composite reads beside the estimator's (predict/composite.py).

The steps read are those after the window's last OOM (features.py `_since_last_oom`): a recovery changes
what runs, and growth measured across it is not the growth of now.

Pure numpy on the window's step arrays; the same in training, replay and live scoring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from gpuwatch.predict.peak import usable_of
from gpuwatch.threads import keep_bounded

HORIZON_S = 5.0  # the model's horizon (predict/dataset.py HORIZON_S; not imported: dataset imports features)
CAP_S = 600.0  # features.HORIZON_CAP_S
RATE_MIN = 2**20  # bytes/s: slower growth reads as none (noise of the allocator's rounding)
RATE_STEPS = 32  # the last steps the same-shape rate reads
MIN_SPAN_S = 1.0  # ... spanning at least this long
RESERVED_STEPS = 10
HELD_STEPS = 5
RESERVE_SAME = 64 * 2**20  # reserved within this of the last step's counts as unchanged (a small-pool segment:
# 2 MiB; the large pool's start at 20 MiB) - else one small segment after the long step would hide its peak
REUSE_MIN_BYTES = 16 * 2**20  # the least rise of the peak that counts as evidence (above the allocator's rounding)
SHARPNESS = 4.0


def same_shape_pairs(t: np.ndarray, key: np.ndarray, alloc: np.ndarray) -> list[tuple[float, float]]:
    """(allocated growth, seconds) from each of the last RATE_STEPS steps to the last earlier step of its
    shape, in time order."""
    t, key, alloc = t[-RATE_STEPS:], key[-RATE_STEPS:], alloc[-RATE_STEPS:]
    last: dict[float, int] = {}
    out = []
    for i, k in enumerate(key.tolist()):
        j = last.get(k)
        last[k] = i
        if j is not None and math.isfinite(alloc[i]) and math.isfinite(alloc[j]) and t[i] > t[j]:
            out.append((float(alloc[i] - alloc[j]), float(t[i] - t[j])))
    return out


def rate_of(pairs: list[tuple[float, float]]) -> float | None:
    """Their summed growth over their summed time (bytes/s); None where fewer than two pairs or less
    than MIN_SPAN_S between them."""
    span = sum(dt for _g, dt in pairs)
    return sum(g for g, _dt in pairs) / span if len(pairs) >= 2 and span >= MIN_SPAN_S else None


def same_shape_rate(t: np.ndarray, key: np.ndarray, alloc: np.ndarray) -> float | None:
    """Bytes per second allocated grows across steps of the same shape (see the module)."""
    return rate_of(same_shape_pairs(t, key, alloc))


def reserved_slope(t: np.ndarray, res: np.ndarray) -> float | None:
    """Least-squares slope of torch reserved over the last RESERVED_STEPS steps (bytes/s)."""
    ok = np.isfinite(res[-RESERVED_STEPS:])
    tt, rr = t[-RESERVED_STEPS:][ok], res[-RESERVED_STEPS:][ok]
    if tt.size < 4 or tt[-1] - tt[0] < MIN_SPAN_S:
        return None
    tc = tt - tt.mean()
    den = float((tc * tc).sum())
    return float((tc * (rr - rr.mean())).sum() / den) if den > 0 else None


def held(res: np.ndarray, peak: np.ndarray, split: np.ndarray | None = None) -> float | None:
    """Reserved after the last step minus the highest peak among the steps since the reserve last changed
    (bytes, >= 0): cache that no step at this reserve used. Not the last few steps' peaks: with random
    lengths the long step that grew the reserve is often not among them, and its cache - reused whenever
    that length comes again - read as held (blind set 2904's `ho-03`, a bounded cache per new length: the
    trend put the planned step over the limit at once, trend_cross_p 1, four false alarms).

    Where the steps record the allocator's inactive split blocks (`split`, schema v6), no more than the last
    step's: the rest of that unused cache is whole free segments, which the allocator releases and maps
    again when an allocation meets the cap (so it is room, not fragmentation); only free memory inside
    segments still partly in use cannot be given back."""
    r = res[-1]
    if not math.isfinite(r):
        return None
    i = res.size - 1
    while i > 0 and abs(res[i - 1] - r) <= RESERVE_SAME:  # a small segment more is the same reserve
        i -= 1
    pk = peak[i:]
    pk = pk[np.isfinite(pk)]
    if not pk.size:
        return None
    h = max(0.0, float(r) - float(pk.max()))
    if split is not None and split.size and math.isfinite(split[-1]):
        h = min(h, max(0.0, float(split[-1])))
    return h


def reuse(peak: np.ndarray, res: np.ndarray) -> float:
    """The share of the peak's growth over the last RATE_STEPS steps that the cache met without growing:
    1 - (reserved's rise) / (the peak's rise), clipped to 0..1; 0 (no evidence that the cache is reused)
    where the peak did not rise by REUSE_MIN_BYTES or a figure is missing."""
    pk, rs = peak[-RATE_STEPS:], res[-RATE_STEPS:]
    if pk.size < 2 * HELD_STEPS or not (math.isfinite(rs[0]) and math.isfinite(rs[-1])):
        return 0.0
    first, last = pk[:HELD_STEPS], pk[-HELD_STEPS:]
    first, last = first[np.isfinite(first)], last[np.isfinite(last)]
    if not first.size or not last.size:
        return 0.0
    grew = float(last.max()) - float(first.max())
    if grew < REUSE_MIN_BYTES:
        return 0.0
    return min(1.0, max(0.0, 1.0 - max(float(rs[-1]) - float(rs[0]), 0.0) / grew))


def p_of(ttf: float, horizon_s: float = HORIZON_S) -> float:
    """P(full within the horizon) from a time to full (s)."""
    return 1.0 / (1.0 + (max(ttf, 0.0) / horizon_s) ** SHARPNESS)


def trend(out: dict[str, float], t: np.ndarray, key: np.ndarray, alloc: np.ndarray, peak: np.ndarray,
          res: np.ndarray, limit: float, planned_peak: float | None, split: np.ndarray | None = None,
          usable: float | None = None) -> None:
    """The trend's features of one window into `out` (the feature function's dict); `limit` is torch's,
    `planned_peak` the estimator's mean for the planned step (bytes; None where there is none), `split` the
    steps' inactive split blocks (schema v6; NaN or None where not recorded: `held` reads reserve and peaks alone). Kept by
    everything it is computed from: a live round that brought a sample but no step reuses it (as
    features._FORECASTS does)."""
    if t.size < 2:
        return
    sp = split[-1:] if split is not None and split.size else None  # only the last step's is read
    if usable is None:  # the estimator's rule (features pass theirs: the same, over the whole window's peaks)
        usable = usable_of(limit, peak)
    k = (t.tobytes(), key.tobytes(), alloc.tobytes(), peak.tobytes(), res.tobytes(), limit, planned_peak,
         sp.tobytes() if sp is not None else b"", usable)
    got = _KEPT.get(k)
    if got is None:
        got = {}
        _trend(got, t, key, alloc, peak, res, limit, planned_peak, sp, usable)
        keep_bounded(_KEPT, k, got, 4)
    out.update(got)


_KEPT: dict[tuple, dict[str, float]] = {}


def _trend(out: dict[str, float], t: np.ndarray, key: np.ndarray, alloc: np.ndarray, peak: np.ndarray,
           res: np.ndarray, limit: float, planned_peak: float | None, split: np.ndarray | None, usable: float) -> None:
    pairs = same_shape_pairs(t, key, alloc)
    rate = rate_of(pairs)
    hold = held(res, peak, split)
    if rate is not None:
        out["alloc_rate_same_shape"] = rate / 2**30
    if hold is not None:
        out["frag_held_frac"] = hold / limit
    rs = reserved_slope(t, res)
    if math.isfinite(res[-1]):
        out["reserved_ttf_s"] = min(CAP_S, max(0.0, limit - float(res[-1])) / rs) if rs is not None and rs > RATE_MIN else CAP_S
    if rate is None:
        return
    pk = planned_peak if planned_peak is not None else (float(peak[-1]) if math.isfinite(peak[-1]) else None)
    if pk is None:
        return
    # what the cache holds beyond the usable limit's own margin (which is there for rounding and splits),
    # less the share the steps showed the cache reuses: at no reuse, room is what the reserve can still grow
    frag = max(0.0, (hold or 0.0) - (limit - usable)) * (1.0 - reuse(peak, res))
    room = usable - frag - pk
    ttf = CAP_S if rate <= RATE_MIN else 0.0 if room <= 0 else min(CAP_S, room / rate)  # no growth: no trend
    out["alloc_ttf_s"] = ttf
    out["trend_cross_p"] = p_of(ttf) if ttf < CAP_S else 0.0
    if ttf < CAP_S:  # the range (not model inputs): the rate of the later half of the pairs against all of them
        recent = rate_of(pairs[len(pairs) // 2:]) or rate
        fast, slow = max(rate, recent), min(rate, recent)
        out[TTF_LO] = 0.0 if room <= 0 else room / fast
        out[TTF_HI] = 0.0 if room <= 0 else (room / slow if slow > RATE_MIN else CAP_S)


TTF_LO, TTF_HI = "trend_ttf_lo_s", "trend_ttf_hi_s"  # a features dict's extra keys (not model inputs): the
# trend's time to the limit as a range, for the dashboard (`outlook`)
OUTLOOK_MIN_P = 0.25  # below this the estimator's strongest signal gives no time to the limit worth showing
SIGNALS = {"peak_cross_p": "next-step peak", "ahead_cross_p": "lookahead", "trend_cross_p": "trend"}
# the plan's estimates behind those signals: a reason among them is the estimator's own, not the context's
ESTIMATES = ("next_peak_est_frac", "ahead_peak_est_frac", "peak_margin_sigmas")


@dataclass(frozen=True)
class Outlook:
    """What the estimate says of the time to the limit: a range in seconds (hi None: beyond CAP_S), the
    signal that carries the risk and its probability, and for the plan's signals the step's estimated peak /
    the usable limit (`est`, None for the trend or where unknown: over 1 is what ranks the risk above its alarm,
    predict/composite.py)."""

    lo_s: float
    hi_s: float | None
    signal: str
    p: float
    est: float | None = None


def outlook(f: dict[str, float]) -> Outlook | None:
    """The time to the limit by the strongest of the estimator's signals (None where none reaches OUTLOOK_MIN_P):
    the next-step peak - within the next step; the lookahead - within LOOKAHEAD_S; the trend - its range."""
    from gpuwatch.predict.ahead import LOOKAHEAD_S

    raw = {k: f.get(k) for k in SIGNALS}
    ps: dict[str, float] = {k: float(v) for k, v in raw.items() if v is not None and v == v}
    if not ps or max(ps.values()) < OUTLOOK_MIN_P:
        return None  # no signal of the estimator's says the limit is near: no range to show
    k = max(ps, key=lambda n: (ps[n], n == "peak_cross_p"))  # a tie: the nearest
    sps = f.get("steps_per_s")
    step_s = 1.0 / sps if sps and sps == sps and sps > 0 else None
    if k == "trend_cross_p" and f.get(TTF_LO) is not None:
        hi = f.get(TTF_HI)
        return Outlook(float(f[TTF_LO]), None if hi is None or hi >= CAP_S else float(hi), SIGNALS[k], ps[k])
    est = f.get("ahead_peak_est_frac" if k == "ahead_cross_p" else "next_peak_est_frac")
    est = float(est) if est is not None and est == est else None
    if k == "ahead_cross_p":
        return Outlook(step_s or 0.0, LOOKAHEAD_S, SIGNALS[k], ps[k], est)
    return Outlook(0.0, step_s, SIGNALS[k], ps[k], est)
