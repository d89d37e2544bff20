"""Small polars helpers of the sources that avoid a query where numpy can do the work (each polars
query costs ~0.1 ms: at one window per sample they were most of a window's cost), and the workload
process's own memory per sample (its entry in NVML's process list)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import polars as pl


def stack(old: pl.DataFrame, part: pl.DataFrame) -> pl.DataFrame:
    """old + part: the same schema (the usual case) appended as a chunk without a polars query."""
    try:
        return old.vstack(part)
    except (pl.exceptions.SchemaError, pl.exceptions.ShapeError, pl.exceptions.InvalidOperationError):
        return pl.concat([old, part], how="vertical_relaxed")


def split_by_gpu(df: pl.DataFrame) -> dict[tuple, pl.DataFrame]:
    """Rows per GPU; one GPU's rows (the usual live round) without a polars query."""
    g = df["gpu"]
    if df.height and not g.null_count():
        a = g.to_numpy()
        if a.min() == a.max():
            return {(int(a[0]),): df}
    return df.partition_by("gpu", as_dict=True, maintain_order=True)


def epoch_us(col: pl.Series) -> np.ndarray:
    """A Datetime(us) column as int64 microseconds since the epoch (numpy's view where it can)."""
    a = col.to_numpy()
    return a.view(np.int64) if a.dtype == np.dtype("datetime64[us]") else col.dt.epoch("us").to_numpy()


def own_used(procs: pl.Series, pid: int) -> tuple[np.ndarray, np.ndarray]:
    """Per sample, the `used_bytes` of the listed process entry with this PID (NaN where none), and
    whether the sample listed processes at all - in one polars query."""
    match = pl.element().filter(pl.element().struct.field("pid") == pid).struct.field("used_bytes")
    df = procs.to_frame("p").select(pl.col("p").list.eval(match).list.first().alias("own"),
                                    pl.col("p").is_not_null().alias("listed"))
    return np.asarray(df["own"].to_numpy(), dtype=np.float64), df["listed"].to_numpy()


def of_gpu(df: pl.DataFrame, gpu: int, keep_null: bool) -> pl.DataFrame:
    """The rows of one GPU (and GPU-less rows with keep_null): the frame itself where every row is
    (a one-GPU session, the usual case: no query), else a gather by numpy's mask."""
    if not df.height:
        return df
    a = df["gpu"].to_numpy()
    a = a.astype(np.float64) if a.dtype.kind != "f" else a
    mask = (a == gpu) | (np.isnan(a) if keep_null else False)
    if mask.all():
        return df
    return df[np.flatnonzero(mask)]


def used_against_cap(used: list, procs: list, pid: int | None, capped: bool) -> tuple[list, str]:
    """What a GPU's memory figures show per sample (the dashboard's panel, history and headroom line), and what
    they are: under a workload's cap, the workload process's own memory where NVML lists it ("own"), the whole
    GPU's where no other process is listed - it is alone there, or nothing is listed ("alone": issue 20's capped
    run read 39/140 GiB against the card), and None at a sample where only other processes are listed (before
    the workload shows up beside them: the whole GPU's read 334 % of its cap). Both meet `shown_limit`'s cap.
    Uncapped, or where every sample lists only others: the whole GPU's against the card ("gpu")."""
    if not capped:
        return list(used), "gpu"
    own = own_of_rows([{"gpu_procs": p} for p in procs], pid)[0] if pid is not None else [math.nan] * len(used)
    out: list = []
    kinds = set()
    for o, u, p in zip(own, used, procs):
        if o == o:
            out.append(float(o))
            kinds.add("own")
        elif not p or (pid is None and len(p) == 1):
            out.append(u)
            kinds.add("alone")
        else:
            out.append(None)
    if not kinds:
        return list(used), "gpu"
    return out, "own" if "own" in kinds else "alone"


def shown_limit(cap: float | None, card: float | None, own: float | None, reserved: float | None) -> float | None:
    """What the dashboard's memory figures meet: with a cap and the process's own memory `own` (`used_against_cap`'s
    "own" or "alone"), the cap plus its memory outside torch (`outside_torch`: the CUDA context beside what torch's cap limits - the limit the
    risk and the report measure against, so a process at its cap reads ~100 %, not 104-106 %); else the card
    (the whole GPU's memory against the whole GPU)."""
    if cap and own is not None and own == own:
        lim = cap + outside_torch(own, reserved)
        return min(lim, card) if card else lim
    return card or cap


