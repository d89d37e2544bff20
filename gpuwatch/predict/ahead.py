"""The steps a workload already knows are coming, for the lead time of a warning.

A ramp's schedule knows its next levels, a sweep its next batch sizes, a loader its prefetched batches:
the step that will run out of memory is often known several steps before it is the next one. One step
of warning is 0.3-0.6 s on the H200's ramps (models/risk.md); an operator, or a checkpoint hook, needs
seconds. So each step row records, beside the plan of the next step (`next_batch`, `next_seq_len`), the
largest step planned within LOOKAHEAD_S at the recent pace (`ahead_batch`, `ahead_seq_len`, and
`ahead_steps`: how many steps ahead it is, 1 = the next), and the risk estimates that step's peak too
(the feature `ahead_cross_p`). The guard still acts on the next step only (a step two levels away is
refused when it becomes the next one - the guard's re-scoring between steps; acting now would cost the
levels that fit).

Why LOOKAHEAD_S = 4 s: an alarm counts as true when the OOM follows within the label horizon (5 s,
predict/dataset.py) - a warning further ahead would be a false alarm by that measure, and the plan of
a schedule far ahead is more often overtaken by what happens first (a control, an OOM elsewhere).

Pure Python: the stress workload calls it after every step, `gpuwatch backfill` (gpuwatch/backfill.py) to
fill the columns of sessions recorded before them, through the same schedule code.
"""

from __future__ import annotations

import math
from typing import Sequence

LOOKAHEAD_S = 4.0
MAX_STEPS = 64  # at most this many steps ahead, whatever the pace
PACE_STEPS = 5  # the pace: the median gap between the last this many step ends
# Not a model feature: the key under which the scorer hands the guard, with the features, the next step's
# risk without the lookahead (what the guard acts on).
RISK_NEXT = "risk_next"
# The lookahead's features (predict/features.py): its probability and its step's estimate, left out together
# wherever the risk is asked without the lookahead (the guard's RISK_NEXT, `eval`'s ablation).
FEATURES = ("ahead_cross_p", "ahead_peak_est_frac")


def steps_within(ends_s: Sequence[float], lookahead_s: float = LOOKAHEAD_S) -> int:
    """How many steps fit in `lookahead_s` at the recent pace (the median gap between the last step
    ends, in seconds; 1 with fewer than two ends known)."""
    e = [float(x) for x in ends_s][-(PACE_STEPS + 1):]
    gaps = sorted(b - a for a, b in zip(e, e[1:]) if b > a)
    if not gaps:
        return 1
    n = len(gaps)
    med = 0.5 * (gaps[(n - 1) // 2] + gaps[n // 2])
    return max(1, min(MAX_STEPS, int(math.ceil(lookahead_s / med))))


def pick(plans: Sequence[tuple[int, int]]) -> dict[str, int | None]:
    """The step columns for the planned steps ahead ((batch, seq_len) in order, the next one first): the
    one with the most tokens (the earliest of equals) and how many steps ahead it is (1 = the next)."""
    best, k = None, None
    for i, (b, s) in enumerate(plans, start=1):
        if b and s and (best is None or b * s > best[0] * best[1]):
            best, k = (int(b), int(s)), i
    if best is None:
        return {"ahead_batch": None, "ahead_seq_len": None, "ahead_steps": None}
    return {"ahead_batch": best[0], "ahead_seq_len": best[1], "ahead_steps": k}


def capped(cols: dict[str, int | None], ceiling: int | None) -> dict[str, int | None]:
    """The ahead columns under a micro-batch ceiling (a batch over it runs as micro-batches of at most it)."""
    ab = cols.get("ahead_batch")
    return {"ahead_batch": min(ab, ceiling) if ab and ceiling else ab, "ahead_seq_len": cols.get("ahead_seq_len"),
            "ahead_steps": cols.get("ahead_steps")}


def columns(schedule, ends_s: Sequence[float], left_s: float | None = None,
            left_steps: int | None = None) -> dict[str, int | None]:
    """The step row's ahead columns from a schedule (anything with `ahead(n)` -> [(batch, seq_len)]) and
    the times (s) the last steps ended. The lookahead ends where the run does: `left_s`, the seconds to
    its deadline (`--duration`; the steps that start before it, at the pace), and `left_steps`, the steps
    it has left (`max_steps`). A ramp's larger steps planned past its end never run: 5 of the 7 false
    alarms of the held-out H200 sessions of call 29 warned of them in a timed run's last 6 s."""
    n = steps_within(ends_s)
    if left_s is not None:  # (past the deadline no step starts: nothing ahead)
        n = min(n, steps_within(ends_s, left_s)) if left_s > 0 else 0
    if left_steps is not None:
        n = min(n, max(0, int(left_steps)))
    return pick(schedule.ahead(n) if n > 0 else [])
