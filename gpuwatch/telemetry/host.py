"""Host telemetry through psutil: CPU (total and per core), memory, swap, load, and this process.

Fast fields (every tick) read /proc/stat, /proc/meminfo and /proc/self; swap and load average change
slowly and are read on the slow thread.
"""

from __future__ import annotations

import os
import time
from typing import Any

import psutil


class HostSampler:
    label = "live (psutil)"

    def __init__(self) -> None:
        self._proc = psutil.Process(os.getpid())
        psutil.cpu_percent(percpu=True)  # prime: the first call has no interval to compare with
        self._last_cpu = (time.monotonic(), sum(self._proc.cpu_times()[:2]))
        self.cores = psutil.cpu_count() or 1

    def read_fast(self) -> dict[str, Any]:
        per_core = psutil.cpu_percent(percpu=True)
        vm = psutil.virtual_memory()
        now, cpu = time.monotonic(), sum(self._proc.cpu_times()[:2])
        last_t, last_cpu = self._last_cpu
        self._last_cpu = (now, cpu)
        return {
            "host_cpu_pct": sum(per_core) / len(per_core) if per_core else None,
            "host_cpu_per_core_pct": per_core,
            "host_mem_used_bytes": vm.total - vm.available,
            "host_mem_total_bytes": vm.total,
            "proc_rss_bytes": self._proc.memory_info().rss,
            # % of one core, like top: 100 = one core busy
            "proc_cpu_pct": 100.0 * (cpu - last_cpu) / (now - last_t) if now > last_t else None,
        }

    def read_slow(self) -> dict[str, Any]:
        return {"host_swap_used_bytes": psutil.swap_memory().used, "host_load1": os.getloadavg()[0]}