def own_of_rows(rows: list[dict], pid: int) -> tuple[np.ndarray, np.ndarray]:
    """own_used over sample rows still as dicts (the live source's new rows): the same figures."""
    own = np.full(len(rows), np.nan)
    listed = np.zeros(len(rows), dtype=bool)
    for i, r in enumerate(rows):
        procs = r.get("gpu_procs")
        if procs is None:
            continue
        listed[i] = True
        v = next((p.get("used_bytes") for p in procs if p.get("pid") == pid), None)
        if v is not None:
            own[i] = float(v)
    return own, listed


# -- the workload process's own memory: THE rule ---------------------------------------------------------
# One place says whose memory a GPU's figures are and what they meet: the risk features (predict/features.py),
# the report's health row and summary (report/health.py, report/analysis.py) and the Prometheus exporter
# (export/prometheus.py) all call it. On a GPU shared with other processes the whole GPU's used memory is
# theirs too: four capped workloads side by side on one H200 each read 190-3500 % of their caps that way.

NONTORCH_MAX = 8 * 2**30  # a process's memory outside torch's allocator (CUDA context, NCCL, cuBLAS) above this is not believed


@dataclass(frozen=True)
class ProcessMemory:
    """The memory basis of a run of samples of one GPU: whose memory, against what."""

    used: np.ndarray  # bytes in use per sample: the process's own where known (NaN where a sample has none)
    own: bool  # whether `used` is the workload process's own memory (else the whole GPU's used + reserved)
    limit: float | None  # what `used` is measured against (cap + its memory outside torch, or what the card leaves it)
    alloc_limit: float | None  # what torch may allocate (the cap, else what the card leaves it)
    others: float  # other processes' memory, last sample (bytes)
    total: float | None  # the card's memory


def f64(col: pl.Series) -> np.ndarray:
    """A numeric column as float64 with NaN for nulls, without a polars expression."""
    return np.asarray(col.to_numpy(), dtype=np.float64)


