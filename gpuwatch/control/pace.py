"""What a configuration's step will cost in time: the planner's tokens/s model, fitted to the steps that ran.

At a given sequence length the candidates the planner weighs all process the same tokens (the effective
batch is kept), so what tells them apart is not the work but what is paid per micro-batch and what
checkpointing's recompute adds:

    step time = fixed per step + k x per micro-batch + work(tokens, seq) x r(checkpointing)

- `work` is fitted to the steps that ran, per (checkpointing, precision) group: a + b x tokens + c x tokens x
  seq (attention grows with the length), non-negative coefficients, the constant and the length term kept
  only where the observations spread enough to say them;
- the per-micro-batch cost is measured where one group ran at two micro-batch counts with micro-batches of
  two sizes, at the same lengths (`_at_shared_lengths`: in a curriculum k rises with the length, and a fit
  across lengths reads the length's cost as k's) (a least-squares coefficient on k, over the terms the steps' shapes can tell apart:
  `_micro_design`; where k only moved with the tokens - a ramp under a ceiling - nothing tells the two
  apart); until then, or where the fit gives none, a prior: 2 % of a micro-batch's time. Measured on the H200 (issue 28, calls
  4 and 7): a 0.32 B Llama's static 4 x 4 ran at 96 % of the tokens/s of 16 x 1 on the same curriculum,
  which is 1.3 % of a 16-row micro-batch per extra micro-batch. The earlier prior (10 % of the time, as
  a + b x tokens with a one tenth) made 8 x 2 look 9 % slower than 16 x 1, and the planner took
  checkpointing (x 4/3) over a 6 s restart for 110 steps: 0.79x the static configuration's tokens/s;
- checkpointing's recompute is measured by fitting the checkpointed steps as their own group; until one
  has run, the plain group's work x 4/3 (one more forward of three passes);
- another precision with the same checkpointing is taken at the same pace until it runs.
Pure Python (the fits are 4 x 4 normal equations).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

CKPT_TIME_PRIOR = 4.0 / 3.0  # a recomputed forward: ~1/3 of a training step more, until measured
PER_MICRO_PRIOR = 0.02  # of a micro-batch's time paid again by every extra micro-batch, until measured
MAX_OBS = 48  # steps kept per group (the recent ones: a curriculum's pace changes with its length)
SHARED_LEN_REL, SHARED_MIN = 0.02, 3  # lengths "the same" within 2 %; a count's steps there before it is compared


@dataclass(frozen=True)
class Obs:
    k: int  # micro-batches in the step
    tokens: float  # tokens the step processed (all its micro-batches)
    seq: float  # its sequence length
    dt: float  # its wall time, seconds


@dataclass
class StepTimes:
    """Step times per (checkpointing, precision), and the fitted model of what a configuration costs."""

    obs: dict[tuple[bool, str], deque] = field(default_factory=dict)
    # the fits of the steps seen so far: a decision asks for ~20 configurations, the steps change once a step
    _fits: dict = field(default_factory=dict, repr=False)

    def add(self, ckpt: bool, prec: str, k: int, tokens: float, seq: float, dt: float) -> None:
        if k >= 1 and tokens > 0 and seq > 0 and dt > 0:
            self.obs.setdefault((ckpt, prec), deque(maxlen=MAX_OBS)).append(Obs(k, tokens, seq, dt))
            self._fits.clear()

    def per_micro_s(self) -> float | None:
        """Seconds every extra micro-batch adds: measured where a group ran at two micro-batch counts."""
        if "per_micro" not in self._fits:
            self._fits["per_micro"] = self._per_micro_s()
        return self._fits["per_micro"]

    def _per_micro_s(self) -> float | None:
        for d in sorted(self.obs.values(), key=len, reverse=True):
            # k is told from the work only where the micro-batch's own size changed too (in a ramp under a
            # ceiling the micro-batch stays and k grows with the tokens, and any split between the two fits)
            # and at lengths both counts ran (in a curriculum k grows with the length, and the length's own
            # cost is read as k's: call s47b, 0.154 s a micro-batch where 4 x 4 ran as fast as 6 x 3)
            shared = _at_shared_lengths(list(d))
            per = [o.tokens / o.k for o in shared]
            if len({o.k for o in shared}) >= 2 and max(per) > 1.2 * min(per):
                coef = _nnls(*_micro_design(shared))
                if coef is not None and coef[0] > 0:  # none measured (clipped at 0): the prior, not "free"
                    return coef[0]
        every = [o.dt / o.k for d in self.obs.values() for o in d]
        return PER_MICRO_PRIOR * _median(every) if every else None

    def step_time(self, ckpt: bool, prec: str, k: int, tokens: float, seq: float) -> float | None:
        """The expected seconds of a step of `tokens` at `seq` in `k` micro-batches, in this group."""
        pm = self.per_micro_s()
        if pm is None:
            return None
        work = self._work(ckpt, prec, tokens, seq, pm)
        return None if work is None else work + k * pm

    def _group(self, ckpt: bool, prec: str) -> list[Obs]:
        own = self.obs.get((ckpt, prec))
        if own:
            return list(own)
        for (c, _p), d in self.obs.items():  # another precision, same checkpointing: the same pace assumed
            if c == ckpt and d:
                return list(d)
        return []

    def _line(self, ckpt: bool, prec: str, pm: float) -> tuple[float, float, float] | None:
        key = ("line", ckpt, prec)
        if key not in self._fits:
            g = self._group(ckpt, prec)
            self._fits[key] = _fit(g, pm) if g else None
        return self._fits[key]

    def _work(self, ckpt: bool, prec: str, tokens: float, seq: float, pm: float) -> float | None:
        if self._group(ckpt, prec):
            line = self._line(ckpt, prec, pm)
            return None if line is None else _eval(line, tokens, seq)
        line = self._line(not ckpt, prec, pm)
        if line is None:
            return None
        w = _eval(line, tokens, seq)
        return w * CKPT_TIME_PRIOR if ckpt else w / CKPT_TIME_PRIOR


def _at_shared_lengths(d: list[Obs]) -> list[Obs]:
    """The steps whose length another micro-batch count also ran at (within SHARED_LEN_REL), where a count
    has at least SHARED_MIN of them: what can tell a micro-batch's own cost from the length's. Repeated until
    it holds for every step kept (a step whose only partner's count fell short goes too - review of 0283073);
    by length order, each step against its neighbours within the tolerance."""
    keep = sorted(d, key=lambda o: o.seq)
    while True:
        shared = []
        lo = 0
        for o in keep:
            while keep[lo].seq < o.seq * (1.0 - SHARED_LEN_REL):
                lo += 1
            hi = lo
            while hi < len(keep) and keep[hi].seq <= o.seq * (1.0 + SHARED_LEN_REL):
                if keep[hi].k != o.k:
                    shared.append(o)
                    break
                hi += 1
        counts: dict[int, int] = {}
        for o in shared:
            counts[o.k] = counts.get(o.k, 0) + 1
        kept = [o for o in shared if counts[o.k] >= SHARED_MIN]
        if len(kept) == len(keep):  # nothing dropped (an empty list included): it holds for every step
            return kept
        keep = kept


def _micro_design(d: list[Obs]) -> tuple[list[list[float]], list[float]]:
    """The per-micro-batch fit's rows (k first) and step times. A term is kept only where the steps can tell
    it from the others: the tokens where they spread, then the constant (a per-step cost) and the length term
    only while there are more distinct step shapes than terms. With two shapes - H200 call s40g: 16 whole, then
    3 x 7 of 20, the micro-batch count and the tokens changed together - k, the tokens and a constant cannot all
    be told apart, and the solver gave the tokens nearly all of it (0.006 s a micro-batch against 0.153 measured
    across three configurations); without the constant (a per-step cost read as a per-micro-batch one) the same
    steps give 0.11 s."""
    toks, seqs = [o.tokens for o in d], [o.seq for o in d]
    shapes = len({(o.k, round(o.tokens), round(o.seq)) for o in d})
    cols = [lambda o: float(o.k)]
    if max(toks) > 1.2 * min(toks):
        cols.append(lambda o: o.tokens)
    if shapes > len(cols):
        cols.append(lambda o: 1.0)
    if len(cols) == 3 and max(seqs) > 1.2 * min(seqs) and shapes > len(cols):
        cols.append(lambda o: o.tokens * o.seq)
    return [[f(o) for f in cols] for o in d], [o.dt for o in d]


def _fit(g: list[Obs], pm: float) -> tuple[float, float, float] | None:
    """(a, b, c): work = a + b x tokens + c x tokens x seq, over a group's steps less their per-micro cost."""
    ys = [max(0.0, o.dt - o.k * pm) for o in g]
    toks = [o.tokens for o in g]
    seqs = [o.seq for o in g]
    spread_t = max(toks) > 1.2 * min(toks)
    spread_s = max(seqs) > 1.2 * min(seqs)
    rows = [[1.0, t, t * s] for t, s in zip(toks, seqs)]
    if spread_t and spread_s and len(g) >= 4:
        coef = _nnls(rows, ys)
        if coef is not None and (coef[1] > 0 or coef[2] > 0):
            return coef[0], coef[1], coef[2]
    if spread_t and len(g) >= 3:
        coef = _nnls([r[:2] for r in rows], ys)
        if coef is not None and coef[1] > 0:
            return coef[0], coef[1], 0.0
    b = _median([y / t for y, t in zip(ys, toks)])  # one size: time in proportion to the tokens
    return (0.0, b, 0.0) if b > 0 else None


def _eval(line: tuple[float, float, float], tokens: float, seq: float) -> float:
    a, b, c = line
    return a + b * tokens + c * tokens * seq


def _nnls(rows: list[list[float]], ys: list[float]) -> list[float] | None:
    """Least squares with every coefficient >= 0: refit without the ones that came out negative."""
    n = len(rows[0])
    active = list(range(n))
    for _ in range(n):
        sol = _lstsq([[r[j] for j in active] for r in rows], ys)
        if sol is None:
            return None
        if all(x >= 0 for x in sol):
            out = [0.0] * n
            for j, x in zip(active, sol):
                out[j] = x
            return out
        active = [j for j, x in zip(active, sol) if x >= 0]
        if not active:
            return None
    return None


def _lstsq(rows: list[list[float]], ys: list[float]) -> list[float] | None:
    """Normal equations, columns scaled to unit size first (tokens x seq is ~1e7 times the constant)."""
    n = len(rows[0])
    if len(rows) < n:
        return None
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(n)]
    xs = [[r[j] / scale[j] for j in range(n)] for r in rows]
    a = [[sum(x[i] * x[j] for x in xs) for j in range(n)] + [sum(x[i] * y for x, y in zip(xs, ys))] for i in range(n)]
    for c in range(n):  # Gauss-Jordan with partial pivoting
        p = max(range(c, n), key=lambda r: abs(a[r][c]))
        if abs(a[p][c]) < 1e-12:
            return None
        a[c], a[p] = a[p], a[c]
        for r in range(n):
            if r != c:
                f = a[r][c] / a[c][c]
                a[r] = [v - f * w for v, w in zip(a[r], a[c])]
    return [a[i][n] / a[i][i] / scale[i] for i in range(n)]


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if s else 0.0
