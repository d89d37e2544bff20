"""The pynvml boundary, driven by raising the real pynvml.NVMLError_* classes."""

from __future__ import annotations

import types

import pynvml
import pytest

from gpuwatch.errors import UsageError
from gpuwatch.telemetry import nvml
from gpuwatch.telemetry.bus import Bus
from gpuwatch.telemetry.sampler import Sampler

from support.fake_nvml import FakeDriver, FakeLib


@pytest.fixture(params=["wrappers", "direct"])
def driver(monkeypatch, request):
    d = FakeDriver(monkeypatch)
    if request.param == "direct":
        FakeLib(monkeypatch)
    d.path = request.param
    return d


def test_reads_every_field_in_schema_units(driver):
    b = nvml.NvmlBackend()
    assert (b.direct(0) is not None) == (driver.path == "direct")
    row = b.read_fast(0)
    assert row["gpu_util_pct"] == 97 and row["gpu_mem_util_pct"] == 40
    assert row["gpu_mem_used_bytes"] == 10 * 2**30 and row["gpu_mem_total_bytes"] == 141 * 2**30
    assert row["gpu_mem_reserved_bytes"] == 615 * 2**20 and b.memory_api == "v2"
    assert row["gpu_power_w"] == 350.0 and row["gpu_power_limit_w"] == 700.0
    assert row["gpu_temp_slowdown_c"] == 89 and row["gpu_clocks_event_reasons"] == 4
    assert row["gpu_procs"] == [{"pid": 42, "used_bytes": 2**30}]
    slow = b.read_slow(0)  # field values unsupported -> the legacy calls
    assert slow == {"gpu_pcie_tx_bytes_per_s": 100 * 1024, "gpu_pcie_rx_bytes_per_s": 100 * 1024, "gpu_energy_mj": 5000}


def test_only_the_gpus_asked_for_are_sampled_under_their_nvml_index(driver):
    """`gpuwatch record --gpus 1`: GPU 1 alone is opened and read, and its rows and info keep index 1."""
    b = nvml.NvmlBackend(only=[1])
    assert [(g.index, g.uuid) for g in b.gpus] == [(1, "GPU-1")]
    assert list(b.counters) == [1] and (b.direct(1) is not None) == (driver.path == "direct")
    rows = Sampler(Bus(), b, None).tick().rows
    assert [(r["gpu"], r["gpu_util_pct"]) for r in rows] == [(1, 97)]
    assert [g.index for g in nvml.NvmlBackend(only=[1, 0, 1]).gpus] == [1, 0]  # as given, each once


def test_a_gpu_asked_for_that_is_not_there_is_a_usage_error(driver):
    with pytest.raises(UsageError, match=r"^no GPU 5 here \(GPU indices present: 0, 1\)$"):
        nvml.NvmlBackend(only=[0, 5])


def test_not_supported_is_null_and_not_asked_again(driver):
    b = nvml.NvmlBackend()
    driver.power_error = pynvml.NVMLError_NotSupported
    assert "gpu_power_w" not in b.read_fast(0)
    assert "gpu_ecc_corrected" not in b.read_fast(0)  # ECC unsupported from the start
    assert driver.calls["power"] == 1  # skipped on the second read


def test_transient_error_is_null_for_one_tick(driver):
    b = nvml.NvmlBackend()
    driver.power_error = pynvml.NVMLError_Timeout
    assert "gpu_power_w" not in b.read_fast(0)
    driver.power_error = None
    assert b.read_fast(0)["gpu_power_w"] == 350.0


def test_gpu_lost_becomes_event_and_other_gpus_keep_sampling(driver):
    bus = Bus()
    b = nvml.NvmlBackend()
    s = Sampler(bus, b, None)
    assert [r["gpu"] for r in s.tick().rows] == [0, 1]
    driver.lost.add(1)
    rows = s.tick().rows
    assert [r["gpu"] for r in rows] == [0]
    lost = [e for e in bus.events.latest(10) if e.kind == "gpu_lost"]
    assert len(lost) == 1 and lost[0].gpu == 1 and lost[0].severity == "error"
    assert [r["gpu"] for r in s.tick().rows] == [0]  # and it is not reported again
    assert len([e for e in bus.events.latest(10) if e.kind == "gpu_lost"]) == 1


