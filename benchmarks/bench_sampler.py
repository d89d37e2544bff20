"""Sampler + recorder cost, interval jitter and bytes on disk (issue 2's benchmarks).

  python benchmarks/bench_sampler.py cost   [--seconds 60] [--gpus N]  CPU %% of one core: gpuwatch record vs the tools
                                                             people use (nvidia-smi -lms 100, a bare pynvml
                                                             loop, a bash loop), all run side by side
  python benchmarks/bench_sampler.py jitter [--seconds 20]   sample-interval p50/p99/max, idle and beside a
                                                             busy Python thread + a GPU matmul loop in-process
  python benchmarks/bench_sampler.py threads [--seconds 30]  where `gpuwatch record`'s CPU goes, per OS thread
                                                             (gw-sampler, gw-recorder, polars' pool, ...)
  python benchmarks/bench_sampler.py parts                   CPU us of each piece on its own: a wake-up, a
                                                             tick, a slow read, a pipe hand-over, a segment write
                                                             (and a tick over a fake NVML that costs nothing: the
                                                             sampler's own Python)
  python benchmarks/bench_sampler.py profile [--seconds 30] [--json PATH] [--gpus N] [--fake-nvml N]
                                                             where a tick's CPU goes inside the running
                                                             `gpuwatch record --no-model` (child instrumented
                                                             through GPUWATCH_SAMPLER_PROFILE): per section
                                                             p50/p99/mean CPU and wall, per thread CPU and
                                                             wake-ups, the tree's %% of a core, CPU MHz/C-states
  python benchmarks/bench_sampler.py compare TREE_A TREE_B [--seconds 60] [--runs 3] [--fake-nvml N]
                                                             `gpuwatch record --no-model` of two source trees
                                                             side by side: CPU of each tree, per thread, and
                                                             the recorded tick CPU (sampler_cpu_us)
  --fake-nvml N: a stand-in libnvidia-ml.so.1 (compiled here) for N GPUs: pynvml runs, the driver costs nothing
  --gpus N: only the first N GPUs (`gpuwatch record --gpus 0,..,N-1`), to measure the cost per additional GPU
  python benchmarks/bench_sampler.py memory                  nvidia-smi's memory.used/.reserved vs gpuwatch's (v2)
                                                             and NVML's v1 call, per GPU, plus power.draw
Prints one JSON object per measurement (and writes it to --out if given). `profile` and `compare` are
benchmarks/bench_sampler_profile.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # support/: the fake NVML and the tick profiler (not shipped)
# profile and compare: benchmarks/bench_sampler_profile.py (imported by main when asked)

FIELDS = "utilization.gpu,utilization.memory,memory.used,memory.total,temperature.gpu,power.draw,clocks.sm,clocks.mem"
PYNVML_LOOP = r"""
import os, time, pynvml
pynvml.nvmlInit(); hs = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(int(os.environ.get("LOOP_GPUS", "1")))]
nxt = time.monotonic()
while True:
    for h in hs:
        pynvml.nvmlDeviceGetUtilizationRates(h); pynvml.nvmlDeviceGetMemoryInfo(h)
        pynvml.nvmlDeviceGetTemperature(h, 0); pynvml.nvmlDeviceGetPowerUsage(h)
        pynvml.nvmlDeviceGetClockInfo(h, 1); pynvml.nvmlDeviceGetClockInfo(h, 0)
    nxt += 0.1; time.sleep(max(0, nxt - time.monotonic()))
"""
BASH_LOOP = "while true; do nvidia-smi --query-gpu=%s --format=csv,noheader >/dev/null; free -b >/dev/null; sleep 0.1; done" % FIELDS


def _schedstat_s(pid: int) -> float | None:
    """CPU time of every live thread of `pid` in ns precision (/proc/PID/task/TID/schedstat, field 1), or None
    (not Linux). utime/stime count in 10 ms clock ticks: over 45 s that is +-0.02 % of a core per process."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total = 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total / 1e9


