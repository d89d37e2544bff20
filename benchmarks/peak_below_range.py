"""How well the planner's estimate does below the smallest shape it has seen - on every recorded session.

For each session (and GPU), mode, precision, sequence length and checkpointing setting, and each pair of
batch sizes that ran whole (one micro-batch) at that length: fit the estimator (`peak.fit_steps`, as the
planner does: `held=True`) on the larger batch's steps alone, ask it for the smaller batch, and compare
with the smaller batch's measured peak (median over its steps). Printed per mode: pairs, how often the
measured peak came out above the estimate by more than 1.645 and 3 of its spread (a one-sided 5 % and
0.1 % for a normal), the largest shortfall, and how much the estimate saves against the old rule's
("a smaller step needs no more": the risk's features, `held=False`), as a median share of the limit-free
peak. The pairs are not independent (pairs of batch sizes within ~130 partly replicated sessions) and each
window is one shape; accumulating steps and real rolling windows are not covered here (the review of the change
checked those separately: docs/BENCHMARKS.md, session 40).

    python benchmarks/peak_below_range.py [DIR ...]     (default: recordings/)
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import sys

import numpy as np
import polars as pl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gpuwatch.predict.peak import fit_steps  # noqa: E402

BIG = 1e15  # a limit no step comes near: the forecast's mean and spread do not depend on it


def _col(g: pl.DataFrame, name: str, default: float = np.nan) -> np.ndarray:
    return (np.asarray(g[name].to_numpy(), dtype=np.float64) if name in g.columns
            else np.full(g.height, default))


def pairs(path: str):
    s = pl.read_parquet(path)
    if "torch_peak_bytes" not in s.columns or not s.height:
        return
    for _, g in (s.group_by("gpu") if "gpu" in s.columns else [(0, s)]):
        g = g.sort("ts")
        al, pk = _col(g, "torch_allocated_bytes"), _col(g, "torch_peak_bytes")
        base = np.concatenate((al[:1], al[:-1]))
        mb = _col(g, "micro_batches", 1.0)
        ck = g["checkpointing"].fill_null(False).to_list() if "checkpointing" in g.columns else [False] * g.height
        groups = collections.defaultdict(list)
        for i, (m, pr, b, sl) in enumerate(zip(g["mode"], g["precision"], g["batch"], g["seq_len"])):
            if b is None or sl is None or (np.isfinite(mb[i]) and mb[i] != 1) or not np.isfinite(pk[i] - base[i]):
                continue
            groups[(m, pr, sl, ck[i])].append(i)
        for (mode, pr, sl, _), idx in groups.items():
            by_b = collections.defaultdict(list)
            for i in idx:
                by_b[int(g["batch"][i])].append(i)
            bs = sorted(by_b)
            for k, small in enumerate(bs):
                for large in bs[k + 1:]:
                    j = np.array(by_b[large])
                    # the large batch's steps alone as the window; their peaks shifted so that each step's
                    # activations (peak less the allocated before it, as fit_steps reads them) are its own
                    a = al[j]
                    p = pk[j] - base[j] + np.concatenate((a[:1], a[:-1]))
                    args = (np.full(j.size, float(large)), np.full(j.size, float(sl)), np.ones(j.size), [pr] * j.size,
                            a, p, np.full(j.size, np.nan), pr)
                    fit, old = fit_steps(*args, held=True), fit_steps(*args)
                    if fit is None or old is None:
                        continue
                    new_fc, old_fc = fit.at(small, sl, BIG), old.at(small, sl, BIG)
                    si = np.array(by_b[small])
                    measured = float(np.median(pk[si] - base[si])) + fit.alloc_now
                    g_ = max(0.0, fit.growth)  # the forecast carries growth; the measured step's own peak does not
                    yield mode, measured, new_fc.mean - g_, new_fc.sigma, old_fc.mean - g_


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="*", default=["recordings"])
    a = ap.parse_args(argv)
    files = sorted({os.path.realpath(f) for d in a.dirs for f in glob.glob(os.path.join(d, "**", "steps.parquet"),
                                                                             recursive=True)})
    rows = [r for f in files for r in pairs(f)]
    if not rows:
        print("no pairs of shapes found", file=sys.stderr)
        return 1
    df = pl.DataFrame(rows, schema=["mode", "measured", "mean", "sigma", "old"], orient="row").with_columns(
        z=(pl.col("measured") - pl.col("mean")) / pl.col("sigma"),
        short_gb=(pl.col("measured") - pl.col("mean")) / 1e9,
        saved=(pl.col("old") - pl.col("mean")) / pl.col("old"))
    print(f"{len(files)} sessions, {df.height} pairs (a smaller whole batch estimated from a larger one alone)")
    out = df.group_by("mode").agg(
        pl.len().alias("pairs"), (pl.col("z") > 1.645).sum().alias("over_1.645_sigma"),
        (pl.col("z") > 3).sum().alias("over_3_sigma"), pl.col("short_gb").max().round(3).alias("max_short_gb"),
        pl.col("saved").median().round(3).alias("median_saved"), pl.col("saved").max().round(3).alias("max_saved"),
    ).sort("mode")
    with pl.Config(tbl_rows=10, tbl_width_chars=160, tbl_hide_dataframe_shape=True):
        print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
