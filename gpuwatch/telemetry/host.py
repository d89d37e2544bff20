"""Host telemetry through psutil: CPU (total and per core), memory, swap, load, and the monitored process.

Only total CPU is read every tick (one pread of /proc/stat, ~10 us). Per-core CPU, memory, swap, load and
the process's RSS and CPU are read on the slow thread (1 Hz; each psutil call costs 30-150 us, and
together they would cost more than the whole GPU sample); rows in between repeat the last reading.
"""

from __future__ import annotations

import os
import time
from typing import Any

import psutil


class HostSampler:
    label = "live (psutil)"

    def __init__(self, pid: int | None = None) -> None:
        """`pid`: the process whose RSS and CPU are reported (default: this one)."""
        self._proc = psutil.Process(pid or os.getpid())
        self._stat_fd: int | None = None  # /proc/stat, kept open
        self._stat: tuple[int, int] | None = None  # (idle, total) jiffies at the last read
        psutil.cpu_percent(percpu=True)  # prime: the first call has no interval to compare with
        self._cpu_total()
        self._last_cpu = (time.monotonic(), sum(self._proc.cpu_times()[:2]))
        self.cores = psutil.cpu_count() or 1

    def read_fast(self) -> dict[str, Any]:
        return {"host_cpu_pct": self._cpu_total()}  # % of all cores since the last tick

    def _cpu_total(self) -> float | None:
        """Busy % of all cores since the last call, from /proc/stat's first line: one pread on a file
        kept open (~10 us on Linux; an open/read/close costs twice that); psutil.cpu_percent() elsewhere."""
        try:
            if self._stat_fd is None:
                self._stat_fd = os.open("/proc/stat", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            f = [int(x) for x in os.pread(self._stat_fd, 256, 0).split(b"\n", 1)[0].split()[1:9]]
        except (OSError, ValueError):
            return psutil.cpu_percent()
        idle, total = f[3] + f[4], sum(f)  # idle + iowait; user..steal
        last, self._stat = self._stat, (idle, total)
        if last is None or total <= last[1]:
            return None
        return 100.0 * (1 - (idle - last[0]) / (total - last[1]))

    def read_slow(self) -> dict[str, Any]:
        vm = psutil.virtual_memory()
        now = time.monotonic()
        try:
            cpu = sum(self._proc.cpu_times()[:2])
            rss = self._proc.memory_info().rss
        except psutil.Error:  # the monitored process is gone
            cpu, rss = None, None
        last_t, last_cpu = self._last_cpu
        if cpu is not None:
            self._last_cpu = (now, cpu)
        return {
            "host_cpu_per_core_pct": [round(x) for x in psutil.cpu_percent(percpu=True)],
            "host_mem_used_bytes": vm.total - vm.available,
            "host_mem_total_bytes": vm.total,
            "host_swap_used_bytes": psutil.swap_memory().used,
            "host_load1": os.getloadavg()[0],
            "proc_rss_bytes": rss,
            # % of one core, like top: 100 = one core busy
            "proc_cpu_pct": 100.0 * (cpu - last_cpu) / (now - last_t) if cpu is not None and now > last_t else None,
        }