@pytest.mark.parametrize("err", ["NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded"])
def test_no_driver_means_cpu_only(monkeypatch, err):
    def boom():
        raise getattr(pynvml, err)()
    monkeypatch.setattr(pynvml, "nvmlInit", boom)
    with pytest.raises(nvml.NvmlUnavailable):
        nvml.NvmlBackend()
    from gpuwatch.runtime import Session, SessionConfig

    s = Session(SessionConfig(sampler="thread"))
    assert s.gpu is None and "CPU-only" in s.gpu_note
    assert [e.kind for e in s.bus.events.latest(5)] == ["no_gpu"]
    assert s.sampler.tick().rows[0]["gpu"] is None


def test_xid_watch_not_supported_is_said_once(driver):
    b = nvml.NvmlBackend()
    import threading

    why = b.watch_xid(threading.Event(), lambda g, x: None)
    assert why and "not available" in why
    assert nvml.NvmlBackend().probe(0)["xid_events"].startswith("null")


# -- memory v2 / v1, and the batched field values ------------------------------------------------------------

def test_memory_v2_where_the_driver_has_it_else_v1_with_reserved_null(driver):
    b = nvml.NvmlBackend()
    assert b.memory_api == "v2" and b.read_fast(0)["gpu_mem_used_bytes"] == 10 * 2**30
    assert b.probe(0)["memory api"].startswith("v2")
    driver.mem_v2 = False  # an older driver: no nvmlDeviceGetMemoryInfo_v2
    b = nvml.NvmlBackend()
    row = b.read_fast(0)
    assert b.memory_api == "v1" and b.probe(0)["memory api"].startswith("v1")
    assert row["gpu_mem_used_bytes"] == 10 * 2**30 + 615 * 2**20 and "gpu_mem_reserved_bytes" not in row
    v2_calls = driver.calls["mem_v2"]
    b.read_fast(0)
    assert driver.calls["mem_v2"] == v2_calls  # decided once, not retried every tick


def test_memory_v2_on_a_pynvml_without_the_version_argument_is_v1(driver, monkeypatch):
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo",
                        lambda h: types.SimpleNamespace(used=5, total=10))  # old pynvml signature
    b = nvml.NvmlBackend()
    assert b.memory_api == "v1" and b.read_fast(0)["gpu_mem_used_bytes"] == 5


FI = {"power": pynvml.NVML_FI_DEV_POWER_AVERAGE, "sbe": pynvml.NVML_FI_DEV_ECC_SBE_VOL_TOTAL,
      "dbe": pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL}


def test_batched_field_values_replace_three_calls_with_one(driver):
    driver.fields = {FI["power"]: 351_500, FI["sbe"]: 3, FI["dbe"]: 0}
    b = nvml.NvmlBackend()
    power_calls, field_calls = driver.calls["power"], driver.calls["fields"]
    row = b.read_fast(0)
    assert row["gpu_power_w"] == 351.5 and row["gpu_ecc_corrected"] == 3 and row["gpu_ecc_uncorrected"] == 0
    assert driver.calls["power"] == power_calls  # nvmlDeviceGetPowerUsage no longer asked
    assert driver.calls["fields"] == field_calls + 1  # one call for the three fields
    assert "ok: gpu_power_w" in b.probe(0)["field values (one call)"]


def test_a_batched_field_not_supported_is_null_and_remembered(driver):
    driver.fields = {FI["power"]: 350_000, FI["sbe"]: ("ret", pynvml.NVML_ERROR_NOT_SUPPORTED),
                     FI["dbe"]: ("ret", pynvml.NVML_ERROR_NOT_SUPPORTED)}
    b = nvml.NvmlBackend()  # the probe at start already drops the unsupported ECC fields
    assert b.batched_fields(0) == ["gpu_power_w"]
    driver.fields[FI["power"]] = ("ret", pynvml.NVML_ERROR_NOT_SUPPORTED)  # stops answering later
    row = b.read_fast(0)
    assert "gpu_power_w" not in row and "gpu_ecc_corrected" not in row
    assert b.batched_fields(0) == []
    calls = driver.calls["fields"]
    b.read_fast(0)
    assert driver.calls["fields"] == calls  # nothing left to ask: no call at all
    assert driver.calls["power"] == 0  # and the legacy call is not used for a field the batch covers


def test_a_transient_batched_field_error_is_null_for_one_tick(driver):
    driver.fields = {FI["power"]: 350_000, FI["sbe"]: 0, FI["dbe"]: 0}
    b = nvml.NvmlBackend()
    driver.fields[FI["power"]] = ("ret", pynvml.NVML_ERROR_TIMEOUT)
    assert "gpu_power_w" not in b.read_fast(0)
    driver.fields[FI["power"]] = 350_000
    assert b.read_fast(0)["gpu_power_w"] == 350.0


