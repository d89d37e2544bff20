"""How far the planner's estimator (predict/plans.estimate) is from the peaks that then ran: for every recorded
step after a session's first, the estimate made from the window that ends just after the previous step, for the
configuration and length that ran, against the step's own peak (torch's, over the usable limit). Steps are "new"
where that (micro-batch, length, checkpointing, precision, accumulating) had not run before in the session, else
"seen". Why: a margin that adapts to how well the estimate has predicted this run (issue 28) needs to know how
the errors are spread - a spread narrower than the estimate's sigma would let the margin shrink.

    python3 benchmarks/estimate_errors.py [SESSION_OR_FOLDER ...]   (default: every session under recordings/)
Prints a JSON line per group (its underestimates, and since session 47 its overestimates: err_min and the steps whose
upper 1.645 sigma crossed the usable limit while they ran under 0.9 of it; new, seen, and - session 46 - longer: a length beyond any that had run in the session,
where the estimate extrapolates in length; all modes, then each mode) and one per underestimate beyond 1.645 sigma.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpuwatch.contract import Config  # noqa: E402
from gpuwatch.predict.features import limits  # noqa: E402
from gpuwatch.predict.peak import usable_of  # noqa: E402
from gpuwatch.predict.plans import estimate  # noqa: E402
from gpuwatch.recording.frames import epoch_us  # noqa: E402
from gpuwatch.recording.source import ReplaySource  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def sessions(args: list[str]) -> list[Path]:
    roots = [Path(a) for a in args] or [ROOT / "recordings"]
    out = []
    for r in roots:
        out += [p.parent for p in sorted(r.rglob("steps.parquet"))] if not (r / "steps.parquet").exists() else [r]
    return out


def errors(path: Path) -> list[dict]:
    st = pl.read_parquet(path / "steps.parquet")
    if "torch_peak_bytes" not in st.columns or st.height < 3:
        return []
    src = ReplaySource(path)
    ts = epoch_us(st["ts"])
    rows = []
    col = lambda name, i, default=None: st[name][i] if name in st.columns else default  # noqa: E731
    for g in src.gpus:
        idx = [i for i in range(st.height) if st["gpu"][i] == g.index]
        seen: set = set()
        longest = 0  # the longest length run so far: a step beyond it extrapolates in length
        for prev, i in zip(idx, idx[1:]):
            pk, b, s = st["torch_peak_bytes"][i], st["batch"][i], st["seq_len"][i]
            if pk is None or not b or not s:
                continue
            k = int(col("micro_batches", i) or 1)
            ck, prec = bool(col("checkpointing", i) or False), st["precision"][i]
            micro = math.ceil(int(b) / k)
            key = (micro, int(s), ck, prec, k > 1)
            w = src.window_at(g.index, int(ts[prev]) + 1000)
            lim = limits(w).alloc_limit
            e = estimate(w, [(Config(micro, ck, prec, k), int(s))])[0] if lim else None
            if e is not None:
                peaks = w.steps["torch_peak_bytes"].cast(pl.Float64).fill_null(float("nan")).to_numpy()
                real = float(pk) / usable_of(lim, peaks)  # what `estimate` divides by
                rows.append({"session": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path),
                             "step": int(st["step"][i]), "mode": col("mode", i, "?"), "new": key not in seen,
                             "longer": longest > 0 and int(s) > longest,
                             "length_ratio": int(s) / longest if longest else None, "mean": e[0], "sigma": e[1],
                             "real": real, "err": real - e[0], "z": (real - e[0]) / max(e[1], 1e-6)})
            seen.add(key)
            if s:
                longest = max(longest, int(s))
    return rows


def main() -> int:
    rows = [r for p in sessions(sys.argv[1:]) for r in errors(p)]
    if not rows:
        print("no steps with torch figures", file=sys.stderr)
        return 1
    groups = [(m, new) for m in ("all", *sorted({r["mode"] for r in rows})) for new in (True, False, "longer")]
    for mode, new in groups:
        g = [r for r in rows if (r["longer"] if new == "longer" else r["new"] is new) and mode in ("all", r["mode"])]
        if not g:
            continue
        err, z, sig = (np.array([r[k] for r in g]) for k in ("err", "z", "sigma"))
        q = lambda a, p: round(float(np.quantile(a, p)), 4)  # noqa: E731
        name = "longer than any run before" if new == "longer" else "new" if new else "seen"
        print(json.dumps({"mode": mode, "group": name, "steps": len(g),
                          "sessions": len({r["session"] for r in g}),
                          "sigma_median": q(sig, 0.5), "err_q50_q95_q99_max": [q(err, .5), q(err, .95), q(err, .99), round(float(err.max()), 4)],
                          "z_q95_q99": [q(z, .95), q(z, .99)], "p_z_over_1.645": round(float((z > 1.645).mean()), 4),
                          "p_err_over_0.02": round(float((err > 0.02).mean()), 4),
                          # the other side (review of 9c8a55e): how far over, and how often the estimate's upper
                          # 1.645 sigma crossed the usable limit on a step that ran under 0.9 of it
                          "err_min": round(float(err.min()), 4),
                          "n_alarm_under_0.9": int(sum(r["mean"] + 1.645 * r["sigma"] > 1.0 and r["real"] < 0.9
                                                       for r in g))}))
    longer = [r for r in rows if r["longer"]]
    for lo, hi in ((1.0, 1.05), (1.05, 1.15), (1.15, 1.5), (1.5, 1e9)):  # how far beyond: the size of the length jump
        g = [r for r in longer if lo < r["length_ratio"] <= hi]
        if g:
            z = np.array([r["z"] for r in g])
            err = np.array([r["err"] for r in g])
            print(json.dumps({"group": "longer", "length_ratio": [lo, hi if hi < 1e9 else None], "steps": len(g),
                              "p_z_over_1.645": round(float((z > 1.645).mean()), 4),
                              "err_max": round(float(err.max()), 4), "err_median": round(float(np.median(err)), 4)}))
    for r in rows:
        if r["z"] > 1.645:
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
