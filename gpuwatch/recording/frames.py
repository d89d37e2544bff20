"""Small polars helpers of the sources that avoid a query where numpy can do the work (each polars
query costs ~0.1 ms: at one window per sample they were most of a window's cost), and the workload
process's own memory per sample (its entry in NVML's process list)."""

from __future__ import annotations

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
