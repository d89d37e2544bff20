"""The final fit's rows under a budget (`gpuwatch train --max-windows N`): however many windows a fleet's
recordings hold, the fit takes at most N rows, and the main process never holds more than those N (and one
timeline's rows while it reads them). Each cross-validation fold's training side is the same budget over the
timelines not in that fold (train.fold_scores, built where the fold runs).

Each timeline's fit rows (predict/sampling.py: the informative windows and the sample of
the quiet stretches) are written to a Parquet file by the process that cut them (`write_part`, called by
dataset.on_disk) and only their counts come back. `build` then plans, from those counts alone, how many rows of
each timeline to keep, and reads the files one at a time into the fit's matrix. Rows come in three tiers:

0. positive windows (labelled y = 1);
1. the other informative windows (near the limit, before an event, around a plan change, dropped: sampling.py);
2. quiet windows (the edges of quiet stretches and the sample of their inside, each weighing what it stands for).

Under the budget every row is kept, in the order the timelines came, with the weights they had: the same
matrix, so the same model byte for byte, as the fit of the whole sample. Over it the tiers are filled in
order: all positives, then all other informative windows, the quiet ones in what is left; where informative
windows alone exceed the budget, `QUIET_SHARE` of it still goes to the quiet ones (so idle running keeps its
weight in the fit) and the informative windows are sampled too. A tier that does not fit is split over the
timelines in proportion to their rows (every timeline that has some keeps at least one where the budget
allows), each timeline's rows drawn by a seeded generator of its own (the seed, its session, GPU and tier:
the same rows in any process, for any number of workers) and weighted up so that the timeline's total weight
in that tier is what it was. What was seen and what was kept, per tier, goes into the manifest and the card.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gpuwatch.predict.features import NAMES

MAX_WINDOWS = 4_000_000  # ~1 GB of features in the fit; ~1.9 M rows for 1,000 shipped-size sessions
QUIET_SHARE = 0.1
TIERS = ("positive", "informative", "quiet")

__all__ = ["MAX_WINDOWS", "FitSet", "allocate", "build", "plan", "tiers", "write_part"]


def tiers(y: np.ndarray, inf: np.ndarray | None) -> np.ndarray:
    """Each row's tier (0 positive, 1 other informative, 2 quiet); `inf` None (not known): none quiet."""
    t = np.where(y == 1, 0, 1).astype(np.int8)
    if inf is not None:
        t[(y != 1) & ~inf] = 2
    return t


def fit_mask(y: np.ndarray, w: np.ndarray | None) -> np.ndarray:
    """The windows a fit takes (labels `y`, sample weights `w`, None: every window): labelled ones, and of
    those the sample's (predict/sampling.py)."""
    return (y != -1) if w is None else (y != -1) & (w > 0)