def cpu_seconds(p: psutil.Process) -> float:
    total = 0.0
    for q in [p, *p.children(recursive=True)]:
        try:
            t = q.cpu_times()  # children_*: reaped short-lived children (the bash loop's nvidia-smi calls)
            live = _schedstat_s(q.pid)
            total += (t.user + t.system if live is None else live) + t.children_user + t.children_system
        except psutil.NoSuchProcess:
            pass
    return total


def _gpu_count() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML here
        return 0


def gpus_flag(n: int) -> list[str]:
    """`gpuwatch record`'s flags that sample the first n GPUs alone."""
    return ["--gpus", ",".join(str(i) for i in range(n))]


def cost(seconds: float, warmup: float = 5.0, max_gpus: int | None = None, variants: str = "all") -> dict:
    """`max_gpus`: every tool samples the first N GPUs (None: all). With all GPUs on a machine of more than
    one, a second `gpuwatch record` sampling GPU 0 only runs beside them: the difference is the cost of
    the additional GPUs. `variants="side-by-side"`: only `gpuwatch record` (default, and PCIe every 1 s),
    nvidia-smi and the pynvml loop - no bash loop starting nvidia-smi ten times a second (each start
    initialises NVML in the driver beside the others' reads) and no scoring run."""
    rec_dir = Path(tempfile.mkdtemp(prefix="gpuwatch-bench-"))
    dur = f"{seconds + warmup + 3}s"
    n_gpus = _gpu_count()
    n = min(n_gpus, max_gpus) if max_gpus else n_gpus
    only = gpus_flag(n) if max_gpus and n else []
    full = variants == "all"
    procs = {f"gpuwatch record (sampler+recorder, all fields, {n} GPU)": ([
        sys.executable, "-m", "gpuwatch", "record", "--no-model", "--duration", dur, "-o", str(rec_dir), *only], {})}
    if full:
        procs["gpuwatch record + risk scoring (2 Hz)"] = ([
            sys.executable, "-m", "gpuwatch", "record", "--duration", dur, "-o", str(rec_dir / "scored"), *only], {})
        procs["gpuwatch record, sampler child pinned to one CPU (GPUWATCH_SAMPLER_CPU=last)"] = ([
            sys.executable, "-m", "gpuwatch", "record", "--no-model", "--duration", dur, "-o", str(rec_dir / "pinned"),
            *only], {"GPUWATCH_SAMPLER_CPU": "last"})
    procs["gpuwatch record, Python sampler loop (GPUWATCH_SAMPLER_LOOP=python; default: the C loop)"] = ([
        sys.executable, "-m", "gpuwatch", "record", "--no-model", "--duration", dur, "-o", str(rec_dir / "pyloop"),
        *only], {"GPUWATCH_SAMPLER_LOOP": "python"})
    procs["gpuwatch record, PCIe counters every 1 s (GPUWATCH_PCIE_EVERY=1; default 2 s)"] = ([
        sys.executable, "-m", "gpuwatch", "record", "--no-model", "--duration", dur, "-o", str(rec_dir / "pcie1"),
        *only], {"GPUWATCH_PCIE_EVERY": "1"})
    procs["gpuwatch record --sampler thread (no child process, no pipe)"] = ([
        sys.executable, "-m", "gpuwatch", "record", "--no-model", "--sampler", "thread", "--duration", dur,
        "-o", str(rec_dir / "thread"), *only], {})
    if n > 1:
        procs["gpuwatch record (sampler+recorder, all fields, GPU 0 only)"] = ([
            sys.executable, "-m", "gpuwatch", "record", "--no-model", "--duration", dur, "-o", str(rec_dir / "one"),
            *gpus_flag(1)], {})
    if shutil.which("nvidia-smi"):
        ids = ["-i", ",".join(str(i) for i in range(n))] if max_gpus and n else []
        procs[f"nvidia-smi --query-gpu (8 fields) -lms 100, {n} GPU"] = (
            ["nvidia-smi", f"--query-gpu={FIELDS}", "--format=csv", "-lms", "100", *ids], {})
        procs[f"bare pynvml loop, 6 fields, {n} GPU"] = ([sys.executable, "-c", PYNVML_LOOP], {"LOOP_GPUS": str(n or 1)})
        if full:
            procs["bash loop: nvidia-smi + free every 0.1 s"] = (["bash", "-c", BASH_LOOP], {})
    running = {k: subprocess.Popen(v, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
                                   env=dict(os.environ, **e), start_new_session=True) for k, (v, e) in procs.items()}
    time.sleep(warmup)
    ps = {k: psutil.Process(p.pid) for k, p in running.items()}
    c0 = {k: cpu_seconds(p) for k, p in ps.items()}
    t0 = time.monotonic()
    time.sleep(seconds)
    dt = time.monotonic() - t0
    out = {k: round(100 * (cpu_seconds(p) - c0[k]) / dt, 3) for k, p in ps.items()}
    for k, p in running.items():
        if not k.startswith("gpuwatch"):
            os.killpg(p.pid, 9)
    for k, p in running.items():
        if k.startswith("gpuwatch"):
            p.wait(timeout=60)
    result = {"measure": "cpu_pct_of_one_core", "seconds": round(dt, 1), "gpus": n_gpus, "max_gpus": max_gpus,
              "variants": variants, "clock": "schedstat (ns)" if _schedstat_s(os.getpid()) is not None else "utime+stime",
              "cpu_pct": out}
    result.update(disk_usage(rec_dir))
    shutil.rmtree(rec_dir, ignore_errors=True)
    return result


