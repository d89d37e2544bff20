"""HostSampler's host_cpu_pct sources: the root cgroup's cpu.stat where it is the real root and agrees
with /proc/stat, else /proc/stat; fake files, fake clock."""

from __future__ import annotations

import os

import pytest

from gpuwatch.telemetry import host as host_mod
from gpuwatch.telemetry.host import HostSampler

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="Linux /proc only")

TCK = host_mod._CLK_TCK


def write_stat(path, cores: list[tuple[int, int]]) -> None:
    """A /proc/stat with the given per-core (busy, idle) jiffies: busy as user, idle as idle."""
    tot_b, tot_i = sum(b for b, _ in cores), sum(i for _, i in cores)
    lines = [f"cpu  {tot_b} 0 0 {tot_i} 0 0 0 0 0 0"]
    lines += [f"cpu{n} {b} 0 0 {i} 0 0 0 0 0 0" for n, (b, i) in enumerate(cores)]
    lines += ["intr 12345 0 0", "ctxt 99", "btime 1"]
    path.write_text("\n".join(lines) + "\n")


def write_cg(root, usage_us: int, namespace: bool = False) -> None:
    root.mkdir(exist_ok=True)
    (root / "cgroup.controllers").write_text("cpu io memory\n")
    if namespace:
        (root / "cgroup.type").write_text("domain\n")
    (root / "cpu.stat").write_text(f"usage_usec {usage_us}\nuser_usec 1\nsystem_usec 1\n")


class Clock:
    def __init__(self) -> None:
        self.ns = 1_000_000_000

    def __call__(self) -> int:
        return self.ns


def make(tmp_path, usage_us: int, busy_jiffies: int = 1000, namespace: bool = False, ncores: int = 4):
    stat = tmp_path / "stat"
    write_stat(stat, [(busy_jiffies // ncores, 5000)] * ncores)
    write_cg(tmp_path / "cg", usage_us, namespace)
    clock = Clock()
    h = HostSampler(proc_stat=str(stat), cgroup_root=str(tmp_path / "cg"), clock_ns=clock)
    return h, stat, clock


def test_root_cgroup_is_the_source_and_gives_busy_share_of_online_cores(tmp_path):
    busy_us = 1000 * 1_000_000 // TCK
    h, stat, clock = make(tmp_path, busy_us)
    assert h.cpu_source == str(tmp_path / "cg" / "cpu.stat")
    h.read_slow()  # 4 core lines: 4 online CPUs
    assert h._online == 4
    # 100 ms later, 200 ms of CPU busy over 4 cores = 50 %
    clock.ns += 100_000_000
    write_cg(tmp_path / "cg", busy_us + 200_000)
    assert h.read_fast()["host_cpu_pct"] == pytest.approx(50.0)
    clock.ns += 100_000_000
    write_cg(tmp_path / "cg", busy_us + 200_000 + 40_000)
    assert h.read_fast()["host_cpu_pct"] == pytest.approx(10.0)


def test_never_above_100_and_null_without_elapsed_time(tmp_path):
    busy_us = 1000 * 1_000_000 // TCK
    h, stat, clock = make(tmp_path, busy_us)
    h.read_slow()
    clock.ns += 100_000_000
    write_cg(tmp_path / "cg", busy_us + 500_000)  # accounting lag: more than 4 cores x 100 ms
    assert h.read_fast()["host_cpu_pct"] == 100.0
    assert h.read_fast()["host_cpu_pct"] is None  # no time elapsed


def test_a_namespaced_cgroup_is_not_the_host(tmp_path):
    h, stat, _ = make(tmp_path, 1000 * 1_000_000 // TCK, namespace=True)
    assert h.cpu_source == "/proc/stat"
    assert h._cg_fd is None


def test_a_cgroup_whose_total_disagrees_with_proc_stat_is_not_used(tmp_path):
    h, stat, _ = make(tmp_path, 1000 * 1_000_000 // TCK // 3)  # a third of the host's busy time
    assert h.cpu_source == "/proc/stat"


def test_no_cgroup_v2_means_proc_stat(tmp_path):
    stat = tmp_path / "stat"
    write_stat(stat, [(100, 5000)] * 2)
    h = HostSampler(proc_stat=str(stat), cgroup_root=str(tmp_path / "nothing"))
    assert h.cpu_source == "/proc/stat"
    write_stat(stat, [(150, 5050)] * 2)  # 50 busy of 100 jiffies per core
    assert h.read_fast()["host_cpu_pct"] == pytest.approx(50.0)


def test_cpu_stat_failing_falls_back_to_proc_stat(tmp_path):
    busy_us = 1000 * 1_000_000 // TCK
    h, stat, clock = make(tmp_path, busy_us)
    assert h._cg_fd is not None
    (tmp_path / "cg" / "cpu.stat").write_text("garbage\n")
    assert h.read_fast()["host_cpu_pct"] is None  # the switch: no interval to compare with yet
    assert h.cpu_source == str(stat) and h._cg_fd is None
    write_stat(stat, [(250 + 25, 5000 + 75)] * 4)
    assert h.read_fast()["host_cpu_pct"] == pytest.approx(25.0)


def test_cpu_stat_that_drifts_from_proc_stat_is_dropped_after_three_seconds(tmp_path):
    us_per_jiffy = 1_000_000 // TCK
    busy_j = 1000
    h, stat, clock = make(tmp_path, busy_j * us_per_jiffy)
    cg = tmp_path / "cg"
    h.read_slow()  # primes the check
    # in step: 100 busy jiffies a second on both
    for k in range(3):
        busy_j += 100
        write_stat(stat, [(busy_j // 4, 5000)] * 4)
        write_cg(cg, busy_j * us_per_jiffy)
        h.read_slow()
    assert h.cpu_source == str(cg / "cpu.stat")
    # cpu.stat leaves out half of what /proc/stat counts busy (e.g. steal): two seconds are tolerated...
    usage = busy_j * us_per_jiffy
    for k in range(3):
        busy_j += 100
        usage += 50 * us_per_jiffy
        write_stat(stat, [(busy_j // 4, 5000)] * 4)
        write_cg(cg, usage)
        h.read_slow()
        assert h.cpu_source == (str(cg / "cpu.stat") if k < 2 else str(stat))
    assert h._cg_fd is None
    assert h.read_fast()["host_cpu_pct"] is None  # the switch: /proc/stat has no earlier reading
