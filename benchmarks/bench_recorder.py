"""The recorder's once-a-second write: CPU per flush of the old path (a DataFrame from the row dicts and
one new Parquet segment per table, rolled into chunks every 300) against the new one (the same frames
appended as one record batch to each table's open Arrow IPC stream file, rolled into Parquet chunks every
300 flushes), issue #10.

    python benchmarks/bench_recorder.py [--flushes 900] [--json recorder.json]

Each flush carries what `gpuwatch record` / `stress` hand the recorder in one second at 10 Hz on one GPU:
10 sample rows (real rows of recordings/sample-h200-ramp-train where present), `--steps` step rows,
`--risk` risk rows and an event every `--event-every` flushes. CPU is `time.process_time()` (every
thread of this process, polars' pool included) around the write alone; the figures are microseconds per
flush (median and mean over all flushes, rolls included in the mean) and the mean as % of one core at one
flush a second. The new path is also timed end to end through `Recorder.flush()` (drain of the bus,
conversion, append, rolls). Writes go to a temp folder on the same disk as --dir (default: the system's).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import polars as pl  # noqa: E402

from gpuwatch.recording import ipc, schema, writer  # noqa: E402
from gpuwatch.recording.ipc import StreamFile  # noqa: E402
from gpuwatch.recording.writer import Recorder, append_stream, to_frame, write_atomic  # noqa: E402
from gpuwatch.telemetry.bus import Bus, Tick  # noqa: E402

RAMP = ROOT / "recordings" / "sample-h200-ramp-train"


def sample_rows(n: int) -> list[dict]:
    """n real sample rows (ts as int us), or synthetic ones shaped like them if the recording is absent."""
    try:
        from gpuwatch.recording.reader import open_recording

        df = open_recording(RAMP).samples
        df = df.filter(pl.col("host_cpu_per_core_pct").list.len() > 0).head(n) if df.height >= n else df
        rows = df.with_columns(pl.col("ts").dt.epoch("us")).to_dicts()
        if len(rows) >= n:
            return rows[:n]
    except Exception:  # noqa: BLE001 - no recording here: synthetic rows
        pass
    t0 = time.time_ns() // 1000
    return [{"ts": t0 + i * 100_000, "tick": i, "gpu": 0, "gpu_util_pct": 97, "gpu_mem_util_pct": 40,
             "gpu_mem_used_bytes": 80 << 30, "gpu_mem_reserved_bytes": 1 << 30, "gpu_mem_total_bytes": 141 << 30,
             "gpu_temp_c": 61, "gpu_temp_slowdown_c": 89, "gpu_power_w": 612.5, "gpu_power_limit_w": 700.0,
             "gpu_sm_clock_mhz": 1980, "gpu_mem_clock_mhz": 3201, "gpu_clocks_event_reasons": 0,
             "gpu_ecc_corrected": 0, "gpu_ecc_uncorrected": 0, "gpu_energy_mj": 123_000_000 + i,
             "gpu_pcie_tx_bytes_per_s": 694272, "gpu_pcie_rx_bytes_per_s": 614400,
             "gpu_procs": [{"pid": 1234, "used_bytes": 80 << 30}], "host_cpu_pct": 12.5,
             "host_cpu_per_core_pct": [10] * 16, "host_load1": 1.1, "host_mem_used_bytes": 17 << 30,
             "host_mem_total_bytes": 128 << 30, "host_swap_used_bytes": 0, "proc_rss_bytes": 800 << 20,
             "proc_cpu_pct": 1.0, "sampler_interval_us": 100_000, "sampler_cost_us": 300, "sampler_cpu_us": 250}
            for i in range(n)]


def step_row(i: int, ts: int) -> dict:
    return {"ts": ts, "step": i, "gpu": 0, "mode": "train", "phase": "ramp", "precision": "bf16", "batch": 8,
            "seq_len": 2048, "step_time_s": 0.41, "tokens_per_s": 39_960.0, "tflops": 310.0, "mfu": 0.31,
            "loss": 6.5, "max_abs_logit": 20.0, "torch_allocated_bytes": 60 << 30, "torch_reserved_bytes": 70 << 30,
            "torch_peak_bytes": 72 << 30, "expert_impl": "grouped", "micro_batches": 1, "next_batch": 8,
            "next_seq_len": 2048, "next_precision": "bf16"}


def risk_row(ts: int) -> dict:
    return {"ts": ts, "gpu": 0, "kind": "oom", "risk": 0.02, "alarm": False, "threshold": 0.5,
            "model": "oom-v3", "reasons": "headroom 41 GiB"}


class Load:
    """The rows of each flush, the same for both paths."""

    def __init__(self, samples: int, steps: int, risk: int, event_every: int) -> None:
        self.base = sample_rows(samples)
        self.steps, self.risk, self.event_every = steps, risk, event_every

    def flush(self, i: int) -> dict[str, list[dict]]:
        t0 = time.time_ns() // 1000
        rows = [{**r, "ts": t0 + k * 100_000, "tick": i * len(self.base) + k} for k, r in enumerate(self.base)]
        out = {"samples": rows, "steps": [step_row(i * self.steps + k, t0 + k) for k in range(self.steps)],
               "risk": [risk_row(t0) for _ in range(self.risk)], "events": []}
        if self.event_every and i % self.event_every == 0:
            out["events"] = [{"ts": t0, "kind": "mark", "severity": "info", "gpu": 0, "message": f"mark {i}",
                              "detail": json.dumps({"n": i})}]
        return out


def old_path(load: Load, n: int, folder: Path, roll_every: int) -> list[float]:
    """Before the streams: to_frame, then one Parquet segment per table (zstd 1, no fsync), and every
    `roll_every` segments a chunk (read back, zstd 3, fsynced) - what writer.py did per flush."""
    seg = {t: 0 for t in schema.TABLES}
    unrolled: dict[str, list[Path]] = {t: [] for t in schema.TABLES}
    cost = []
    for i in range(n):
        rows = load.flush(i)
        c0 = time.process_time()
        for table, rs in rows.items():
            if not rs:
                continue
            df = to_frame(rs, table)
            seg[table] += 1
            path = folder / f"{table}-{seg[table]:06d}.parquet"
            write_atomic(df, path, level=1, fsync=False)
            unrolled[table].append(path)
            if len(unrolled[table]) >= roll_every:
                parts = unrolled[table]
                merged = pl.concat([pl.read_parquet(p) for p in parts], how="vertical_relaxed")
                write_atomic(merged, folder / f"{table}-c{seg[table]:06d}.parquet", level=3)
                for p in parts:
                    p.unlink()
                unrolled[table] = []
        cost.append(time.process_time() - c0)
    return cost


def new_path(load: Load, n: int, folder: Path, roll_every: int) -> list[float]:
    """The streams, the write alone: to_frame, then one append per table; a roll every `roll_every`."""
    streams: dict[str, StreamFile] = {}
    seg = {t: 0 for t in schema.TABLES}
    cost = []
    for i in range(n):
        rows = load.flush(i)
        c0 = time.process_time()
        for table, rs in rows.items():
            if not rs:
                continue
            df = to_frame(rs, table)
            seg[table] += 1
            st = streams.get(table) or streams.setdefault(table, StreamFile(folder / f"{table}-{seg[table]:06d}.arrows", seg[table]))
            append_stream(st, df)
            if st.batches >= roll_every:
                write_atomic(writer.read_part(st.path), folder / f"{table}-c{st.first:06d}-{seg[table]:06d}.parquet", level=3)
                st.close()
                st.path.unlink()
                del streams[table]
        cost.append(time.process_time() - c0)
    for st in streams.values():
        st.close()
    return cost


def recorder_path(load: Load, n: int, folder: Path, roll_every: int) -> list[float]:
    """The new path end to end: the rows go through a bus and `Recorder.flush()` (drain, to_frame,
    append, rolls), as in `gpuwatch record`."""
    bus = Bus()
    r = Recorder(bus, folder, {"bench": True}, roll_every=roll_every, name="rec").start(thread=False)  # flush by hand
    cost = []
    try:
        for i in range(n):
            rows = load.flush(i)
            for row in rows["samples"]:
                bus.ticks.append(Tick(row["tick"], row["ts"], [row]))
            for s in rows["steps"]:
                bus.steps.append(s)
            for rr in rows["risk"]:
                bus.risk.append(rr)
            for e in rows["events"]:
                bus.emit(e["kind"], e["message"], n=i)
            c0 = time.process_time()
            r.flush()
            cost.append(time.process_time() - c0)
        assert r.error is None, r.error
    finally:
        r.stop(compact=False)
    return cost


def parts(load: Load, n: int = 300) -> dict[str, float]:
    """Median CPU us of each piece, for the samples table (10 rows)."""
    rows = load.flush(0)["samples"]
    df = to_frame(rows, "samples")
    out = {}

    def med(fn) -> float:
        ts = []
        for _ in range(n):
            c0 = time.process_time()
            fn()
            ts.append(time.process_time() - c0)
        return statistics.median(ts) * 1e6

    out["to_frame (pl.from_dicts, 10 rows)"] = med(lambda: to_frame(rows, "samples"))
    out["write_ipc_stream to memory"] = med(lambda: ipc.ipc_bytes(df))
    with tempfile.TemporaryDirectory() as d:
        st = StreamFile(Path(d) / "samples-000001.arrows", 1)
        out["StreamFile.append (encode + one write)"] = med(lambda: st.append(df))
        st.close()
        out["write_parquet segment (write_atomic, zstd 1, no fsync)"] = med(
            lambda: write_atomic(df, Path(d) / "samples-000002.parquet", level=1, fsync=False))
    return out


def summary(cost: list[float]) -> dict[str, float]:
    mean = statistics.fmean(cost)
    return {"median_us": round(statistics.median(cost) * 1e6, 1), "mean_us": round(mean * 1e6, 1),
            "p99_us": round(sorted(cost)[int(len(cost) * 0.99)] * 1e6, 1),
            "pct_of_one_core_at_1_flush_per_s": round(mean * 100, 4)}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flushes", type=int, default=900, help="flushes per path (default 900: three rolls)")
    ap.add_argument("--roll-every", type=int, default=300)
    ap.add_argument("--samples", type=int, default=10, help="sample rows per flush (10 Hz, one GPU)")
    ap.add_argument("--steps", type=int, default=2, help="step rows per flush")
    ap.add_argument("--risk", type=int, default=1, help="risk rows per flush")
    ap.add_argument("--event-every", type=int, default=5, help="one event every N flushes (0: none)")
    ap.add_argument("--dir", default=None, help="where the temp folders go (default: the system's temp)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    t_start = time.monotonic()
    load = Load(args.samples, args.steps, args.risk, args.event_every)
    results: dict[str, dict] = {}
    for name, fn in (("old: from_dicts + Parquet segment", old_path), ("new: from_dicts + IPC stream append", new_path),
                     ("new end to end: Recorder.flush()", recorder_path)):
        d = Path(tempfile.mkdtemp(prefix="gpuwatch-bench-", dir=args.dir))
        try:
            (d / "warm").mkdir()
            (d / "run").mkdir()
            fn(load, 20, d / "warm", args.roll_every)  # imports, first allocations
            results[name] = summary(fn(load, args.flushes, d / "run", args.roll_every))
        finally:
            shutil.rmtree(d, ignore_errors=True)
    pieces = {k: round(v, 1) for k, v in parts(load).items()}
    old, new = results["old: from_dicts + Parquet segment"], results["new end to end: Recorder.flush()"]
    out = {
        "bench": "recorder", "python": platform.python_version(), "polars": pl.__version__, "cpu": cpu_name(),
        "cores": os.cpu_count(), "flushes": args.flushes, "roll_every": args.roll_every,
        "per_flush": {"samples": args.samples, "steps": args.steps, "risk": args.risk,
                      "events": 1 / args.event_every if args.event_every else 0},
        "paths": results, "samples_table_pieces_median_us": pieces,
        "speedup_mean": round(old["mean_us"] / new["mean_us"], 2) if new["mean_us"] else None,
        "wall_s": round(time.monotonic() - t_start, 1),
    }
    print(f"recorder flush, {args.samples} sample + {args.steps} step + {args.risk} risk rows"
          f" (+1 event / {args.event_every} flushes), {args.flushes} flushes, roll every {args.roll_every};"
          f" {out['cpu']}, {out['cores']} cores, Python {out['python']}, polars {out['polars']}")
    print(f"{'path':44s} {'median us':>10s} {'mean us':>10s} {'p99 us':>10s} {'% core @1/s':>12s}")
    for k, v in results.items():
        print(f"{k:44s} {v['median_us']:10.1f} {v['mean_us']:10.1f} {v['p99_us']:10.1f} "
              f"{v['pct_of_one_core_at_1_flush_per_s']:12.4f}")
    print("samples table, median us per call:")
    for k, v in pieces.items():
        print(f"  {k:56s} {v:8.1f}")
    print(f"old / new (end to end), mean: {out['speedup_mean']}x; wall {out['wall_s']} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
