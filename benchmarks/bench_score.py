"""How long `gpuwatch score` takes for an hour of recording: a real H200 session tiled end to end
(timestamps shifted, nothing else changed) into a one-hour session in a temporary folder, then scored
with the shipped model as `gpuwatch score` does (`score_source`), at stride 1 (every 100 ms sample)
and stride 5.

    python3 benchmarks/bench_score.py [--session recordings/h200-nearcap-2026-12-01/nc-v2lite-prefill-b48] [--minutes 60] [--jobs 1,2]
Prints one JSON object: windows, seconds and windows/s per stride and number of processes (`score --jobs`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpuwatch.predict.model import load_model  # noqa: E402
from gpuwatch.predict.scorer import score_source  # noqa: E402
from gpuwatch.recording.source import ReplaySource  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def tile(src: Path, dest: Path, minutes: float) -> Path:
    dest.mkdir(parents=True)
    shutil.copy(src / "meta.json", dest / "meta.json")
    tables = {t: pl.read_parquet(src / f"{t}.parquet") for t in ("samples", "steps", "events")}
    span_us = int((tables["samples"]["ts"].max() - tables["samples"]["ts"].min()).total_seconds() * 1e6) + 100_000
    copies = max(1, int(minutes * 60e6 // span_us))
    for t, df in tables.items():
        md = pl.read_parquet_metadata(src / f"{t}.parquet")
        parts = [df.with_columns(pl.col("ts") + pl.duration(microseconds=k * span_us)) for k in range(copies)]
        pl.concat(parts).write_parquet(dest / f"{t}.parquet", metadata=md or None)
    return dest


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--session", type=Path, default=ROOT / "recordings" / "h200-nearcap-2026-12-01" / "nc-v2lite-prefill-b48")
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--strides", default="5,1")
    ap.add_argument("--jobs", default="1", help="comma-separated process counts (score_source(jobs=))")
    a = ap.parse_args()
    model = load_model()
    out = {"session": str(a.session), "minutes": a.minutes, "runs": []}
    with tempfile.TemporaryDirectory() as d:
        hour = tile(a.session, Path(d) / "hour", a.minutes)
        t0 = time.perf_counter()
        src = ReplaySource(hour)
        out["open_s"] = round(time.perf_counter() - t0, 3)
        for stride, jobs in [(int(x), int(j)) for x in a.strides.split(",") for j in a.jobs.split(",")]:
            t0 = time.perf_counter()
            tl = score_source(src, model, stride=stride, jobs=jobs)
            dt = time.perf_counter() - t0
            out["runs"].append({"stride": stride, "jobs": jobs, "windows": tl.height, "seconds": round(dt, 2),
                                "windows_per_s": round(tl.height / dt, 1), "alarms": int(tl["alarm"].sum())})
            print(json.dumps(out["runs"][-1]), file=sys.stderr, flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
