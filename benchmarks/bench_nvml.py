"""Wall and CPU time of every NVML read gpuwatch makes, on GPU 0 (issue 2: which reads are fast enough
for the 100 ms path). Prints JSON: per field, microseconds per call (wall, and CPU of this thread)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpuwatch.telemetry import nvml  # noqa: E402


def main(n: int = 200) -> None:
    b = nvml.NvmlBackend()
    h = b.handle(0)
    out = {}
    fields = {**nvml.FAST, **nvml.LEGACY_SLOW, "pcie counters (field values)": nvml.read_pcie_counters}
    for name, fn in fields.items():
        reps = 20 if "pcie" in name and "counters" not in name else n
        w0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(reps):
            try:
                fn(h)
            except Exception as e:  # noqa: BLE001
                out[name] = f"error: {e}"
                break
        else:
            out[name] = {"wall_us": round((time.perf_counter() - w0) / reps * 1e6, 1),
                         "cpu_us": round((time.thread_time() - c0) / reps * 1e6, 1)}
    for label, call in (("read_fast (all fast fields)", lambda: b.read_fast(0)), ("read_slow (mean over 50 calls: energy every 10th)", lambda: b.read_slow(0))):
        w0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(50):
            call()
        out[label] = {"wall_us": round((time.perf_counter() - w0) / 50 * 1e6, 1),
                      "cpu_us": round((time.thread_time() - c0) / 50 * 1e6, 1)}
    out["counters_supported"] = b.counters
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