def _fit_arrays(t) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(y, w, tier, X) of the rows of timeline `t` (predict/dataset.Timeline) the fit takes."""
    m = fit_mask(t.y, t.w)
    w = np.ones(int(m.sum())) if t.w is None else t.w[m].astype(np.float64)
    return t.y[m], w, tiers(t.y[m], None if t.inf is None else t.inf[m]), t.X[m]


def counts(tier: np.ndarray) -> list[int]:
    return [int((tier == k).sum()) for k in range(len(TIERS))]


def write_part(t, path: Path) -> list[int]:
    """Timeline `t`'s fit rows as Parquet at `path` (y, w, tier, then the features in NAMES order); the rows
    of each tier."""
    import polars as pl

    y, w, tier, X = _fit_arrays(t)
    path.parent.mkdir(parents=True, exist_ok=True)
    cols: dict[str, Any] = {"y": y.astype(np.int8), "w": w, "tier": tier}
    cols.update({n: X[:, i] for i, n in enumerate(NAMES)})
    meta = {"session": t.session, "gpu": t.gpu, "derived": t.derived}
    pl.DataFrame(cols).write_parquet(path, metadata={"gpuwatch.fit": json.dumps(meta)})
    return counts(tier)


def _read_part(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    import polars as pl

    df = pl.read_parquet(path)
    X = np.empty((df.height, len(NAMES)))
    for i, n in enumerate(NAMES):  # a column at a time: no second copy of the whole matrix
        X[:, i] = df[n].to_numpy()
    return df["y"].to_numpy().astype(np.int8), df["w"].to_numpy().astype(np.float64), \
        df["tier"].to_numpy().astype(np.int8), X


def _part(t) -> tuple[list[int], Any]:
    """(rows per tier, a loader of (y, w, tier, X)) of a timeline, on disk or held."""
    if t.shard is not None:
        return list(t.whole["tiers"]), lambda: _read_part(t.shard)
    m = fit_mask(t.y, t.w)  # the rows are taken when the matrix is filled, a timeline at a time
    return counts(tiers(t.y[m], None if t.inf is None else t.inf[m])), lambda: _fit_arrays(t)


def allocate(sizes: list[int], budget: int) -> list[int]:
    """`budget` rows split over groups of `sizes` rows: all of each where they fit; else each non-empty group
    at least one (where the budget allows: the largest groups first) and the rest in proportion to the sizes
    beyond it, rounded down, the remainders going to the largest fractions (ties: the earlier group)."""
    n = np.asarray(sizes, dtype=np.int64)
    if n.sum() <= budget:
        return n.tolist()
    out = np.zeros(n.size, dtype=np.int64)
    budget = max(0, int(budget))
    nz = np.flatnonzero(n)
    if budget < nz.size:
        order = sorted(nz.tolist(), key=lambda i: (-n[i], i))
        out[order[:budget]] = 1
        return out.tolist()
    out[nz] = 1
    rest, extra = budget - nz.size, n - out
    share = extra * (rest / extra.sum()) if extra.sum() else np.zeros(n.size)
    base = np.minimum(np.floor(share).astype(np.int64), extra)
    left = rest - int(base.sum())
    frac = share - base
    for i in sorted(range(n.size), key=lambda i: (-frac[i], i)):
        if left <= 0:
            break
        if base[i] < extra[i]:
            base[i] += 1
            left -= 1
    return (out + base).tolist()


def plan(sizes: list[list[int]], budget: int) -> tuple[np.ndarray, dict[str, Any]]:
    """Rows to keep of each timeline (rows of `sizes`: its rows per tier) and tier (columns), and what was
    seen and kept, for the manifest."""
    n = np.asarray(sizes, dtype=np.int64).reshape(-1, len(TIERS))
    seen = n.sum(axis=0)
    q = n.copy()
    note = None
    if seen.sum() > budget:
        inf = int(seen[:2].sum())
        quiet = budget - inf if inf <= budget else min(int(seen[2]), int(budget * QUIET_SHARE))
        left = budget - quiet
        for k in range(2):
            q[:, k] = allocate(n[:, k].tolist(), left)
            left -= int(q[:, k].sum())
        q[:, 2] = allocate(n[:, 2].tolist(), quiet)
        sampled = [TIERS[k] for k in range(len(TIERS)) if q[:, k].sum() < seen[k]]
        note = (f"{int(seen.sum())} windows over the budget of {budget}: "
                + ("the informative windows alone exceed it - they are sampled too, " if inf > budget
                   else "every informative window kept, ")
                + f"{', '.join(sampled)} windows sampled with weights")
        lost = int(((n > 0) & (q == 0)).any(axis=1).sum())
        note += (f"; {lost} timeline(s) kept none of some tier, whose weight is then left out" if lost
                 else " (each timeline's weight in each tier kept)")
    kept = q.sum(axis=0)
    summary = {"budget": int(budget), "seen": int(seen.sum()), "kept": int(kept.sum()),
               "tiers": {name: {"seen": int(seen[k]), "kept": int(kept[k])} for k, name in enumerate(TIERS)},
               "note": note}
    return q, summary


@dataclass
class FitSet:
    """The final fit's rows: X, y and each row's weight for the windows it stands for (`raw_w`; `weights`
    gives the fit's), `bounds` the rows of each timeline, `summary` what was seen and kept, `peak_rows` the
    most rows held at once while it was built (the matrix and one timeline's)."""

    X: np.ndarray
    y: np.ndarray
    raw_w: np.ndarray
    bounds: list[tuple[int, int]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    peak_rows: int = 0

    def weights(self, balance: bool = False) -> np.ndarray:
        """train.weights' figures for these rows: every timeline weighs the same; with `balance`, positives
        as much as negatives."""
        parts = [self.raw_w[a:b] / max(1.0, float(self.raw_w[a:b].sum())) for a, b in self.bounds]
        w = np.concatenate(parts) if parts else np.array([])
        pos, neg = w[self.y == 1].sum(), w[self.y == 0].sum()
        if balance and pos > 0 and neg > 0:
            w[self.y == 1] *= neg / pos
        return w / w.mean() if w.size else w


def _rng(seed: int, t, tier: int) -> np.random.Generator:
    key = zlib.crc32(f"{t.session}|{t.gpu}|{int(t.derived)}|{tier}".encode())
    return np.random.default_rng([seed, key])


def build(tls: list, budget: int = MAX_WINDOWS, seed: int = 0) -> FitSet:
    """The fit's rows of timelines `tls` (held, or on disk: dataset.on_disk), at most `budget` of them."""
    parts = [_part(t) for t in tls]
    q, summary = plan([p[0] for p in parts], budget)
    total = int(q.sum())
    X = np.empty((total, len(NAMES)))
    y = np.empty(total, dtype=np.int8)
    w = np.empty(total)
    bounds, pos, peak = [], 0, total
    for i, (t, (sizes, load)) in enumerate(zip(tls, parts)):
        yy, ww, tt, XX = load()
        peak = max(peak, total + yy.size)
        keep = np.ones(yy.size, dtype=bool)
        for k in range(len(TIERS)):
            if q[i, k] >= sizes[k]:
                continue
            idx = np.flatnonzero(tt == k)
            chosen = np.sort(idx[np.argsort(_rng(seed, t, k).random(idx.size), kind="stable")[:q[i, k]]])
            keep[idx] = False
            keep[chosen] = True
            kept_w, all_w = float(ww[chosen].sum()), float(ww[idx].sum())
            if kept_w > 0:
                ww = ww.copy()
                ww[chosen] *= all_w / kept_w
        n = int(keep.sum())
        if n == yy.size:
            X[pos:pos + n], y[pos:pos + n], w[pos:pos + n] = XX, yy, ww
        else:
            X[pos:pos + n], y[pos:pos + n], w[pos:pos + n] = XX[keep], yy[keep], ww[keep]
        bounds.append((pos, pos + n))
        pos += n
    return FitSet(X, y, w, bounds, summary, peak)


def reference(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The healthy windows' median of each feature (NaN where none is finite), a column at a time: no copy
    of the whole matrix."""
    neg = y == 0
    out = np.full(X.shape[1], np.nan)
    for j in range(X.shape[1]):
        c = X[neg, j]
        c = c[np.isfinite(c)]
        if c.size:
            out[j] = np.median(c)
    return out