def test_field_values_unsupported_falls_back_to_the_legacy_calls(driver):
    b = nvml.NvmlBackend()  # driver.fields None: the call is not supported
    assert b.batched_fields(0) is None and b.read_fast(0)["gpu_power_w"] == 350.0
    assert b.probe(0)["field values (one call)"].startswith("not available")


def test_gpu_lost_inside_the_batched_call_is_gpu_lost(driver):
    driver.fields = {FI["power"]: 350_000, FI["sbe"]: 0, FI["dbe"]: 0}
    b = nvml.NvmlBackend()
    driver.fields[FI["power"]] = ("ret", pynvml.NVML_ERROR_GPU_IS_LOST)
    with pytest.raises(nvml.GpuLost):
        b.read_fast(1)
    assert 1 in b.lost


def test_many_processes_and_unknown_memory_in_one_tick(driver, monkeypatch):
    """More processes than the direct reader's array holds: it grows and asks again within the tick;
    a process whose memory NVML cannot say is null (both paths)."""
    procs = [types.SimpleNamespace(pid=100 + k, usedGpuMemory=None if k == 3 else k * 2**20) for k in range(40)]
    monkeypatch.setattr(pynvml, "nvmlDeviceGetComputeRunningProcesses", lambda h: procs)
    b = nvml.NvmlBackend()
    for _ in range(2):
        got = b.read_fast(0)["gpu_procs"]
        assert len(got) == 40 and got[3] == {"pid": 103, "used_bytes": None}
        assert got[5] == {"pid": 105, "used_bytes": 5 * 2**20}
    monkeypatch.setattr(pynvml, "nvmlDeviceGetComputeRunningProcesses", lambda h: [])
    assert b.read_fast(0)["gpu_procs"] == []


def test_field_values_call_gone_mid_run_falls_back_to_single_calls(driver):
    driver.fields = {FI["power"]: 351_500, FI["sbe"]: 3, FI["dbe"]: 0}
    b = nvml.NvmlBackend()
    assert b.read_fast(0)["gpu_power_w"] == 351.5
    driver.fields = None  # the driver stops answering the call at all
    b.read_fast(0)
    row = b.read_fast(0)
    assert b.batched_fields(0) is None and row["gpu_power_w"] == 350.0  # nvmlDeviceGetPowerUsage from now on
    assert (b.direct(0) is not None) == (driver.path == "direct")


@pytest.mark.parametrize("every", [None, "1", "3"])
def test_pcie_counters_read_every_n_slow_ticks(driver, monkeypatch, every):
    """Default: every 2 s (the read costs ~1 ms of driver CPU on an H200); GPUWATCH_PCIE_EVERY=N overrides."""
    tx, rx = nvml.PCIE_COUNTERS
    if tx is None:
        pytest.skip("this pynvml has no PCIe counter fields")
    if every is None:
        monkeypatch.delenv(nvml.PCIE_EVERY_ENV, raising=False)
    else:
        monkeypatch.setenv(nvml.PCIE_EVERY_ENV, every)
    driver.fields = {tx: 1000, rx: 2000}
    b = nvml.NvmlBackend()
    assert b.counters == {0: True, 1: True} and not b.slow_blocks
    reads = []
    for k in range(5):
        driver.fields = {tx: 1000 + 100 * k, rx: 2000 + 200 * k}
        before = driver.calls["fields"]
        slow = b.read_slow(0)
        reads.append(driver.calls["fields"] > before)
        if k and reads[-1]:
            assert slow["gpu_pcie_tx_bytes_per_s"] > 0 and slow["gpu_pcie_rx_bytes_per_s"] > 0
        if not reads[-1]:  # absent: the sampler carries the last rate
            assert "gpu_pcie_tx_bytes_per_s" not in slow
    want = {None: [True, False, True, False, True], "1": [True] * 5, "3": [True, False, False, True, False]}[every]
    assert reads == want


# -- per-process utilization (issue 17: the process panel's SM% and MEM%) ------------------------------
def test_process_utilization_is_the_mean_of_the_samples_since_the_last_read(driver):
    b = nvml.NvmlBackend()
    assert b.read_proc_util(0) == {42: (55, 20)} and b.read_proc_util(1) == {42: (35, 10)}
    assert b.read_proc_util(0) == {42: (55, 20)}  # the next second: only the new samples
    assert driver.calls["proc_util"] == 3