def own_memory(s: pl.DataFrame, pid: int | None, torch_active: bool,
               pre: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray | None:
    """The process's own NVML memory per sample (`gpu_procs`' entry at `pid`), or None where it cannot
    be told. A listed process list without the PID is 0 (nothing allocated yet) - unless torch already
    holds memory, where NVML sees another PID namespace (a container) and the process cannot be found:
    None. Without a PID (sessions recorded before meta.json had one), the one process NVML lists, where
    it is alone. `pre`: own_used's figures for these rows where a source computed them once."""
    if pid is not None and pre is not None:  # a live window: the rows' own memory, kept as they came
        out, listed = pre
        if not np.isfinite(out).any() and torch_active:
            return None
        out = np.where(np.isnan(out) & listed, 0.0, out)
        return out if np.isfinite(out).any() else None
    if "gpu_procs" not in s.columns:
        return None
    procs = s["gpu_procs"]
    if pid is None:  # an older session (no pid in meta): a process alone on the GPU is the workload's
        if procs.list.len().max() != 1:
            return None
        own = procs.list.first().struct.field("used_bytes")
        out = f64(own)
        return np.where(np.isnan(out) & procs.is_not_null().to_numpy(), 0.0, out)
    out, listed = own_used(procs, pid)
    if not np.isfinite(out).any() and torch_active:
        return None
    out = np.where(np.isnan(out) & listed, 0.0, out)
    return out if np.isfinite(out).any() else None


def outside_torch(own: float, reserved: float | None) -> float:
    """The process's memory outside torch's allocator (CUDA context, NCCL, cuBLAS workspaces): its own
    memory - torch's reserved bytes, 0..NONTORCH_MAX (0 where torch's figure is not known)."""
    return min(NONTORCH_MAX, max(0.0, own - reserved)) if reserved is not None else 0.0


def process_memory(s: pl.DataFrame, pid: int | None, cap: float | None, reserved: float | None,
                   meta_total: float | None = None, pre: tuple[np.ndarray, np.ndarray] | None = None,
                   nontorch: float | None = None, cols=None) -> ProcessMemory:
    """Memory in use over samples `s` of one GPU (samples schema, time order, at least one row) and the
    limits it meets, as of the last sample. Where the workload's process is known (`pid`, NVML's
    per-process list) its own memory counts and other processes on the GPU lower its limit - right on
    a shared GPU, and the same as the whole GPU's figures when the process is alone; its memory outside
    torch (own - `reserved`, torch's reserved bytes at its last step) is added to a cap `cap` (torch's
    cap leaves that memory out). Otherwise the whole GPU's used + reserved (v1's "used" included the
    driver's reserve) against the cap, else the card. `nontorch`: the memory outside torch where the
    caller measured it otherwise (a whole session's, at its steps' ends) instead of at the last sample.
    `cols`: name -> the rows' column as f64 gives it, where the caller converted the columns already
    (window.WindowArrays.sample: a recording's columns converted once, not once per window)."""
    col = cols if cols is not None else (lambda name: f64(s[name]))
    whole = col("gpu_mem_used_bytes")
    drv = col("gpu_mem_reserved_bytes")
    drv = np.where(np.isnan(drv), 0.0, drv)  # not np.nan_to_num: ~65 us a call, per window
    tot = col("gpu_mem_total_bytes")
    tot = tot[np.isfinite(tot)]
    total = float(tot[-1]) if tot.size else (float(meta_total) if meta_total else None)
    own = own_memory(s, pid, bool(reserved), pre)
    if own is not None and np.isfinite(own[-1]):
        used = own
        others = max(0.0, float(whole[-1]) - float(own[-1])) if np.isfinite(whole[-1]) else 0.0
        nontorch = outside_torch(float(own[-1]), reserved) if nontorch is None else nontorch
        limit: float | None
        alloc: float | None
        if cap:
            limit, alloc = cap + nontorch, cap
        elif total:
            limit = total - others - float(drv[-1])
            alloc = limit - nontorch
        else:
            limit = alloc = None
        return ProcessMemory(used, True, limit, alloc, others, total)
    used = whole + drv
    if nontorch is None:
        nontorch = outside_torch(float(used[-1]), reserved) if np.isfinite(used[-1]) else 0.0
    alloc = cap if cap else (total - nontorch if total else None)
    return ProcessMemory(used, False, cap or total, alloc, 0.0, total)


def own_peak(s: pl.DataFrame, steps: pl.DataFrame, pid: int | None, cap: float | None,
             meta_total: float | None = None) -> tuple[float, ProcessMemory] | None:
    """A whole run of one GPU (a session, for the report): the highest memory in use and the basis as of
    that sample (process_memory over the samples up to the peak). The memory outside torch is measured
    where torch's figure is exact - at each step's end, the first sample after it - and its median
    taken: at the peak (a step growing, an OOM) the process holds more than the last step's reserved
    bytes, and that is torch's, not outside it. `s` and `steps`: this GPU's, in time order. None
    without a memory sample."""
    s = s.filter(pl.col("gpu_mem_used_bytes").is_not_null())
    if not s.height:
        return None
    st = steps.filter(pl.col("torch_reserved_bytes").is_not_null()) if steps.height else steps
    own = own_memory(s, pid, bool(st.height and st["torch_reserved_bytes"][-1]))
    nontorch = None
    if own is not None:
        i = int(np.nanargmax(own))
        if st.height:
            at = np.searchsorted(epoch_us(s["ts"]), epoch_us(st["ts"]), side="left")
            ok = at < s.height
            res = f64(st["torch_reserved_bytes"])[ok]
            o = own[at[ok]]
            fin = np.isfinite(o) & np.isfinite(res)
            if fin.any():
                nontorch = float(np.median([outside_torch(float(a), float(b)) for a, b in zip(o[fin], res[fin])]))
        nontorch = 0.0 if nontorch is None else nontorch
    else:
        used = f64(s["gpu_mem_used_bytes"]) + np.nan_to_num(f64(s["gpu_mem_reserved_bytes"]))
        i = int(np.nanargmax(used))
    basis = process_memory(s.head(i + 1), pid, cap, None, meta_total, nontorch=nontorch)
    if not np.isfinite(basis.used).any():
        return None
    return float(np.nanmax(basis.used)), basis


def own_of_row(row: dict, pid: int | None, torch_active: bool) -> float | None:
    """One sample row as a dict (the live bus's latest tick): the process's own memory by the same rule
    as own_memory (None where it cannot be told)."""
    if pid is None or row.get("gpu_procs") is None:
        return None
    own, listed = own_of_rows([row], pid)
    out = own_memory(pl.DataFrame(), pid, torch_active, (own, listed))
    return float(out[-1]) if out is not None else None