def disk_usage(rec_dir: Path) -> dict:
    from gpuwatch.recording.reader import open_recording

    sessions = [p for p in rec_dir.iterdir() if (p / "meta.json").exists()]
    if not sessions:
        return {}
    rec = open_recording(sessions[0])
    f = sessions[0] / "samples.parquet"
    size = f.stat().st_size
    n = rec.samples.height
    cols = len(rec.samples.columns)
    return {"samples_file_bytes": size, "gpu_samples": n, "bytes_per_gpu_sample": round(size / max(n, 1), 2),
            "mb_per_gpu_day_at_10hz": round(size / max(n, 1) * 864_000 / 1e6, 2), "columns": cols,
            "interval_ms": interval_stats(rec.samples)}


def interval_stats(df) -> dict:
    import polars as pl

    iv = df.filter(pl.col("gpu").is_null() | (pl.col("gpu") == 0))["sampler_interval_us"].drop_nulls() / 1000
    cost = df["sampler_cost_us"].drop_nulls()
    if iv.is_empty():
        return {}
    cpu = df.filter(pl.col("gpu").is_null() | (pl.col("gpu") == 0))["sampler_cpu_us"].drop_nulls()
    return {"n": iv.len(), "p50": round(iv.quantile(0.5), 2), "p99": round(iv.quantile(0.99), 2),
            "max": round(iv.max(), 2), "tick_cost_us_p50": int(cost.quantile(0.5)), "tick_cost_us_p99": int(cost.quantile(0.99)),
            "tick_cpu_us_p50": int(cpu.quantile(0.5)), "tick_cpu_us_p99": int(cpu.quantile(0.99)),
            "tick_cpu_us_mean": round(cpu.mean(), 1)}


def jitter(seconds: float) -> dict:
    """In-process: the real Session (sampler + recorder), idle, then beside busy work."""
    from gpuwatch.recording.reader import open_recording
    from gpuwatch.runtime import ModelChoice, Session, SessionConfig

    out = {}
    for phase in ("idle", "busy"):
        rec_dir = Path(tempfile.mkdtemp(prefix="gpuwatch-jitter-"))
        s = Session(SessionConfig(interval_s=0.1, record_dir=rec_dir, model=ModelChoice(enabled=False)))
        stop = threading.Event()
        workers = []
        if phase == "busy":
            workers = [threading.Thread(target=_py_busy, args=(stop,), daemon=True),
                       threading.Thread(target=_gpu_busy, args=(stop,), daemon=True)]
            for w in workers:
                w.start()
        s.start()
        time.sleep(seconds)
        s.stop()
        stop.set()
        for w in workers:
            w.join()
        rec = open_recording(s.recorder.dir)
        out[phase] = interval_stats(rec.samples) | {"late_ticks": s.sampler.late_ticks}
        shutil.rmtree(rec_dir, ignore_errors=True)
    return {"measure": "sample_interval_ms", "seconds_each": seconds, **out}


