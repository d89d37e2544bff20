"""What the next step will need: an online, per-GPU and per-session estimate of each step's peak memory,
and the probability that the planned step's peak crosses the effective limit.

Why this is the backbone of the risk: near the limit, "memory is at 95 %" says nothing - a steady run
sits there for days - while "the step the workload is about to run needs more than is left" is exactly
the OOM. The workload knows its next step (batch, sequence length, mode, precision) before it runs it,
and every finished step recorded its peak (torch's max allocated during the step) and what stayed
allocated after it. So, from the steps in the window:

- activation of a step = its peak - what was allocated when it began (the previous step's allocated
  after; the step's own for the first one seen), per micro-batch;
- a step's shape: tokens T = micro-batch x sequence length, and T x S (attention's quadratic part);
- the planned shape seen already -> its activations' median (robust to a stray step); between shapes
  seen -> interpolated in tokens between its neighbours; beyond them -> extrapolated with the slope of
  the two largest (or in proportion to tokens, with one shape); longer than any length seen -> no less than
  the session's own curvature in tokens x length (fitted once three lengths ran; before, leaning toward that
  bound: `longer_than_seen`); below them -> for the risk's features the
  smallest shape's, for the planner in proportion to tokens down to the floor of everything allocated between
  steps (the phase that forms the gradients; `StepFit.floor_below`); see `activation_at`;
- precision: activations scale by the bytes per element (bf16 -> fp32 doubles them);
- growth: what stays allocated after each step rising (a leak, a growing cache): the median per-step
  increase of the last 10 steps, carried forward over the steps that fit in the horizon;
- prediction interval: a normal around the estimate, its spread the robust scale (1.4826 x MAD) of
  repeated shapes' activations, with a floor of 1 % of the activation + 32 MiB, widened when the plan
  lies between shapes seen (a tenth of their difference) or beyond them (a quarter of the step from
  the largest; longer than any length seen, at least as wide as puts tokens x length at 1.645 sigma).

- accumulation (the planner's estimate, `fit_steps(held=True)`): a train step split into micro-batches holds
  the gradients of the first micro-batches while the later ones run - their peak is the micro-batch's
  activations plus those held bytes, which a step of one micro-batch never carries whole (H200, v2-lite
  train under a 100 GiB cap: 10 x 512 alone peaked at 68.2 GB, as 2 x 10 at 99.6 GB; the held 31.4 GB are
  its bf16 gradients). The held bytes are learned from the steps that accumulated (their activations less
  what the steps of one micro-batch give at the same shape, interpolated), and before any did, taken as
  everything allocated between steps (weights + optimizer state + gradients: never less than the
  gradients, exact where the optimizer keeps no state). Accumulating steps' activations are counted
  without them, so a shape run both ways is one shape, not a spread of twice its size;
- a shape that ran out of memory earlier in the session (the OOM event's batch, sequence length,
  precision and what was allocated before it) is a censored observation: its peak exceeded the limit.
  A plan at least that large in every dimension, with at least as much allocated now, is forecast at
  the limit or above with P >= FAILED_P - whatever the steps that ran would suggest (a fragmented
  allocator fails a shape well below what its activations alone need; the shape's failure says so);
- before any shape failed: a plan whose peak is at least FRAG_STEP of the limit above every step that
  ran, more than the room left outside the allocator's reserved segments, must take its growth from
  cached blocks cut for smaller shapes - which a larger shape's tensors rarely fit (best fit asks for a
  block at least as large): P >= FRAG_P (set 3 of the near-cap recordings: ramps failing at 37-56 % of
  the cap allocated, the segments of the smaller batches filling it). The feature function applies it
  to inference steps only (prefill, decode): in training it raised 5.8 near-limit false alarms an hour in
  held-out evaluation (train ramps whose larger batches fit in the segments of the optimizer's and the
  gradients' fixed blocks), inference-only 1.5 - a choice made after seeing those held-out figures, so
  they are optimistic about it (models/risk.md says so).

The effective limit for a step's peak: what torch may allocate (the `--gpu-memory-limit` cap, else the
card less other processes, the driver's reserve and this process's memory outside torch) less the
allocator's unusable slack (FRAGMENT_MARGIN of it: blocks are rounded and split, so a cap is never
filled to the byte - measured on the H200, see models/risk.md).

Pure numpy on plain arrays, no polars, no model: the same code scores live, in replay and in training,
and the counterfactual-cap transform (`predict/counterfactual.py`) uses the same limit rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

FRAGMENT_MARGIN = 0.03  # share of the allocator's limit a step's peak cannot use (rounding, splits)
MARGIN_MIN_BYTES = 256 * 2**20
FLOOR_REL, FLOOR_BYTES = 0.01, 32 * 2**20
EXTRAPOLATION_REL = 0.25
INTERPOLATION_REL = 0.10
LONGER_FIT = 3  # the longest lengths whose shapes' curvature a plan longer than all of them is fitted to
LONGER_CURVE_MIN = 1e-4  # of the largest activations fitted: a smaller curvature term at the plan is rounding
LONGER_RATIO_MAX = 3.0  # the length's ratio the tokens x length bound grows by, at most
LONGER_PRIOR_W = 0.25  # before 3 lengths: how far toward activations growing as tokens x length (`longer_than_seen`)
PRECISION_BYTES = {"fp32": 4.0, "tf32": 4.0, "bf16": 2.0, "fp16": 2.0}
GROWTH_STEPS = 10
FAILED_P = 0.99  # P(the plan fails) where a shape no larger failed before with no less allocated
FRAG_STEP = 0.05  # of the limit: a plan whose peak is this much above any step's peak that ran...
FRAG_P = 0.9  # ...and more than the room left outside the allocator's segments: P(it fails)
FIRST_STEP_BASE = "first_step_base_frac"  # a features dict's extra key (not a model input): before a GPU's
# first step, the shape library's weights / the usable limit (predict/prior.py), what the guard sizes that step with
USABLE = "usable_limit_bytes"  # a features dict's extra key (not a model input): the usable limit the window's
# estimates were weighed against (`usable_limit` with the window's highest peak), for the guard's events and sizing
SMALL_N = 256  # `shapes` in plain Python up to this many steps
KEY_BASE = 1e6  # a shape's key: tokens x KEY_BASE + length (lengths stay below it; exact in a float64 up to
# 2^53 / 1e6 ~ 9e9 tokens)
FAILED_ALLOC_TOL = 0.01  # of the limit: "no less allocated" within this
SCALED_BELOW_MIN_STEPS = 3  # the planner scales below the smallest shape only from this many steps (review of
# ed76215: from a window of 1-2 steps - a loop's first steps, a graph pool's warm-up - whole steps came out up to
# 3.8 sigma short; the old rule there)
HELD_SIGMA_MEASURED, HELD_SIGMA_PRIOR = 0.05, 0.15  # of the held bytes: their spread, learned / the prior
INFERENCE = ("prefill", "decode")  # modes with no optimizer: what a step leaves allocated was there at its peak


def shape_key(tokens, length):
    """A shape's key (a float, or an array of them): tokens x KEY_BASE + length - one number that sorts by
    tokens and tells two shapes of the same tokens apart by their length."""
    return tokens * KEY_BASE + length


def key_length(keys: np.ndarray) -> np.ndarray:
    """The sequence lengths back from `shape_key` keys."""
    return keys - np.floor(keys / KEY_BASE) * KEY_BASE


@dataclass(frozen=True)
class Failed:
    """A shape that ran out of memory in this session (from its OOM event's detail)."""

    tokens: float  # batch x sequence length of the failing (micro-)batch
    seq: float
    elem_bytes: float  # bytes per element of its precision
    alloc_before: float  # bytes allocated when it began (NaN where not recorded)


@dataclass(frozen=True)
class Forecast:
    mean: float  # bytes: the planned step's peak allocated, estimated
    sigma: float  # bytes: one standard deviation of that estimate
    limit: float  # bytes: the effective limit for a step's peak
    p_next: float  # P(the planned step's peak > limit)
    p_horizon: float  # P(a step within the horizon crosses it, the growth trend carried on)
    growth: float  # bytes per step that stay allocated (a leak)
    steps_seen: int
    failed_before: bool = False  # the plan is no smaller than a shape that failed in this session
    base: float = float("nan")  # bytes that stay allocated under the step (the weights), where known apart


def usable_limit(alloc_limit: float, ran: float | None = None) -> float:
    """The most a step's peak can reach under an allocator limit of `alloc_limit` bytes, and no less than `ran`,
    the highest peak a step reached under it (the window's; None: none yet): the allocator served that much.

    The margin is FRAGMENT_MARGIN of the limit, and no less than MARGIN_MIN_BYTES before a step shows what the
    allocator can give: at small caps the fixed part (workspaces, a graph pool, rounding) is a large share, and
    a first step that failed is warned only on that margin (at 64 MiB three of the held-out sets' first-step
    OOMs went unwarned). After steps ran, their highest peak is the evidence: the floor was 15 % of blind set
    2911's 1.62 GiB decode cap, whose steps peaked at 1.424 GiB again and again, 1.04 of a 1.37 GiB "usable"
    limit - four near-limit false alarms on a run that fitted (docs/BENCHMARKS.md, session 51). Above
    FRAGMENT_MARGIN's share nothing is proven by a peak, and a peak over the limit itself ran under another one
    (no cap: the card less other processes, which grew since)."""
    u = alloc_limit - max(MARGIN_MIN_BYTES, FRAGMENT_MARGIN * alloc_limit)
    if ran is not None and u < ran <= alloc_limit:  # a peak over the limit itself ran under another, larger one
        u = min(float(ran), (1.0 - FRAGMENT_MARGIN) * alloc_limit)
    return u


def usable_of(alloc_limit: float, peaks: np.ndarray) -> float:
    """`usable_limit` with the evidence of a window's steps: the highest of their peaks (NaN: not recorded)."""
    pk = peaks[np.isfinite(peaks)]
    return usable_limit(alloc_limit, float(pk.max()) if pk.size else None)


def ncdf_upper(z: float) -> float:
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def forecast(batch: np.ndarray, seq: np.ndarray, micro: np.ndarray, prec: list, alloc: np.ndarray,
             peak: np.ndarray, step_s: np.ndarray, plan_batch: float, plan_seq: float, plan_prec: str | None,
             limit: float, horizon_s: float = 5.0, failed: list[Failed] | None = None,
             reserved: float | None = None) -> Forecast | None:
    """The forecast for the planned step from the window's finished steps (time order, one GPU), and
    the shapes that failed in the session (`failed`) and what the allocator holds now (`reserved`,
    torch's reserved bytes after the last step). Arrays may hold NaN (a step with no torch
    figures, e.g. on a CPU): those steps are skipped."""
    if not (limit > 0) or not (plan_batch and plan_seq) or batch.size == 0:
        return None
    fit = fit_steps(batch, seq, micro, prec, alloc, peak, step_s, plan_prec)
    return fit.at(plan_batch, plan_seq, limit, horizon_s, failed, reserved) if fit is not None else None


@dataclass(frozen=True)
class StepFit:
    """What a window's finished steps say before any plan is asked about: each shape's activations (in
    the plan's precision), their spread, what stays allocated and its growth, the pace. `at` forecasts
    one plan; a second plan (the lookahead's) costs only its own lookup."""

    uk: np.ndarray  # the distinct shapes (`shape_key`), in order of tokens (`shapes`)
    med: np.ndarray  # their median activations in the plan's precision
    ut: np.ndarray  # their tokens per (micro-)batch
    resid: float  # the pooled residual scale
    alloc_now: float
    growth: float
    target_bytes: float
    peak: np.ndarray
    pace_s: float | None  # median of the last 5 step times
    steps_seen: int
    held: float = float("nan")  # bytes an accumulating step holds over its micro-batch (its gradients), learned
    # from the steps that accumulated beside whole ones of their length; NaN: not learned (the prior decides)
    held_folded: bool = False  # every step accumulated: their activations carry the held bytes already
    scaled_below: bool = False  # below the smallest shape seen: in proportion to tokens, floored (the planner's
    # estimate, `fit_steps(held=True)`; the risk's features keep "a smaller step needs no more")

    def prior_held(self) -> float:
        """Before anything was learned: everything allocated between steps (weights, optimizer state), which
        is never less than the gradients - exact where the optimizer keeps no state."""
        return max(0.0, self.alloc_now) if math.isfinite(self.alloc_now) else 0.0

    def held_bytes(self) -> tuple[float, float]:
        """(bytes a plan that accumulates adds to its micro-batch's activations, their spread): nothing where
        the steps' activations carry them already, else learned, else the prior."""
        if self.held_folded:
            return 0.0, 0.0
        if math.isfinite(self.held):
            return self.held, HELD_SIGMA_MEASURED * self.held
        h = self.prior_held()
        return h, HELD_SIGMA_PRIOR * h

    def floor_below(self, micro_batches: int = 1) -> float | None:
        """The least activations a step below the smallest shape seen is estimated at (None: that shape's own,
        "a smaller step needs no more" - the risk's features). A whole step's peak never falls below the phase
        that forms the gradients and runs the optimizer, whatever its tokens: everything allocated between
        steps bounds it (v2-lite train on the H200 at 2-4 x 512: 31.49 GB with 31.56 allocated; the small
        preset at 2-3 x ~258: 0.96 GB with 1.02). A micro-batch of an accumulating step is floored so that
        it and the held bytes added to it reach that floor together (review of ed76215: with a small learned
        held - a graph pool's or a cache loop's 0.07-0.44 GB - a floor of 0 came out 15 times over 3 sigma
        short in the recorded windows; this, 6 times over 1.645 sigma of 120, the worst 0.23 GB)."""
        if not self.scaled_below or self.steps_seen < SCALED_BELOW_MIN_STEPS:
            return None
        if micro_batches > 1 and not self.held_folded:
            return max(0.0, self.prior_held() - self.held_bytes()[0])
        return self.prior_held()

    def at(self, plan_batch: float, plan_seq: float, limit: float, horizon_s: float = 5.0,
           failed: list[Failed] | None = None, reserved: float | None = None,
           micro_batches: int = 1) -> Forecast | None:
        """The forecast for a step of `plan_batch` x `plan_seq` per micro-batch; `micro_batches` > 1: a train
        step that accumulates, holding its gradients over the micro-batches (`held_bytes`)."""
        if not (limit > 0) or not (plan_batch and plan_seq):
            return None
        Tp, Sp = float(plan_batch) * float(plan_seq), float(plan_seq)
        a_hat, resid_scale, extrap = activation_at(self.uk, self.med, self.ut, self.resid, Tp, Sp,
                                                   self.floor_below(micro_batches))
        a_hat = max(a_hat, 0.0)
        growth = self.growth
        h, h_sigma = self.held_bytes() if micro_batches > 1 else (0.0, 0.0)
        mean = self.alloc_now + a_hat + h + max(0.0, growth)
        sigma = math.sqrt(max(resid_scale, FLOOR_REL * a_hat + FLOOR_BYTES) ** 2 + extrap ** 2 + h_sigma ** 2)
        p_next = ncdf_upper((limit - mean) / sigma)
        k = max(1, int(math.ceil(horizon_s / self.pace_s))) if self.pace_s else 1
        mean_h = mean + max(0.0, growth) * (k - 1)
        p_h = max(p_next, ncdf_upper((limit - mean_h) / sigma))
        hit = fails_as_before(failed, Tp, Sp, self.target_bytes, self.alloc_now, limit)
        if hit:
            mean, p_next, p_h = max(mean, float(limit)), max(p_next, FAILED_P), max(p_h, FAILED_P)
        elif _outgrows_segments(mean, self.peak, reserved, limit):
            p_next, p_h = max(p_next, FRAG_P), max(p_h, FRAG_P)
        return Forecast(mean, sigma, float(limit), p_next, p_h, growth, self.steps_seen, hit)


def fit_steps(batch: np.ndarray, seq: np.ndarray, micro: np.ndarray, prec: list, alloc: np.ndarray,
              peak: np.ndarray, step_s: np.ndarray, plan_prec: str | None, held: bool = False,
              kept: bool = False) -> StepFit | None:
    """The plan-free part of `forecast` (None where no step has torch figures). `held`: the steps that
    accumulated (micro-batches > 1) are told apart - what they hold over the micro-batch is learned
    (`StepFit.held`) and taken off their activations (the planner's estimate; the risk model's features keep
    the fit they were trained with). `kept` (inference modes, `INFERENCE`): a step's activations are its peak
    less the larger of what was allocated before it and after it - a decode that grows its KV cache and graph
    pool at a new batch keeps them (blind set 2911: at 18 -> 34 the first step's 0.41 GB "activations" held the
    0.11 GB it kept, counted again in what stays allocated: 1.53 GB estimated for steps that then peaked at
    1.424). In training the first step's optimizer state is made after its peak, so there the rule stays."""
    if batch.size == 0:
        return None
    mb = np.where(np.isfinite(micro) & (micro >= 1), micro, 1.0)
    T = np.ceil(batch / mb) * seq
    S = seq.astype(np.float64)
    base = np.concatenate((alloc[:1], alloc[:-1]))
    if kept:  # an inference step's cache or graph pool, made by the step and kept, was there at its peak: it is
        base = np.fmax(base, alloc)  # what stays allocated, not activations (else counted twice at a new shape)
    act = peak - base
    ok = np.isfinite(act) & np.isfinite(T) & (T > 0) & np.isfinite(alloc)
    if not ok.any():
        return None
    last_prec = prec[-1] if prec else None
    p0 = prec[0] if prec else None
    pscale: float | np.ndarray
    if prec and prec.count(p0) == len(prec):  # one precision (nearly always): a scalar, not a list's array
        pscale = PRECISION_BYTES.get(str(p0), 2.0)
    else:
        pscale = np.array([PRECISION_BYTES.get(str(p), 2.0) for p in prec], dtype=np.float64)
    target_bytes = PRECISION_BYTES.get(str(plan_prec or last_prec), 2.0)
    act_n = act / pscale * target_bytes  # activations in the plan's precision
    T, S, act_n = T[ok], S[ok], np.maximum(act_n[ok], 0.0)
    al = alloc[np.isfinite(alloc)]
    st = step_s[np.isfinite(step_s) & (step_s > 0)]
    h, folded = float("nan"), False
    if held:
        acc = mb[ok] > 1
        folded = bool(acc.all())
        h = float("nan") if folded else _held(T, S, act_n, acc, float(al[-1]))
        if math.isfinite(h):
            act_n = np.where(acc, np.maximum(act_n - h, 0.0), act_n)
            # never scaled down: under autocast a lower precision keeps the weights' and gradients' dtype
            h /= min(1.0, target_bytes / PRECISION_BYTES.get(str(last_prec), 2.0))
    return StepFit(*shapes(T, S, act_n), float(al[-1]), _growth(al), target_bytes, peak,
                   median(st[-5:]) if st.size else None, int(ok.sum()), h, folded, held)


def _held(T: np.ndarray, S: np.ndarray, act: np.ndarray, acc: np.ndarray, alloc_now: float) -> float:
    """What the accumulating steps hold besides their micro-batch's activations: the median, over those
    steps, of their activations less what the steps of one micro-batch at the same sequence length give at
    their tokens (interpolated between shapes, as `activation_at`; below the smallest, in proportion to
    tokens - "a smaller step needs no more" would make the held bytes too small; another length's steps are
    not compared: attention's T x S part would be read as held bytes), within [0, alloc_now]. NaN where no
    accumulating step has whole steps of its length beside it (the prior decides). Where every step
    accumulated, `fit_steps` marks the fit folded instead: their activations carry the held bytes."""
    whole_by_len: dict[float, tuple[np.ndarray, np.ndarray, np.ndarray, float] | None] = {}
    d: list[float] = []
    for t, s, a in zip(T[acc].tolist(), S[acc].tolist(), act[acc].tolist()):
        if s not in whole_by_len:
            m = ~acc & (S == s)
            whole_by_len[s] = shapes(T[m], S[m], act[m]) if m.any() else None
        fit = whole_by_len[s]
        if fit is None:
            continue
        d.append(a - activation_at(*fit, t, s, floor=0.0, longer=False)[0])  # below the smallest: in proportion, no floor
    if not d:
        return float("nan")
    return float(min(max(median(np.array(d)), 0.0), max(alloc_now, 0.0)))


def _outgrows_segments(mean: float, peak: np.ndarray, reserved: float | None, limit: float) -> bool:
    """The plan needs FRAG_STEP of the limit more than any step's peak, and more than the room left
    outside the allocator's segments."""
    pk = peak[np.isfinite(peak)]
    if reserved is None or not math.isfinite(reserved) or not pk.size:
        return False
    grow = mean - float(pk.max())
    return grow >= FRAG_STEP * limit and grow > limit - reserved


def fails_as_before(failed: list[Failed] | None, Tp: float, Sp: float, elem: float, alloc_now: float,
                    limit: float) -> bool:
    """The plan is at least as large as a shape that failed (tokens, sequence, bytes per element) and
    no less is allocated now than then: it will fail again."""
    for f in failed or ():
        no_less = not math.isfinite(f.alloc_before) or alloc_now >= f.alloc_before - FAILED_ALLOC_TOL * limit
        if Tp >= f.tokens and Sp >= f.seq and elem >= f.elem_bytes and no_less:
            return True
    return False


def _growth(al: np.ndarray) -> float:
    """Median per-step change of what stays allocated, last GROWTH_STEPS steps (0 with fewer than 3)."""
    a = al[-(GROWTH_STEPS + 1):]
    return median(np.diff(a)) if a.size >= 3 else 0.0


def median(x: np.ndarray) -> float:
    """np.median of a small 1-D float array (no NaN), without np.median's generic machinery (~10x
    faster at the window's sizes: a window calls it half a dozen times)."""
    y = np.sort(x)
    n = y.size
    return float(0.5 * (y[(n - 1) // 2] + y[n // 2]))


def nanmedian(x: np.ndarray) -> float:
    y = x[np.isfinite(x)]
    return median(y) if y.size else float("nan")


def _group_medians(inv: np.ndarray, x: np.ndarray, n: int) -> np.ndarray:
    """np.median of x within each group 0..n-1 (inv: each element's group), in one sort."""
    order = np.lexsort((x, inv))
    xs = x[order]
    counts = np.bincount(inv, minlength=n)
    start = np.r_[0, np.cumsum(counts)[:-1]]
    return 0.5 * (xs[start + (counts - 1) // 2] + xs[start + counts // 2])


def shapes(T: np.ndarray, S: np.ndarray, act: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """The distinct shapes (`shape_key`), the median activation of each and its tokens,
    in order of tokens, and the pooled residual scale of the shapes seen at least 3 times.

    In plain Python below SMALL_N steps (a live window holds at most 64): np.unique and a grouped sort
    cost ~0.15 ms at these sizes, a dict of lists a tenth of it; the figures are the same to the bit
    (the same float operations: tests/test_peak.py checks both paths against each other)."""
    if T.size > SMALL_N:
        return shapes_np(T, S, act)
    groups: dict[float, tuple[float, list[float]]] = {}
    for t, s, a in zip(T.tolist(), S.tolist(), act.tolist()):
        k = shape_key(t, s)
        g = groups.get(k)
        if g is None:
            groups[k] = (t, [a])
        else:
            g[1].append(a)
    keys = sorted(groups)
    meds: list[float] = []
    dev: list[float] = []
    for k in keys:
        v = sorted(groups[k][1])
        n = len(v)
        m = 0.5 * (v[(n - 1) // 2] + v[n // 2])
        meds.append(m)
        if n >= 3:
            dev.extend(abs(a - m) for a in groups[k][1])
    ut = [groups[k][0] for k in keys]
    order = sorted(range(len(keys)), key=ut.__getitem__)  # stable, as argsort(kind="stable")
    if dev:
        dev.sort()
        resid = 1.4826 * float(0.5 * (dev[(len(dev) - 1) // 2] + dev[len(dev) // 2]))
    else:
        resid = 0.0
    return (np.array([keys[i] for i in order]), np.array([meds[i] for i in order]),
            np.array([ut[i] for i in order]), resid)


def shapes_np(T: np.ndarray, S: np.ndarray, act: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """`shapes` in numpy (long windows: training's and `score`'s are no longer than live ones, but a
    caller may pass more)."""
    keys = shape_key(T, S)
    uk, first, inv = np.unique(keys, return_index=True, return_inverse=True)
    med = _group_medians(inv, act, uk.size)
    dev = np.abs(act - med[inv])
    counts = np.bincount(inv)
    resid = 1.4826 * median(dev[counts[inv] >= 3]) if (counts >= 3).any() else 0.0
    ut = T[first]  # a shape's tokens (one value per key)
    order = np.argsort(ut, kind="stable")
    return uk[order], med[order], ut[order], resid


def activation_at(uk: np.ndarray, med: np.ndarray, ut: np.ndarray, resid: float, Tp: float, Sp: float,
                  floor: float | None = None, longer: bool = True) -> tuple[float, float, float]:
    """(activation estimate, residual scale, extrapolation spread) at the planned shape, from `shapes`.

    Each shape seen gives the median of its activations (robust to a stray step); the spread within
    shapes, pooled, is the residual scale. The plan's shape seen -> its median. Between shapes seen ->
    linear interpolation in tokens between the two neighbours (a step's memory is piecewise linear in
    tokens: flat while the optimizer's temporaries dominate, then rising with activations - one line
    over all shapes would miss that bend). Above them -> the slope of the two largest shapes, or
    proportional to tokens where there is one shape or the slope is not positive. Below them -> the
    smallest shape's (a smaller step does not need more); with a `floor` (the planner's estimate): in
    proportion to tokens but no less than min(floor, the smallest shape's), widened by a tenth of what
    that saves - on 3,452 pairs of shapes in the recorded sessions (benchmarks/peak_below_range.py), the
    smaller shape never came out above this estimate by more than 1.645 of its spread. Longer than any length
    seen (`longer`: the live estimate's rule; the shape library's first-step prior was not tuned with it):
    `longer_than_seen`."""
    hit = np.where(uk == shape_key(Tp, Sp))[0]
    if hit.size:
        return float(med[hit[0]]), resid, 0.0
    if Tp <= ut[0]:
        m0 = float(med[0])
        if floor is None or not (ut[0] > 0):
            a_hat, extrap = m0, 0.0
        else:
            a_hat = max(m0 * Tp / float(ut[0]), min(m0, max(0.0, floor)))
            extrap = INTERPOLATION_REL * (m0 - a_hat)
    elif Tp >= ut[-1]:
        if ut.size >= 2 and ut[-1] > ut[-2] and med[-1] > med[-2]:
            a_hat = float(med[-1] + (med[-1] - med[-2]) / (ut[-1] - ut[-2]) * (Tp - ut[-1]))
        else:
            a_hat = float(med[-1] * Tp / ut[-1])
        extrap = EXTRAPOLATION_REL * abs(a_hat - float(med[-1]))
    else:
        j = int(np.searchsorted(ut, Tp))
        lo, hi = j - 1, j
        f = (Tp - ut[lo]) / (ut[hi] - ut[lo]) if ut[hi] > ut[lo] else 0.0
        a_hat = float(med[lo] + f * (med[hi] - med[lo]))
        extrap = INTERPOLATION_REL * abs(float(med[hi] - med[lo]))
    if longer:  # below the smallest tokens too: a split or token-budget batching at a new length (review of 9c8a55e)
        lengths = key_length(uk)
        if Sp > float(lengths.max()):
            a_hat, extrap = longer_than_seen(lengths, med, ut, Tp, Sp, a_hat, extrap)
    return a_hat, resid, extrap


def longer_than_seen(lengths: np.ndarray, med: np.ndarray, ut: np.ndarray, Tp: float, Sp: float,
                     a_hat: float, extrap: float) -> tuple[float, float]:
    """(activation, extrapolation spread) of a plan longer than any length seen, from its estimate in tokens
    (`activation_at`): a step's activations grow with its tokens and, where attention keeps its scores (eager,
    a cache of keys), with tokens x length too - which an estimate in tokens alone misses. In the recorded
    sessions (benchmarks/estimate_errors.py, group "longer": 134 steps in 44 sessions, session 46) it came out
    short beyond 1.645 sigma on 13.4 % of such steps, up to 17.9 % of the usable limit (user-like loops with a
    cache or a graph pool, at jumps of x1.1-x2.8); on a Trainer's curriculum with SDPA the estimate in tokens was
    exact. So, from the shapes at the LONGER_FIT longest lengths seen (every micro-batch run at them):
    - three lengths: a + b T + c T S fitted to those shapes (least squares); where c > 0 the plan's activation is
      no less than the fit's (the session's own curvature; none where its attention keeps no scores), capped at
      the bound below (three noisy shapes fitted exactly can extrapolate to anything);
    - fewer: nothing to learn the curvature from, so the estimate is bounded by all of the longest shape's
      activations growing as T x S (the length's ratio counted up to LONGER_RATIO_MAX): the mean moves LONGER_PRIOR_W of the way to that bound and the bound sits at
      1.645 sigma.
    The reference is the longest shape seen, never the estimate's neighbour in tokens: after a planner's change of
    micro-batch that neighbour can be a much shorter shape of the larger micro-batch, whose T x S bound is twice
    the step (call s47a, before this: a Trainer's curriculum split 8 -> 3 -> 2 on a +-22 % spread).
    Chosen on the recorded sessions (blind sets 2901-2910 among them, all seen since): docs/BENCHMARKS.md, issue
    29, session 47."""
    distinct = np.unique(lengths)[-LONGER_FIT:]
    top = np.nonzero(np.isin(lengths, distinct))[0]
    longest = top[lengths[top] == distinct[-1]]
    ref = int(longest[np.argmax(ut[longest])])
    s_ref = float(lengths[ref])
    if not (s_ref > 0 and ut[ref] > 0):
        return a_hat, extrap
    # all of the longest shape's activations growing as tokens x length: what no step can exceed, the length's
    # ratio clamped to what the rule was chosen on (jumps up to x2.8; review of 9c8a55e: one shape at 128 and a
    # plan at 4,096 gave 169 GiB)
    bound = max(a_hat, float(med[ref]) * Tp / float(ut[ref]) * min(Sp / s_ref, LONGER_RATIO_MAX))
    if distinct.size >= LONGER_FIT:
        X = np.column_stack((np.ones(top.size), ut[top], ut[top] * lengths[top]))
        # each column scaled to 1 first: unscaled (1, ~1e4, ~1e7) the fit's condition let the CPU's BLAS kernel
        # move the estimate by 2 % (the same session under OpenBLAS' SkylakeX and Haswell kernels)
        scale = np.abs(X).max(axis=0)
        scale[scale == 0] = 1.0
        coef, _, rank, _ = np.linalg.lstsq(X / scale, med[top], rcond=None)
        coef = coef / scale
        # a curvature that adds under LONGER_CURVE_MIN of the largest activations at the plan is the fit's rounding
        # (activations linear in tokens fit c = +-1e-20; its sign moved the estimate by 256 MiB between BLAS kernels)
        if rank < 3:  # one token count at every length (token-budget batches): a and b are not told apart - the prior
            return _toward_bound(a_hat, extrap, bound)
        if coef[2] * Tp * Sp > LONGER_CURVE_MIN * max(float(np.max(np.abs(med[top]))), 1.0):  # capped at the bound: three noisy shapes fit exactly can extrapolate to anything
            a_fit = min(float(coef[0] + coef[1] * Tp + coef[2] * Tp * Sp), bound)  # (review: 44.6 GiB for 2.5)
            if a_fit > a_hat:
                return a_fit, max(extrap, EXTRAPOLATION_REL * (a_fit - a_hat))
        return a_hat, extrap
    return _toward_bound(a_hat, extrap, bound)


def _toward_bound(a_hat: float, extrap: float, bound: float) -> tuple[float, float]:
    """No curvature to learn: the mean LONGER_PRIOR_W of the way to the tokens x length bound, the bound at 1.645 sigma."""
    a = a_hat + LONGER_PRIOR_W * (bound - a_hat)
    return a, max(extrap, (bound - a) / 1.645)
