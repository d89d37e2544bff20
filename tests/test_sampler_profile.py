"""The tick profile (benchmarks/bench_sampler.py profile): off unless asked, and what it records."""

from __future__ import annotations

import json

from gpuwatch.telemetry import profile
from gpuwatch.telemetry.bus import Bus
from gpuwatch.telemetry.sampler import Sampler

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