def _py_busy(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for i in range(10_000):
            x += i * i


def _gpu_busy(stop: threading.Event) -> None:
    try:
        import torch
    except ImportError:
        return
    if not torch.cuda.is_available():
        return
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    while not stop.is_set():
        for _ in range(10):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()


def threads(seconds: float, extra: list[str]) -> dict:
    """CPU % of one core per OS thread of a running `gpuwatch record` (threads are named gw-*)."""
    rec_dir = Path(tempfile.mkdtemp(prefix="gpuwatch-threads-"))
    p = subprocess.Popen([sys.executable, "-m", "gpuwatch", "record", "--duration", f"{seconds + 8}s", "-o",
                          str(rec_dir), *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    time.sleep(5)

    def snap() -> dict[str, float]:
        out: dict[str, float] = {}
        root = psutil.Process(p.pid)
        for q in [root, *root.children(recursive=True)]:
            who = "parent" if q.pid == p.pid else "child"
            for t in q.threads():
                try:
                    name = Path(f"/proc/{q.pid}/task/{t.id}/comm").read_text().strip()
                except OSError:
                    name = "?"
                key = f"{who}:{name}:{t.id}"
                out[key] = t.user_time + t.system_time
        return out

    a = snap()
    t0 = time.monotonic()
    time.sleep(seconds)
    b = snap()
    dt = time.monotonic() - t0
    per: dict[str, float] = {}
    for k, v in b.items():
        who, name, _ = k.split(":")
        per[f"{who}:{name}"] = per.get(f"{who}:{name}", 0.0) + v - a.get(k, 0.0)
    p.wait(timeout=60)
    shutil.rmtree(rec_dir, ignore_errors=True)
    pct = {k: round(100 * v / dt, 3) for k, v in sorted(per.items(), key=lambda kv: -kv[1]) if v > 0}
    return {"measure": "cpu_pct_of_one_core_per_thread", "args": extra, "seconds": round(dt, 1),
            "total": round(sum(pct.values()), 3), "threads": pct}


def parts() -> dict:
    """CPU microseconds (all threads of this process) of each piece of a tick, measured alone."""
    import io
    import pickle
    import multiprocessing as mp

    from gpuwatch.recording.writer import to_frame, write_atomic
    from gpuwatch.recording.backends import make_gpu_backend
    from gpuwatch.telemetry.bus import Bus
    from gpuwatch.telemetry.host import HostSampler
    from gpuwatch.telemetry.sampler import Sampler

    def cpu_us(fn, n: int) -> float:
        fn()
        c0 = time.process_time()
        for _ in range(n):
            fn()
        return round(1e6 * (time.process_time() - c0) / n, 1)

    out: dict[str, float] = {}
    ev = threading.Event()
    out["wake_event_wait_10ms"] = cpu_us(lambda: ev.wait(0.01), 200)
    out["wake_sleep_10ms"] = cpu_us(lambda: time.sleep(0.01), 200)
    gpu, note = make_gpu_backend(None)
    host = HostSampler()
    s = Sampler(Bus(), gpu, host)
    s.slow_tick()
    out["host_read_fast"] = cpu_us(host.read_fast, 2000)
    out["host_read_slow"] = cpu_us(host.read_slow, 200)
    out["host_read_slow_psutil"] = cpu_us(host.read_slow_psutil, 200)
    meta: dict = {}
    if gpu is not None:
        out["gpu0_read_fast"] = cpu_us(lambda: gpu.read_fast(0), 2000)
        out["gpu0_read_slow"] = cpu_us(lambda: gpu.read_slow(0), 60)
        meta = {"memory_api": getattr(gpu, "memory_api", None),
                "field_batch": (gpu.batched_fields(0) or []) if hasattr(gpu, "batched_fields") else None}
        try:
            from gpuwatch.telemetry import nvml

            h = gpu.handle(0)
            out["nvml_mem_v1"] = cpu_us(lambda: nvml.read_memory_v1(h), 2000)
            out["nvml_mem_v2"] = cpu_us(lambda: nvml.read_memory_v2(h), 2000)
            ids = [fid for _, fid, _ in nvml.FIELD_BATCH]
            out["nvml_field_values_batch"] = cpu_us(lambda: nvml.pynvml.nvmlDeviceGetFieldValues(h, ids), 2000)
            out["nvml_power_ecc_legacy_3_calls"] = cpu_us(lambda: (
                nvml.FAST["gpu_power_w"](h), gpu.or_none(lambda: nvml.FAST["gpu_ecc_corrected"](h)),
                gpu.or_none(lambda: nvml.FAST["gpu_ecc_uncorrected"](h))), 2000)
            out["nvml_procs"] = cpu_us(lambda: nvml.read_compute_procs(h), 2000)
        except Exception as e:  # noqa: BLE001
            meta["nvml_parts_error"] = repr(e)[:200]
    out["tick_all"] = cpu_us(s.tick, 2000)
    out["tick_fake_nvml"] = _fake_tick_us(cpu_us)
    t = s.tick()
    batch = [s.tick() for _ in range(10)]
    out["pickle_tick"] = cpu_us(lambda: pickle.dumps(t), 2000)
    r, w = mp.Pipe(duplex=False)
    out["pipe_send_recv_tick"] = cpu_us(lambda: (w.send(t), r.recv()), 2000)
    out["pipe_send_recv_batch10"] = cpu_us(lambda: (w.send(batch), r.recv()), 500)
    rows = [row for tk in batch for row in tk.rows]
    out["to_frame_10_ticks"] = cpu_us(lambda: to_frame(rows, "samples"), 200)
    df = to_frame(rows, "samples")
    d = Path(tempfile.mkdtemp(prefix="gpuwatch-parts-"))
    out["segment_write_10_ticks"] = cpu_us(lambda: write_atomic(df, d / "s.parquet", level=1, fsync=False), 200)
    out["parquet_to_memory_polars"] = cpu_us(lambda: df.write_parquet(io.BytesIO(), compression="zstd", compression_level=1), 200)
    try:
        import pyarrow.parquet as pq

        tbl = df.to_arrow()
        out["parquet_to_memory_pyarrow"] = cpu_us(lambda: pq.write_table(tbl, io.BytesIO(), compression="zstd"), 200)
    except ImportError:
        pass
    shutil.rmtree(d, ignore_errors=True)
    return {"measure": "cpu_us_per_call", "columns": len(df.columns), "gpu": note, **meta, "parts": out}


class _FakeNvmlBackend:
    """A GPU backend whose reads cost nothing: the row a real H200 read gives, copied (what is left of a
    tick's CPU is the sampler's own Python)."""

    def __init__(self) -> None:
        from gpuwatch.telemetry.nvml import GpuInfo

        self.gpus = [GpuInfo(0, "fake", None, None, 141 * 2**30, 700.0, 89)]
        self._row = {"gpu_util_pct": 97, "gpu_mem_util_pct": 40, "gpu_mem_used_bytes": 10 * 2**30,
                     "gpu_mem_total_bytes": 141 * 2**30, "gpu_mem_reserved_bytes": 615 * 2**20, "gpu_temp_c": 60,
                     "gpu_power_w": 350.0, "gpu_sm_clock_mhz": 1980, "gpu_mem_clock_mhz": 2619,
                     "gpu_clocks_event_reasons": 0, "gpu_ecc_corrected": 0, "gpu_ecc_uncorrected": 0,
                     "gpu_procs": [{"pid": 1, "used_bytes": 2**30}], "gpu_power_limit_w": 700.0, "gpu_temp_slowdown_c": 89}

    def read_fast(self, i):
        return dict(self._row)

    def read_slow(self, i):
        return {"gpu_pcie_tx_bytes_per_s": 1.0, "gpu_pcie_rx_bytes_per_s": 2.0, "gpu_energy_mj": 5}


def _fake_tick_us(cpu_us) -> float:
    from gpuwatch.telemetry.bus import Bus
    from gpuwatch.telemetry.host import HostSampler
    from gpuwatch.telemetry.sampler import Sampler

    s = Sampler(Bus(), _FakeNvmlBackend(), HostSampler())
    s.slow_tick()
    return cpu_us(s.tick, 5000)


def memory() -> dict:
    """On an idle GPU: nvidia-smi's memory.used (and .reserved) next to what gpuwatch records (NVML v2 where
    the driver has it) and what NVML's v1 call says (driver-reserved memory counted as used)."""
    from gpuwatch.telemetry import nvml

    try:
        b = nvml.NvmlBackend()
    except nvml.NvmlUnavailable as e:
        return {"measure": "memory_used_vs_nvidia_smi", "skipped": str(e)}
    q = "index,memory.used,memory.reserved,memory.total,power.draw"
    smi = {}
    try:
        txt = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
        for line in txt.strip().splitlines():
            f = [x.strip() for x in line.split(",")]
            smi[int(f[0])] = {"memory.used_mib": f[1], "memory.reserved_mib": f[2], "memory.total_mib": f[3],
                              "power.draw_w": f[4]}
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        smi = {"error": repr(e)}
    gpus = []
    for g in b.gpus:
        row = b.read_fast(g.index)
        v1 = b.or_none(lambda: nvml.read_memory_v1(b.handle(g.index)))
        mib = lambda x: None if x is None else round(x / 2**20, 1)  # noqa: E731
        gpus.append({"gpu": g.index, "nvidia_smi": smi.get(g.index, smi),
                     "gpuwatch_used_mib": mib(row.get("gpu_mem_used_bytes")),
                     "gpuwatch_reserved_mib": mib(row.get("gpu_mem_reserved_bytes")),
                     "gpuwatch_total_mib": mib(row.get("gpu_mem_total_bytes")),
                     "nvml_v1_used_mib": mib(v1[0]) if v1 else None, "gpuwatch_power_w": row.get("gpu_power_w"),
                     "legacy_power_usage_w": b.or_none(lambda: nvml.FAST["gpu_power_w"](b.handle(g.index)))})
    b.close()
    return {"measure": "memory_used_vs_nvidia_smi", "memory_api": b.memory_api, "gpus": gpus}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["cost", "jitter", "threads", "parts", "memory", "profile", "compare"])
    ap.add_argument("trees", nargs="*", type=Path, help="compare: source trees to run side by side")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--gpus", default=None, help="cost/compare: 'all' (default) or N = sample only the first N GPUs")
    ap.add_argument("--sampler", default="process", choices=["process", "thread"], help="threads: which sampler")
    ap.add_argument("--seconds", type=float, default=None)
    ap.add_argument("--variants", default="all", choices=["all", "side-by-side"], help="cost: which tools run")
    ap.add_argument("--out", "--json", dest="out", type=Path)
    ap.add_argument("--fake-nvml", type=int, default=0, metavar="N",
                    help="profile: replace the NVML driver calls by ones that answer at once for N GPUs (no GPU here)")
    a = ap.parse_args()
    if a.what in ("profile", "compare"):
        from bench_sampler_profile import compare, print_profile, profile  # benchmarks/bench_sampler_profile.py
    if a.what == "profile":
        res = profile(a.seconds or 30, a.out, fake_nvml=a.fake_nvml, max_gpus=int(a.gpus) if a.gpus and a.gpus != "all" else None)
        res["host"] = os.uname().nodename
        if a.out:
            a.out.write_text(json.dumps(res, indent=1))
        print_profile(res)
        return
    max_gpus = int(a.gpus) if a.gpus and a.gpus != "all" else None
    if a.what == "compare":
        res = compare(a.trees, a.seconds or 60, a.runs, fake_nvml=a.fake_nvml, max_gpus=max_gpus)
    elif a.what == "cost":
        res = cost(a.seconds or 60, max_gpus=max_gpus, variants=a.variants)
    elif a.what == "jitter":
        res = jitter(a.seconds or 20)
    elif a.what == "threads":
        res = threads(a.seconds or 30, ["--sampler", a.sampler])
    elif a.what == "memory":
        res = memory()
    else:
        res = parts()
    res["host"] = os.uname().nodename
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        a.out.write_text(text)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
