"""What the first step will need, before any step has run: an a-priori estimate from earlier runs of the
same model (the shape library), for the one moment the online estimator (predict/peak.py) is blind.

Why: the online estimator fits the steps that ran in the window; before a session's first step there are
none. 9 of the 381 OOMs in the shipped H200 recordings are a session's very first step under a fresh cap,
and none was warned (models/risk.md; docs/BENCHMARKS.md, set 5). The same model at the same shape needs the
same memory on the next run, so the runs a fleet already recorded say it.

The library: per model (preset and parameter count), mode and precision, each shape's median activation
(peak - allocated when the step began, exactly as peak.py measures it) over every recorded step of the
training sessions, and the median allocated after a step (the weights, for inference; for decode, the
parameters' bytes, its KV cache and graph pool counted with the shape that keeps them: `_decode_kept`). It lives in the
model's manifest (plain JSON, written by `gpuwatch train`; no pickle). Inference modes only (prefill,
decode): a training run's first step allocates the gradients as well (and an optimizer's states, where
it keeps any), which the recordings do not separate from its activations - not estimated, said so.

The first step's need: weights + FIRST_STEP_OVERHEAD x the activations at the planned shape (looked up,
interpolated or extrapolated in tokens as peak.py does; below the smallest shape a decode's in proportion to its
tokens, a prefill's no less than the smallest's), against the usable limit (peak.usable_limit). The
overhead: a first step under a cap cuts a fresh segment for every activation, so it needs more room than
its steady peak - measured on the training sessions, leave-one-session-out (`gpuwatch eval
--first-step`): every first step that failed had room above the weights of at most 1.13 x
its activations, every one that ran at least 1.38 x; FIRST_STEP_OVERHEAD is the middle, 1.25. The spread:
the library's residual and extrapolation spread (as peak.py) and FIRST_STEP_REL of the activations (the
overhead's own uncertainty). P(need > usable limit) is the `peak_cross_p` of a window with no step
(features.py), so the shipped risk's estimator part alarms on it and the guard can size the first step.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from gpuwatch.recording.recorded import workload_gpu

from gpuwatch.predict.peak import (FAILED_P, FLOOR_BYTES, FLOOR_REL, INFERENCE, PRECISION_BYTES, Failed, Forecast,
                                   activation_at, fails_as_before, ncdf_upper, shape_key, shapes, usable_limit)

FIRST_STEP_OVERHEAD = 1.25
FIRST_STEP_REL = 0.10


def identity(workload: dict[str, Any] | None) -> str | None:
    """A model's name in the library: its preset and parameter count (a workload's `describe()`, or its
    entry in a session's meta.json); None for a workload that is not a known model (a user's loop)."""
    if not isinstance(workload, dict) or not workload.get("preset") or not isinstance(workload.get("params"), int):
        return None
    ov = workload.get("overrides") or {}
    return f"{workload['preset']}:{workload['params']}" + (":" + json.dumps(ov, sort_keys=True) if ov else "")


def library_key(model: str, mode: str, precision: str) -> str:
    return f"{model}|{mode}|{precision}"


@dataclass(frozen=True)
class Shapes:
    """One model/mode/precision: its shapes (peak.shapes' arrays) and what stays allocated after a step."""

    uk: np.ndarray
    med: np.ndarray
    ut: np.ndarray
    resid: float
    weights: float
    steps: int
    sessions: int
    kept: np.ndarray | None = None  # per shape (uk's order): what its steps keep allocated above the weights (a
    # decode's KV cache and graph pool, `_decode_kept`); None: nothing (a prefill, a library written before)


class ShapeLibrary:
    def __init__(self, entries: dict[str, Shapes]) -> None:
        self.entries = entries

    def __len__(self) -> int:
        return len(self.entries)

    def first_step(self, model: str | None, mode: str | None, precision: str | None, batch: float | None,
                   seq: float | None, alloc_limit: float | None, failed: list[Failed] | None = None) -> Forecast | None:
        """The forecast of a session's first step at (batch, seq), or None where the library cannot say
        (an unknown model, a training run, no plan, no limit). `failed`: shapes that ran out of memory in
        the session already - a first step no smaller than one of them fails again (peak.fails_as_before,
        the online estimate's censored observation; what will be allocated is taken as no less than then)."""
        if not (model and mode in INFERENCE and batch and seq and alloc_limit and alloc_limit > 0):
            return None
        e = self.entries.get(library_key(model, mode, str(precision or "bf16")))
        if e is None:
            return None
        tp, sp = float(batch) * float(seq), float(seq)
        # below the smallest shape: a decode's need (its prompt's prefill, the cache it keeps) in proportion to its
        # tokens; a prefill's has a fixed part (0.5 GB from 512 to 4,096 tokens, small preset): no less than its smallest
        a_hat, resid, extrap = activation_at(e.uk, e.med, e.ut, e.resid, tp, sp, 0.0 if mode == "decode" else None,
                                             longer=False)
        a_hat = max(a_hat, 0.0)
        # what the step keeps (a decode's cache and pool) is made once, at its size: not under the overhead, which
        # was measured on activations (a fresh segment cut for each)
        mean = e.weights + _kept_at(e, tp, sp) + FIRST_STEP_OVERHEAD * a_hat
        sigma = math.sqrt(max(resid, FLOOR_REL * a_hat + FLOOR_BYTES) ** 2 + extrap ** 2 + (FIRST_STEP_REL * a_hat) ** 2)
        limit = usable_limit(float(alloc_limit))
        p = ncdf_upper((limit - mean) / sigma)
        hit = fails_as_before(failed, tp, sp, PRECISION_BYTES.get(str(precision), 2.0), math.inf, limit)
        if hit:
            mean, p = max(mean, limit), max(p, FAILED_P)
        # the base is what stays whatever the batch (the guard sizes a cut on the rest, all of it in proportion)
        return Forecast(mean, sigma, limit, p, p, 0.0, 0, hit, base=e.weights)

    def kept_at(self, model: str | None, mode: str | None, precision: str | None, batch: float, seq: float) -> float:
        """What a first step at (batch, seq) keeps above the weights (a decode's cache and pool; 0 elsewhere)."""
        e = self.entries.get(library_key(model or "", mode or "", str(precision or "bf16")))
        return _kept_at(e, float(batch) * float(seq), float(seq)) if e is not None else 0.0

    # -- the manifest's form ----------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {"overhead": FIRST_STEP_OVERHEAD, "rel": FIRST_STEP_REL, "entries": {
            k: {"keys": e.uk.tolist(), "act": e.med.tolist(), "tokens": e.ut.tolist(), "resid": e.resid,
                "weights": e.weights, "steps": e.steps, "sessions": e.sessions,
                **({"kept": e.kept.tolist()} if e.kept is not None else {})} for k, e in sorted(self.entries.items())}}

    @classmethod
    def from_json(cls, d: Any) -> "ShapeLibrary | None":
        """None for a manifest without a library (older models) or a malformed one."""
        try:
            out = {}
            for k, e in (d or {}).get("entries", {}).items():
                uk, med, ut = (np.asarray(e[n], dtype=np.float64) for n in ("keys", "act", "tokens"))
                resid, weights = float(e["resid"]), float(e["weights"])
                ok = (uk.ndim == med.ndim == ut.ndim == 1 and uk.size and uk.size == med.size == ut.size
                      and np.isfinite(uk).all() and np.isfinite(med).all() and np.isfinite(ut).all()
                      and (ut > 0).all() and (np.diff(ut) >= 0).all() and (med >= 0).all()
                      and math.isfinite(resid) and resid >= 0 and math.isfinite(weights) and weights >= 0)
                kept = np.asarray(e["kept"], dtype=np.float64) if "kept" in e else None
                ok = ok and (kept is None or (kept.shape == uk.shape and np.isfinite(kept).all() and (kept >= 0).all()))
                if not ok:  # an entry that would give nonsense (or raise) at scoring time is not taken
                    continue
                out[str(k)] = Shapes(uk, med, ut, resid, weights, int(e["steps"]), int(e["sessions"]), kept)
            return cls(out) if out else None
        except (AttributeError, KeyError, TypeError, ValueError):
            return None


