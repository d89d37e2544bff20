"""The estimator's peak for configurations the workload has not chosen yet - the planner's question
(control/planner.py): for a micro-batch, sequence length, precision and activation-checkpointing setting,
what will the step's peak be, as a share of the usable limit, and how sure is that?

The same fit as the risk's features (`peak.fit_steps` over the window's steps, `usable_limit`, the shapes
that failed in the session), made once per (checkpointing, precision) and asked at every configuration:
- steps that ran with checkpointing on are their own group (`steps.checkpointing`, schema v5); a group
  that has not run yet is estimated from the other: what stays allocated the same, the activations x the
  measured ratio where both groups ran at a shape (clamped to [0.05, 1]), else x CKPT_ACT_PRIOR (on from
  off; its inverse the other way) with a spread of CKPT_SIGMA_PRIOR of the activations added - the prior
  is wide on purpose, and the first step with checkpointing replaces it;
- precision: activations scale by bytes per element, as in the risk's estimate (peak.py);
- accumulation (`Config.micro_batches` > 1, train): the gradients held over the micro-batches are added
  (`StepFit.held_bytes`: learned from the steps that accumulated - in either checkpointing group, since
  the gradients are the same - else the prior of everything allocated between steps).
Pure numpy over the window; no model.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Sequence

import numpy as np

from gpuwatch.contract import Config
from gpuwatch.predict.features import failed_shapes, limits
from gpuwatch.predict.peak import INFERENCE, StepFit, fit_steps, usable_of
from gpuwatch.recording.window import Window

CKPT_ACT_PRIOR = 0.6  # activations with checkpointing / without, until both have run (logits and the loss
# stay whole: a large vocabulary keeps the ratio well above a layer count's 1/L)
CKPT_SIGMA_PRIOR = 0.2  # of the activations: the prior's spread
CKPT_SIGMA_MEASURED = 0.05


def _arrays(w: Window):
    st = w.steps

    def col(name: str) -> np.ndarray:
        return np.asarray(st[name].to_numpy(), dtype=np.float64) if name in st.columns else np.full(st.height, np.nan)

    micro = col("micro_batches")
    # nulls off, as fill_null(False) would make them - without its polars query (~0.1 ms alone, and ms on the
    # training thread while the scorer's thread and the sampler share the cores: most of this function's time)
    ck = (np.array([x is True for x in st["checkpointing"].to_list()], dtype=bool) if "checkpointing" in st.columns
          else np.zeros(st.height, dtype=bool))
    return (col("batch"), col("seq_len"), micro, list(st["precision"].to_list()), col("torch_allocated_bytes"),
            col("torch_peak_bytes"), col("step_time_s"), ck)


def estimate(w: Window, asks: Sequence[tuple[Config, int]]) -> list[tuple[float, float] | None]:
    """For each (configuration, sequence length): (mean, sigma) of its step's peak / the usable limit, or
    None where the window has no step with torch figures (a first step: the shape library's business)."""
    lim = limits(w).alloc_limit
    if not w.steps.height or not lim:
        return [None] * len(asks)
    batch, seq, micro, prec, alloc, peak, times, ck = _arrays(w)
    usable = usable_of(lim, peak)  # as the risk's features weigh it
    inference = "mode" in w.steps.columns and w.steps["mode"][-1] in INFERENCE
    failed = failed_shapes(w.events)
    fits: dict[tuple[bool, str], StepFit | None] = {}

    def fit(on: bool, p: str) -> StepFit | None:
        key = (on, p)
        if key not in fits:
            m = ck == on
            fits[key] = (fit_steps(batch[m], seq[m], micro[m], [x for x, k in zip(prec, m) if k], alloc[m], peak[m],
                                   times[m], p, held=True, kept=inference) if m.any() else None)
        return fits[key]

    def held(f: StepFit, on: bool, p: str) -> StepFit:
        """`f` (the group with checkpointing `on`) with the held bytes the other group learned, where its own
        steps never accumulated: the gradients do not depend on checkpointing."""
        if f.held_folded or math.isfinite(f.held):
            return f
        o = fit(not on, p)  # only a measured value: the other group's "folded" says nothing of this group's steps
        return replace(f, held=o.held) if o is not None and math.isfinite(o.held) else f

    out: list[tuple[float, float] | None] = []
    for c, s in asks:
        k = max(1, int(c.micro_batches))
        own = fit(c.checkpointing, c.precision)
        if own is not None:
            fc = held(own, c.checkpointing, c.precision).at(
                c.micro_batch, s, usable, failed=failed if not c.checkpointing else None, micro_batches=k)
            out.append(None if fc is None else (fc.mean / usable, fc.sigma / usable))
            continue
        other = fit(not c.checkpointing, c.precision)
        fc = other.at(c.micro_batch, s, usable, micro_batches=k) if other is not None else None
        if other is None or fc is None:
            out.append(None)
            continue
        act = max(0.0, fc.mean - other.alloc_now - max(0.0, other.growth))
        # the gradients held over the micro-batches: checkpointing leaves them as they are (where the other
        # group's activations carry them, the prior's share of them is taken out before the ratio)
        kept = min(other.prior_held() if other.held_folded else other.held_bytes()[0], act) if k > 1 else 0.0
        act -= kept
        ratio = CKPT_ACT_PRIOR if c.checkpointing else 1.0 / CKPT_ACT_PRIOR
        # checkpointing does not shrink the phase that forms the gradients and runs the optimizer: the
        # activations with it stay at or above the planner's floor (H200 s39a: 10 x 512 with checkpointing
        # peaked 31.9 GB over what stayed allocated, the floor 31.6 GB, where x 0.6 said 22 GB)
        fl = other.floor_below(k)
        mean = fc.mean - act + (max(min(act, fl), act * ratio) if fl is not None else act * ratio)
        sigma = math.hypot(fc.sigma, CKPT_SIGMA_PRIOR * act * max(1.0, ratio))
        out.append((mean / usable, sigma / usable))
    return out
