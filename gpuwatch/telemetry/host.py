"""Host telemetry through psutil: CPU (total and per core), memory, swap, load, and the monitored process.

Only total CPU is read every tick. `host_cpu_pct` is the busy share of all online cores since the last
tick: busy = user + nice + system + irq + softirq + steal (iowait counts as idle), the columns of
/proc/stat's first line. The kernel builds all of /proc/stat for any read of it, its per-IRQ sums
included (each IRQ summed over every CPU: the larger the host, the dearer), so where the host's *root*
cgroup (v2) is what /sys/fs/cgroup shows, the same busy time is read from its cpu.stat instead
(`usage_usec`: the kernel sums the same per-CPU counters, user + nice + system + irq + softirq + steal,
in microseconds), over the wall time elapsed times the online cores. That source is used only where it
is the real root (no `cgroup.type` file there: a container's cgroup namespace shows its own cgroup,
which has one), while its total since boot agrees with /proc/stat's at start-up, and while each second's
busy time agrees with /proc/stat's first line (which the 1 Hz per-core read reads anyway); anything
else, or any error, reads /proc/stat as before (`cpu_source` says which).

Per-core CPU, memory, swap, load and the process's RSS and CPU are read on the slow thread (1 Hz), on
Linux by pread of /proc/meminfo, /proc/stat and /proc/<pid>/stat kept open (psutil's calls for the same
columns cost 200-450 us; it remains the fallback elsewhere); rows in between repeat the last reading.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import psutil


CGROUP_ROOT = "/sys/fs/cgroup"


def _usage_us(data: bytes) -> int:
    """usage_usec from a cgroup v2 cpu.stat (its first line)."""
    key, value = data.split(b"\n", 1)[0].split()
    if key != b"usage_usec":
        raise ValueError(f"cpu.stat starts with {key!r}")
    return int(value)


class HostSampler:
    label = "live (psutil)"

    def __init__(self, pid: int | None = None, proc_stat: str = "/proc/stat", cgroup_root: str | None = CGROUP_ROOT,
                 clock_ns: Callable[[], int] = time.monotonic_ns) -> None:
        """`pid`: the process whose RSS and CPU are reported (default: this one). `proc_stat`, `cgroup_root`
        (None: never the cgroup source) and `clock_ns` are for tests."""
        self._proc = psutil.Process(pid or os.getpid())
        self._proc_stat = proc_stat
        self._stat_fd: int | None = None  # /proc/stat, kept open
        self._stat: tuple[int, int] | None = None  # (idle, total) jiffies at the last read
        self._clock_ns = clock_ns
        self._cg_fd: int | None = None  # the root cgroup's cpu.stat, kept open (None: /proc/stat is the source)
        self._cg: tuple[int, int] | None = None  # (usage us, clock ns) at the last read
        self._cg_check: tuple[int, int] | None = None  # (/proc/stat busy us, usage us) at the last slow read
        self._cg_bad = 0  # slow reads in a row where the two disagreed
        self._online = os.sysconf("SC_NPROCESSORS_ONLN") if hasattr(os, "sysconf") else (psutil.cpu_count() or 1)
        self.cpu_source = "/proc/stat"
        psutil.cpu_percent(percpu=True)  # prime: the first call has no interval to compare with
        self._cpu_total()
        if cgroup_root is not None:
            self._open_cgroup(cgroup_root)
        self._last_cpu = (time.monotonic(), sum(self._proc.cpu_times()[:2]))
        self.cores = psutil.cpu_count() or 1
        self._fds: dict[str, int] = {}  # /proc files kept open for the slow read
        self._cores: list[tuple[int, int]] | None = None  # per-core (idle, total) jiffies at the last slow read
        self._proc_ok = os.path.exists("/proc/meminfo")
        if self._proc_ok:
            try:
                self._read_slow_proc()  # prime the per-core and process deltas
            except (OSError, ValueError, IndexError, KeyError):
                self._proc_ok = False

    def read_fast(self) -> dict[str, Any]:
        # % of all cores since the last tick
        return {"host_cpu_pct": self._cpu_total() if self._cg_fd is None else self._cpu_cgroup()}

    def raw_source(self) -> tuple[int, int] | None:
        """(fd, bytes) that read_fast preads, for the C ticker (gpuwatch/telemetry/ticker.py) to read in
        its place; None where it has no file open (psutil)."""
        if self._cg_fd is not None:
            return self._cg_fd, 128
        return (self._stat_fd, 256) if self._stat_fd is not None else None

    def decode_fast(self, fd: int, data: bytes | None, now_ns: int) -> dict[str, Any]:
        """read_fast's columns from what the C ticker read from `fd` at monotonic `now_ns` (data None: the
        read failed). Where the source changed since (fd is no longer the one read), a read now."""
        if fd == self._cg_fd:
            return {"host_cpu_pct": self._cpu_cgroup(data, now_ns) if data is not None else self._cpu_cgroup()}
        if fd == self._stat_fd and self._cg_fd is None and data is not None:
            return {"host_cpu_pct": self._cpu_total(data)}
        return self.read_fast()

    def _open_cgroup(self, root: str) -> None:
        """Use `root`/cpu.stat for host_cpu_pct if `root` is the real root cgroup (v2) and its busy time
        since boot agrees with /proc/stat's (within 2 % and 10 ms per core and column)."""
        fd = None
        try:
            if (not os.path.exists(os.path.join(root, "cgroup.controllers"))  # not cgroup v2
                    or os.path.exists(os.path.join(root, "cgroup.type"))):  # not the root: a namespace's cgroup
                return
            fd = os.open(os.path.join(root, "cpu.stat"), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            usage = _usage_us(os.pread(fd, 128, 0))
            f = [int(x) for x in self._pread_stat(256).split(b"\n", 1)[0].split()[1:9]]
        except (OSError, ValueError, IndexError):
            if fd is not None:
                os.close(fd)
            return
        busy = (sum(f) - f[3] - f[4]) * 1_000_000 // _CLK_TCK  # user nice system irq softirq steal, us
        if abs(usage - busy) > 0.02 * max(usage, busy) + 6 * 10_000 * self._online:
            os.close(fd)
            return
        self._cg_fd, self._cg = fd, (usage, self._clock_ns())
        self.cpu_source = os.path.join(root, "cpu.stat")

    def _cpu_cgroup(self, data: bytes | None = None, now: int | None = None) -> float | None:
        """Busy % of all online cores since the last call, from the root cgroup's usage_usec: one pread of
        a file kept open (or `data` read at `now` by the C ticker); /proc/stat from now on if it fails."""
        fd = self._cg_fd
        try:
            usage = _usage_us(os.pread(fd, 128, 0) if data is None else data)
        except (OSError, ValueError, IndexError, TypeError):
            self._drop_cgroup(fd)
            return self._cpu_total()
        if now is None:
            now = self._clock_ns()
        (u0, t0), self._cg = self._cg, (usage, now)
        if now <= t0 or usage < u0:
            return None
        return min(100.0, 100_000.0 * (usage - u0) / ((now - t0) * self._online))

    def _drop_cgroup(self, fd: int | None) -> None:
        """/proc/stat is host_cpu_pct's source from now on (its first reading after the switch is null)."""
        if fd is None or self._cg_fd != fd:
            return
        self._cg_fd, self.cpu_source = None, self._proc_stat
        self._stat = None
        try:
            os.close(fd)
        except OSError:
            pass

    def _check_cgroup(self, first_line: bytes) -> None:
        """At each slow read: the busy time since the last one by cpu.stat against /proc/stat's first line
        (read for the per-core columns anyway). Three seconds in a row apart by more than 60 ms + 5 %
        (/proc/stat counts in 10 ms steps), e.g. a kernel whose usage_usec leaves out steal time while
        the host is being stolen from: /proc/stat from then on."""
        fd = self._cg_fd
        try:
            f = list(map(int, first_line.split()[1:9]))
            usage = _usage_us(os.pread(fd, 128, 0))
        except (OSError, ValueError, IndexError, TypeError):
            return  # the fast read notices a broken cpu.stat
        busy = (sum(f) - f[3] - f[4]) * 1_000_000 // _CLK_TCK
        last, self._cg_check = self._cg_check, (busy, usage)
        if last is None:
            return
        db, du = busy - last[0], usage - last[1]
        if abs(du - db) <= 60_000 + 0.05 * max(db, du):
            self._cg_bad = 0
            return
        self._cg_bad += 1
        if self._cg_bad >= 3:
            self._drop_cgroup(fd)

    def _pread_stat(self, size: int) -> bytes:
        if self._stat_fd is None:
            self._stat_fd = os.open(self._proc_stat, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        return os.pread(self._stat_fd, size, 0)

    def _cpu_total(self, data: bytes | None = None) -> float | None:
        """Busy % of all cores since the last call, from /proc/stat's first line: one pread on a file
        kept open (~10 us on Linux; an open/read/close costs twice that), or `data` (the C ticker's pread);
        psutil.cpu_percent() elsewhere."""
        try:
            f = [int(x) for x in (self._pread_stat(256) if data is None else data).split(b"\n", 1)[0].split()[1:9]]
        except (OSError, ValueError):
            return psutil.cpu_percent()
        idle, total = f[3] + f[4], sum(f)  # idle + iowait; user..steal
        last, self._stat = self._stat, (idle, total)
        if last is None or total <= last[1]:
            return None
        return 100.0 * (1 - (idle - last[0]) / (total - last[1]))

    def read_slow(self) -> dict[str, Any]:
        """1 Hz: per-core CPU, memory, swap, load, the process's RSS and CPU. On Linux from /proc directly
        (three preads on files kept open: ~60 us; psutil reads /proc/meminfo twice and all of /proc/vmstat
        for the same columns, ~200-450 us), else through psutil."""
        if self._proc_ok:
            try:
                return self._read_slow_proc()
            except (OSError, ValueError, IndexError, KeyError):
                self._proc_ok = False  # e.g. not Linux after all: psutil from now on
        return self.read_slow_psutil()

    def _pread(self, name: str, path: str, size: int) -> bytes:
        fd = self._fds.get(name)
        if fd is None:
            fd = self._fds[name] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        return os.pread(fd, size, 0)

    def _read_slow_proc(self) -> dict[str, Any]:
        now = time.monotonic()
        mem: dict[bytes, int] = {}
        for line in self._pread("meminfo", "/proc/meminfo", 8192).split(b"\n"):
            key, _, rest = line.partition(b":")
            if key in _MEMINFO:
                mem[key] = int(rest.split()[0]) * 1024
        total, avail = mem[b"MemTotal"], mem[b"MemAvailable"]
        cores = []
        lines = self._pread("stat", self._proc_stat, 65536).split(b"\n")
        if self._cg_fd is not None:
            self._check_cgroup(lines[0])
        for line in lines[1:]:
            if not line.startswith(b"cpu"):
                break
            f = list(map(int, line.split()[1:9]))
            cores.append((f[3] + f[4], sum(f)))
        if cores:
            self._online = len(cores)  # the online CPUs (/proc/stat lists those): host_cpu_pct's denominator
        last, self._cores = self._cores, cores
        per_core = [round(100.0 * (1 - (c[0] - l[0]) / (c[1] - l[1]))) if c[1] > l[1] else 0
                    for c, l in zip(cores, last or cores)] if last and len(last) == len(cores) else [0] * len(cores)
        try:
            st = self._pread("pid", f"/proc/{self._proc.pid}/stat", 2048)
            f = st[st.rindex(b")") + 2:].split()  # fields from the 3rd on (state = f[0])
            cpu = (int(f[11]) + int(f[12])) / _CLK_TCK  # utime + stime
            rss = int(f[21]) * _PAGE
        except (OSError, ValueError, IndexError):  # the monitored process is gone
            cpu, rss = None, None
        last_t, last_cpu = self._last_cpu
        if cpu is not None:
            self._last_cpu = (now, cpu)
        return {
            "host_cpu_per_core_pct": per_core,
            "host_mem_used_bytes": total - avail,
            "host_mem_total_bytes": total,
            "host_swap_used_bytes": mem[b"SwapTotal"] - mem[b"SwapFree"],
            "host_load1": os.getloadavg()[0],
            "proc_rss_bytes": rss,
            "proc_cpu_pct": 100.0 * (cpu - last_cpu) / (now - last_t) if cpu is not None and now > last_t else None,
        }

    def read_slow_psutil(self) -> dict[str, Any]:
        """`read_slow` through psutil: the path where /proc cannot be read directly (not Linux)."""
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


_MEMINFO = frozenset((b"MemTotal", b"MemAvailable", b"SwapTotal", b"SwapFree"))
try:
    _CLK_TCK = os.sysconf("SC_CLK_TCK")
    _PAGE = os.sysconf("SC_PAGE_SIZE")
except (ValueError, OSError, AttributeError):  # not POSIX: the /proc path is never taken
    _CLK_TCK, _PAGE = 100, 4096