def _kept_at(e: Shapes, tp: float, sp: float) -> float:
    """An entry's kept bytes at tp tokens of length sp: its shapes' medians looked up or interpolated, in
    proportion to tokens below the smallest (`peak.activation_at`); 0 where it keeps nothing apart."""
    if e.kept is None:
        return 0.0
    return max(0.0, activation_at(e.uk, e.kept, e.ut, 0.0, tp, sp, 0.0, longer=False)[0])


def session_steps(path: Path) -> list[tuple[str, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """(library key, tokens per micro-batch, sequence lengths, activations, allocated, kept) of each GPU's steps
    of one recorded session whose workload is a known model in an inference mode (kept: what a decode's step keeps
    above its weights, `_decode_kept`; zeros for a prefill)."""
    import polars as pl

    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    st = pl.read_parquet(path / "steps.parquet")
    out = []
    for w in (meta.get("config") or {}).get("workloads") or []:
        model = identity(w)
        if model is None or w.get("mode") not in INFERENCE or not st.height:
            continue
        g = workload_gpu(w)
        s = st.filter(pl.col("gpu") == g) if g is not None else st
        for prec in s["precision"].unique().to_list():
            p = s.filter(pl.col("precision") == prec)
            if not p.height:
                continue
            b, q = (p[c].cast(pl.Float64).to_numpy() for c in ("batch", "seq_len"))
            mb = (p["micro_batches"].cast(pl.Float64).fill_null(1.0).to_numpy() if "micro_batches" in p.columns
                  else np.ones(p.height))
            al, pk = (p[c].cast(pl.Float64).to_numpy() for c in ("torch_allocated_bytes", "torch_peak_bytes"))
            base = np.concatenate((al[:1], al[:-1]))  # as peak.fit_steps: the step before's allocated
            act = pk - base
            T = np.ceil(b / np.maximum(mb, 1.0)) * q
            kept = np.zeros_like(al)
            if w["mode"] == "decode":
                kept, al = _decode_kept(al, T, q, float(w["params"]) * PRECISION_BYTES.get(str(prec), 2.0))
            ok = np.isfinite(act) & np.isfinite(T) & (T > 0) & np.isfinite(al)
            if ok.any():
                out.append((library_key(model, w["mode"], str(prec)), T[ok], q[ok], np.maximum(act[ok], 0.0), al[ok],
                            kept[ok]))
    return out


def _decode_kept(al: np.ndarray, T: np.ndarray, S: np.ndarray, weights: float) -> tuple[np.ndarray, np.ndarray]:
    """A decode's steps for the library: (what each step's shape keeps above the weights, the weights). Before its
    first step a decode holds its weights alone - its parameters in the step's precision - and the step makes the KV
    cache and graph pool it keeps, which grow with its batch: part of what a first step at its shape needs, not of a
    base every shape shares (the library's v2-lite decode "weights" were 29.995 GiB, its parameters 29.25: the
    cache at 32 x 512, taken whole for a 23 x 128 first step - two near-limit false alarms on set 2910, one on
    2906, one on 2911).
    What a shape keeps is the least allocated after any of its steps, less the weights: a leak or a cache that
    grows later is not read as the shape's. Where what stayed allocated is below the parameters' bytes (a model
    not all on this GPU) the steps stay as they were."""
    if not (weights > 0) or not np.isfinite(al).any() or float(np.nanmin(al)) < weights:
        return np.zeros_like(al), al
    keys = shape_key(T, S)
    kept = np.zeros_like(al)
    for k in np.unique(keys[np.isfinite(keys)]):
        m = keys == k
        kept[m] = max(0.0, float(np.nanmin(al[m])) - weights)
    return kept, np.where(np.isfinite(al), weights, np.nan)  # a step with no figure stays out


def read_parts(paths: Iterable[Path]) -> dict[Path, list]:
    """Each readable session's `session_steps`, read once (a leave-one-out builds a library per session
    from them); unreadable sessions are left out - training already said why."""
    out = {}
    for p in paths:
        try:
            out[Path(p)] = session_steps(Path(p))
        except Exception:  # noqa: BLE001 - a session training could not read is not in the library either
            continue
    return out


def build(paths: Iterable[Path]) -> ShapeLibrary:
    """The library of these sessions."""
    return from_parts(read_parts(paths).values())


def from_parts(sessions: Iterable[list]) -> ShapeLibrary:
    """The library pooled from sessions' `session_steps`."""
    pooled: dict[str, list] = {}
    for i, parts in enumerate(sessions):
        for key, T, S, act, al, kept in parts:
            e = pooled.setdefault(key, [[], [], [], [], [], set()])
            e[0].append(T), e[1].append(S), e[2].append(act), e[3].append(al), e[4].append(kept), e[5].add(i)
    entries = {}
    for key, (T, S, act, al, kept, sess) in pooled.items():
        T, S, act, al, kept = (np.concatenate(x) for x in (T, S, act, al, kept))
        uk, med, ut, resid = shapes(T, S, act)
        k = shapes(T, S, kept)[1] if kept.any() else None  # each shape's median kept, in uk's order
        entries[key] = Shapes(uk, med, ut, float(resid), float(np.median(al)), int(T.size), len(sess), k)
    return ShapeLibrary(entries)
