"""The tick profile (benchmarks/bench_sampler.py profile): off unless asked, and what it records."""

from __future__ import annotations

import json

from gpuwatch.telemetry.bus import Bus
from gpuwatch.telemetry.sampler import Sampler

from support import sampler_profile as profile
from support.fake_nvml import FakeDriver
from test_sampler import FakeTime, SlowHost


def test_off_unless_the_environment_asks(monkeypatch):
    monkeypatch.delenv(profile.ENV, raising=False)
    assert profile.from_env() is None
    s = Sampler(Bus(), None, None)
    assert "tick" not in vars(s) and "slow_tick" not in vars(s)  # nothing wrapped in a normal run


def test_sections_per_iteration_nested_by_path(tmp_path, monkeypatch):
    monkeypatch.setenv(profile.ENV, str(tmp_path / "p.json"))
    prof = profile.from_env()
    ft = FakeTime(stop_after=25)
    bus = Bus()
    s = Sampler(bus, None, SlowHost(ft, {}), interval=0.1, clock=ft.clock, wait=ft.wait)
    prof.instrument(s)
    s.run(slow_inline=True)
    prof.dump()
    raw = json.loads((tmp_path / "p.json").read_text())
    its = raw["iterations"]
    assert len(its) == 24  # the first wake-up only starts the clock
    assert {"tick", "tick/host.read_fast", "wake"} <= set(its[0][3])
    assert sum("slow" in it[3] for it in its) == 2 and len(raw["slow"]) == 2
    assert all(not p.startswith("slow/") for it in its for p in it[3])
    assert "slow/host.read_slow" in raw["slow"][0][1]
    assert raw["calibration"]["timer_cpu_ns_per_section"] > 0
    assert len(bus.ticks) == 25  # the sampler still did its work


def test_the_slow_read_splits_pcie_counters_and_energy(tmp_path, monkeypatch):
    import pynvml

    from gpuwatch.telemetry import nvml

    tx, rx = nvml.PCIE_COUNTERS
    if tx is None:
        import pytest
        pytest.skip("this pynvml has no PCIe counter fields")
    driver = FakeDriver(monkeypatch)
    driver.fields = {tx: 1000, rx: 2000, pynvml.NVML_FI_DEV_POWER_AVERAGE: 350_000}
    # the profile wraps module state of nvml: put it back after this test
    monkeypatch.setattr(nvml, "read_pcie_counters", nvml.read_pcie_counters)
    for k, fn in {**nvml.ENERGY, **nvml.LEGACY_PCIE}.items():
        monkeypatch.setitem(nvml.ENERGY if k in nvml.ENERGY else nvml.LEGACY_PCIE, k, fn)
    monkeypatch.setenv(profile.ENV, str(tmp_path / "p.json"))
    prof = profile.from_env()
    b = nvml.NvmlBackend()
    s = Sampler(Bus(), b, None)
    prof.instrument(s)
    s.slow_tick()
    prof.dump()
    slow = json.loads((tmp_path / "p.json").read_text())["slow"][0][1]
    assert {"slow/gpu0.read_slow/pcie_counters", "slow/gpu0.read_slow/gpu_energy_mj",
            "slow/gpu1.read_slow/pcie_counters"} <= set(slow)


def test_without_a_c_compiler_the_profiled_child_gets_the_python_fake_nvml(py, env, tmp_path):
    import os
    import subprocess

    from conftest import ROOT

    code = ("from support import sampler_profile\n"
            "from gpuwatch.telemetry.nvml import NvmlBackend\n"
            "assert sampler_profile.from_env() is not None\n"
            "b = NvmlBackend()\n"
            "print(len(b.gpus), b.gpus[0].name, b.read_fast(0)['gpu_util_pct'])\n")
    e = dict(env, PYTHONPATH=str(ROOT / "tests") + os.pathsep + env["PYTHONPATH"],
             GPUWATCH_SAMPLER_PROFILE=str(tmp_path / "p.json"), GPUWATCH_SAMPLER_PROFILE_FAKE_NVML="3")
    r = subprocess.run([py, "-c", code], env=e, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["3", "fake", "H200", "97"]