def test_process_utilization_not_found_is_no_sample_and_asked_again(driver):
    """NVML_ERROR_NOT_FOUND (no process ran a kernel since the last read) is a value - no sample - not an
    unsupported field: the next read asks again (the other fields' rule would stop asking for good)."""
    b = nvml.NvmlBackend()
    driver.proc_util = {}
    assert b.read_proc_util(0) == {} and b.read_proc_util(0) == {}
    assert driver.calls["proc_util"] == 2
    driver.proc_util = {0: [(7, 80, 30)]}
    assert b.read_proc_util(0) == {7: (80, 30)}


@pytest.mark.parametrize("err", ["NVMLError_NotSupported", "NVMLError_NoPermission", "NVMLError_FunctionNotFound"])
def test_process_utilization_not_supported_is_null_and_not_asked_again(driver, err):
    b = nvml.NvmlBackend()
    driver.proc_util = getattr(pynvml, err)
    assert b.read_proc_util(0) is None and b.read_proc_util(0) is None
    assert driver.calls["proc_util"] == 1
    driver.proc_util = {1: [(42, 35, 10)]}
    assert b.read_proc_util(1) == {42: (35, 10)}  # remembered per GPU


def test_process_utilization_transient_error_is_null_once_and_lost_gpu_raises(driver):
    b = nvml.NvmlBackend()
    driver.proc_util = pynvml.NVMLError_Timeout
    assert b.read_proc_util(0) is None
    driver.proc_util = {0: [(42, 55, 20)]}
    assert b.read_proc_util(0) == {42: (55, 20)}
    driver.lost.add(0)
    with pytest.raises(nvml.GpuLost):
        b.read_proc_util(0)


def _sampler(lookups: list[int]) -> tuple[Sampler, Bus]:
    from gpuwatch.telemetry.procs import ProcInfo

    bus = Bus()
    s = Sampler(bus, nvml.NvmlBackend(), None)
    assert s.procinfo is not None  # live NVML: the sampler adds utilization, user and command
    s.procinfo = ProcInfo(lambda pid: (lookups.append(pid), ("alice", f"python train.py --pid {pid}"))[1])
    return s, bus


def test_sampler_adds_utilization_user_and_command_to_each_process_once_a_second(driver):
    lookups: list[int] = []
    s, _ = _sampler(lookups)
    s.slow_tick()  # at start: no process seen yet
    assert s.tick().rows[0]["gpu_procs"] == [{"pid": 42, "used_bytes": 2**30}]  # the first second: NVML's alone
    s.slow_tick()
    for _ in range(3):
        rows = s.tick().rows
        assert rows[0]["gpu_procs"] == [{"pid": 42, "used_bytes": 2**30, "sm_util_pct": 55, "mem_util_pct": 20,
                                         "user": "alice", "command": "python train.py --pid 42"}]
        assert rows[1]["gpu_procs"][0]["sm_util_pct"] == 35 and rows[1]["gpu_procs"][0]["mem_util_pct"] == 10
    s.slow_tick()
    s.tick()
    assert lookups == [42]  # user and command: looked up once per PID, not every second
    assert driver.calls["proc_util"] == 2 * 2  # once a second per GPU listing a process, never per tick


def test_sampler_process_without_samples_is_0_and_unsupported_utilization_is_null(driver):
    s, _ = _sampler([])
    s.tick()
    driver.proc_util = {}  # NOT_FOUND: the processes ran no kernel
    s.slow_tick()
    p = s.tick().rows[0]["gpu_procs"][0]
    assert (p["sm_util_pct"], p["mem_util_pct"], p["user"]) == (0, 0, "alice")
    driver.proc_util = pynvml.NVMLError_NotSupported
    s.slow_tick()
    p = s.tick().rows[0]["gpu_procs"][0]
    assert (p["sm_util_pct"], p["mem_util_pct"], p["user"]) == (None, None, "alice")


def test_user_and_command_of_a_real_process(driver, monkeypatch):
    """The default lookup (psutil) names this test's own process; a PID nobody has is null, not an error."""
    import os

    from gpuwatch.telemetry.procs import ProcInfo

    monkeypatch.setattr(pynvml, "nvmlDeviceGetComputeRunningProcesses",
                        lambda h: [types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=1),
                                   types.SimpleNamespace(pid=2**22 + 7, usedGpuMemory=2)])
    s = Sampler(Bus(), nvml.NvmlBackend(), None)
    assert isinstance(s.procinfo, ProcInfo)
    s.tick()
    s.slow_tick()
    mine, nobody = s.tick().rows[0]["gpu_procs"]
    assert mine["user"] and ("python" in mine["command"].lower() or "pytest" in mine["command"])
    assert nobody["user"] is None and nobody["command"] is None
