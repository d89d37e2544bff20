"""What serving Prometheus costs the gpuwatch process: a scrape every second, measured three ways.

The bus is filled to its 1 h capacity with a real H200 recording replayed through the real Sampler
(36,000 ticks; the worst case, since reading the channels copies the ring), a sampler thread keeps
ticking at 10 Hz, and the exporter serves on 127.0.0.1. A separate process scrapes once a second, so
the scraper's own CPU is not counted.

1. per scrape: CPU of `generate_latest` in-process (collect + text format), N calls;
2. the exporter's own counter (`gpuwatch_exporter_scrape_cpu_seconds_total`, serving thread);
3. the whole process: CPU time (getrusage) over blocks with and without the scraper, interleaved
   (off, on, off, on, ...) so drift cancels; the difference is the cost, HTTP handling included.

    .venv/bin/python benchmarks/bench_prometheus.py [--seconds 60] [--blocks 4]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prometheus_client import generate_latest  # noqa: E402

from gpuwatch.export.prometheus import PrometheusExporter  # noqa: E402
from gpuwatch.recording.reader import open_recording  # noqa: E402
from gpuwatch.recording.replay_backend import ReplayGpuBackend  # noqa: E402
from gpuwatch.telemetry.bus import Bus  # noqa: E402
from gpuwatch.telemetry.host import HostSampler  # noqa: E402
from gpuwatch.telemetry.nvml import GpuInfo  # noqa: E402
from gpuwatch.telemetry.sampler import Sampler  # noqa: E402

RAMP = ROOT / "recordings" / "sample-h200-ramp-train"
SCRAPER = """
import sys, time, urllib.request
url, end = sys.argv[1], time.monotonic() + float(sys.argv[2])
n = 0
while time.monotonic() < end:
    t = time.monotonic()
    urllib.request.urlopen(url, timeout=5).read()
    n += 1
    time.sleep(max(0.0, 1.0 - (time.monotonic() - t)))
print(n)
"""


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60.0, help="scraped seconds (and as many unscraped)")
    ap.add_argument("--blocks", type=int, default=4, help="interleaved off/on block pairs")
    ap.add_argument("--calls", type=int, default=200, help="in-process generate_latest calls")
    a = ap.parse_args()

    rec = open_recording(RAMP)
    gpus = [GpuInfo(g["index"], g["name"], g.get("uuid"), g.get("pci_bus_id"), g.get("mem_total_bytes"),
                    g.get("power_limit_w"), g.get("temp_slowdown_c")) for g in rec.meta["gpus"]]
    bus = Bus()
    sampler = Sampler(bus, ReplayGpuBackend(RAMP), HostSampler())
    sampler.slow_tick()
    for _ in range(36_000):
        sampler.tick()
    for s in rec.steps.to_dicts():
        s["ts"] = int(s["ts"].timestamp() * 1e6)
        bus.steps.append(s)
    for e in rec.events.to_dicts():
        bus.emit(e["kind"], e["message"], e["severity"], e["gpu"])
    for i in range(36_000):
        bus.risk.append({"ts": i, "gpu": 0, "kind": "oom", "risk": 0.1, "alarm": False, "threshold": 0.8,
                         "model": "m", "reasons": "[]"})

    exp = PrometheusExporter(bus, gpus, port=0)
    text = generate_latest(exp.registry)  # first read walks the full rings once
    c0, t0 = time.thread_time(), time.perf_counter()
    for _ in range(a.calls):
        bus.steps.append(dict(rec.steps.row(-1, named=True), ts=time.time_ns() // 1000))
        generate_latest(exp.registry)
    per_cpu, per_wall = (time.thread_time() - c0) / a.calls, (time.perf_counter() - t0) / a.calls
    print(f"machine: {os.cpu_count()} CPUs; payload {len(text)} bytes, "
          f"{sum(1 for line in text.decode().splitlines() if line and not line.startswith('#'))} samples")
    print(f"1. generate_latest in-process, bus full (1 h): {per_cpu * 1e3:.3f} ms CPU, {per_wall * 1e3:.3f} ms wall "
          f"per scrape -> {per_cpu * 100:.3f} % of one core at 1 scrape/s")

    sampler.start()  # 10 Hz, as in a live session
    exp.start()
    c_scr0 = exp.collector.scrape_cpu_ns
    n_scr0 = exp.collector.scrapes
    block = a.seconds / a.blocks
    off = on = off_wall = on_wall = 0.0
    scrapes = 0
    for _ in range(a.blocks):
        c, w = cpu_s(), time.monotonic()
        time.sleep(block)
        off, off_wall = off + cpu_s() - c, off_wall + time.monotonic() - w
        c, w = cpu_s(), time.monotonic()
        p = subprocess.Popen([sys.executable, "-c", SCRAPER, exp.url, str(block)], stdout=subprocess.PIPE, text=True)
        out, _ = p.communicate()
        on, on_wall = on + cpu_s() - c, on_wall + time.monotonic() - w
        scrapes += int(out.strip() or 0)
    sampler.stop()
    exp.stop()
    own = (exp.collector.scrape_cpu_ns - c_scr0) / 1e9
    n_own = exp.collector.scrapes - n_scr0
    print(f"2. exporter's own counter: {own / max(n_own, 1) * 1e3:.3f} ms CPU per scrape over {n_own} scrapes "
          f"-> {own / a.seconds * 100:.3f} % of one core")
    p_off, p_on = off / off_wall * 100, on / on_wall * 100
    print(f"3. whole process (sampler at 10 Hz included), {a.blocks} x {block:.0f} s blocks each: without scraping "
          f"{p_off:.2f} % of a core, with {scrapes} scrapes {p_on:.2f} %; difference {p_on - p_off:+.3f} % of one core "
          f"({(p_on - p_off) / 100 * on_wall / max(scrapes, 1) * 1e3:+.2f} ms per scrape)")


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    main()
