"""A timeline's windows on disk: one Parquet file per GPU of a session (`gpuwatch train --features DIR`),
written by the process that cut them, so the features of a fleet's recordings need not be held to be
kept. Columns: ts (us), y (1 positive, 0 negative, -1 dropped), w (the fit's weight: predict/sampling.py;
0 = not in the fit), then the features in NAMES order (float64, NaN where missing); the file's metadata
says the session, its source, scenario, GPU and whether it is a counterfactual copy. Read with polars or
DuckDB, or `read` for the arrays."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl

from gpuwatch.predict.features import NAMES

__all__ = ["read", "write"]


def write(t, folder: Path) -> Path:
    """Write timeline `t` (predict/dataset.Timeline) as `folder/<session>-gpu<g>.parquet`; its path."""
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{t.session}-gpu{'all' if t.gpu is None else t.gpu}.parquet"
    cols = {"ts": t.ts_us.astype(np.int64), "y": t.y.astype(np.int8),
            "w": np.ones(t.y.size) if t.w is None else t.w.astype(np.float64)}
    cols.update({n: t.X[:, i] for i, n in enumerate(NAMES)})
    meta = {"session": t.session, "source": t.source, "scenario": t.scenario, "gpu": t.gpu, "derived": t.derived}
    pl.DataFrame(cols).write_parquet(out, metadata={"gpuwatch.timeline": json.dumps(meta)})
    return out


def read(path: Path) -> tuple[dict, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(what the file says of its timeline, ts, y, w, X) of a file `write` wrote."""
    meta = json.loads(pl.read_parquet_metadata(path)["gpuwatch.timeline"])
    df = pl.read_parquet(path)
    return (meta, df["ts"].to_numpy(), df["y"].to_numpy(), df["w"].to_numpy(),
            df.select(list(NAMES)).to_numpy().astype(np.float64))
