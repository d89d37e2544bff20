"""What each recorded OOM was made of: the allocator's own figures in CUDA's message and the steps before it.

    python3 benchmarks/block_failures.py SET_OR_SESSION [...] [--steps N]

For every session (a folder with meta.json, or a folder of them) and every `oom` event: when it came (seconds on the
session's samples' clock), what CUDA says it tried to allocate, what the cap allowed, and what was reserved but
unallocated (a fragmentation failure: room in the cache in total, no block that fits - shown only where the
recorded message kept it: sessions before 2026-12-07 cut it at 300 characters); then the last N steps' allocator
figures: allocated, peak, reserved, the inactive split blocks (schema v6), the largest free block and the largest
segment (v7; null between the 0.5 s reads), and the reserve's last rise above 64 MiB in the whole steps table (the
block a new segment was mapped for). GiB throughout. Reads recordings only (docs/BENCHMARKS.md, issue 29).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import polars as pl

from gpuwatch.recording.source import ReplaySource

GiB = 2**30
UNIT = {"MiB": 2**20, "GiB": GiB, "KiB": 2**10}
COLS = (("alloc", "torch_allocated_bytes"), ("peak", "torch_peak_bytes"), ("res", "torch_reserved_bytes"),
        ("split", "torch_inactive_split_bytes"), ("free", "torch_largest_free_bytes"), ("seg", "torch_largest_segment_bytes"))


def _gib(text: str, pattern: str) -> float | None:
    m = re.search(pattern, text)
    return float(m.group(1)) * UNIT[m.group(2)] / GiB if m else None


def figures(error: str) -> dict[str, float | None]:
    """CUDA's OOM message's figures (GiB): tried, allowed, reserved but unallocated."""
    return {"tried": _gib(error, r"Tried to allocate ([\d.]+) ([KMG]iB)"),
            "allowed": _gib(error, r"([\d.]+) ([KMG]iB) allowed"),
            "unallocated": _gib(error, r"and ([\d.]+) ([KMG]iB) is reserved by PyTorch but unallocated")}


def sessions(paths: list[str]) -> list[Path]:
    out = []
    for p in map(Path, paths):
        out += [p] if (p / "meta.json").exists() else sorted(d for d in p.iterdir() if (d / "meta.json").exists())
    return out


def _f(v) -> str:
    return "   -  " if v is None else f"{v / GiB:6.3f}"


def report(path: Path, n_steps: int) -> list[str]:
    src = ReplaySource(path)
    st, ev = src.steps_df, src.events_df
    g = src.gpus[0].index if src.gpus else None
    ts = src.times(g) if g is not None else None
    if st.is_empty() or ts is None or not ts.size:
        return [f"== {path.name}: no steps or no samples"]
    t0 = int(ts[0])
    sec = lambda t: (t.timestamp() * 1e6 - t0) / 1e6  # noqa: E731
    res = st["torch_reserved_bytes"].cast(pl.Float64)
    rise = res.diff()
    out = [f"== {path.name}: {st.height} steps, {int(st['torch_largest_free_bytes'].is_not_null().sum())} with v7 block figures"]
    for r in ev.filter(pl.col("kind") == "oom").iter_rows(named=True):
        fig = figures(json.loads(r["detail"] or "{}").get("error") or "")
        before = st.filter(pl.col("ts") < r["ts"])
        ups = rise.head(before.height).to_numpy()
        up = [i for i, d in enumerate(ups) if d == d and d > 64 * 2**20]
        jump = f"{ups[up[-1]] / GiB:.3f} at {sec(st['ts'][up[-1]]):.1f} s" if up else "none"
        g3 = {k: "?" if v is None else f"{v:.3f}" for k, v in fig.items()}
        out.append(f"  OOM at {sec(r['ts']):.1f} s: tried {g3['tried']}, allowed {g3['allowed']}, reserved unallocated "
                   f"{g3['unallocated']}; the reserve's last rise {jump}")
        for b in before.tail(n_steps).iter_rows(named=True):
            out.append(f"    step {sec(b['ts']):7.1f} s  {b['batch']} x {b['seq_len']}  "
                       + "  ".join(f"{k} {_f(b.get(c))}" for k, c in COLS))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--steps", type=int, default=3, help="steps shown before each OOM (3)")
    a = ap.parse_args()
    for p in sessions(a.paths):
        print("\n".join(report(p, a.steps)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
