"""The held-out scenario generator (benchmarks/heldout_gen.py, issue 29): a plan is a function of its seed
alone, its commands are ones the CLI accepts, and its waves fit the card."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _gen():
    spec = importlib.util.spec_from_file_location("heldout_gen", ROOT / "benchmarks" / "heldout_gen.py")
    m = importlib.util.module_from_spec(spec)
    sys.modules["heldout_gen"] = m
    spec.loader.exec_module(m)
    return m


G = _gen()


def test_a_plan_is_its_seed_alone():
    a, b, c = G.draw(11, 16), G.draw(11, 16), G.draw(12, 16)
    assert [x.args for x in a] == [x.args for x in b]
    assert [x.args for x in a] != [x.args for x in c]
    assert [x.args for x in G.draw(11, 8)] == [x.args for x in a[:8]]  # a scenario is (seed, index) alone


def test_the_plan_covers_both_families_and_the_growths():
    sc = [s for seed in range(4) for s in G.draw(seed, 16)]
    assert {s.family for s in sc} == {"stress", "loop"}
    assert {"ramp", "leak", "randlen", "none", "curriculum", "cache", "graphpool"} <= {s.growth for s in sc}
    assert {a for s in sc if s.family == "stress" for a in s.args} >= {"v2-lite", "v3-slice", "small", "decode", "train", "prefill"}
    for s in sc:
        assert 0.3 < s.target < 1.7
        assert s.family == "loop" or s.calib_args[:4] == s.args[:4]  # calibrated at its own preset and mode


def test_stress_commands_parse_with_the_cli():
    from gpuwatch.cli.parser import build_parser

    p = build_parser()
    for s in G.draw(5, 24) + G.draw(5, 8, dry=True):
        if s.family == "stress":
            ns = p.parse_args(["stress", *s.args, "--gpu-memory-limit", "8GiB", "--guard", "off", "--duration", "60s"])
            assert ns.guard == "off"
            p.parse_args(["stress", *s.calib_args, "--steps", "4"])


@pytest.mark.parametrize("budget", [40.0, 132.0])
def test_waves_fit_the_budget_and_keep_every_scenario(budget):
    sc = G.draw(3, 20)
    ws = G.waves(sc, budget)
    assert sorted(s.name for w in ws for s in w) == sorted(s.name for s in sc)
    for w in ws:
        assert len(w) == 1 or sum(s.slot_gib for s in w) <= budget


def test_the_dry_run_uses_the_tiny_preset_and_no_cuda_graphs():
    sc = G.draw(2, 20, dry=True)
    assert all(s.args[1] == "tiny" for s in sc if s.family == "stress")
    assert all(s.growth != "graphpool" for s in sc)


def test_the_runner_fits_the_deadline_and_says_which_waves_it_skipped(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(G, "_guarded", lambda s, out, secs, dry, r: ran.append((s.name, secs)))
    monkeypatch.setattr(G, "_smi_log", lambda path, stop: None)
    monkeypatch.setattr(G.time, "sleep", lambda s: None)  # the 2 s between starts on the GPU
    sc = G.draw(3, 12)
    n_waves = len(G.waves(sc, 40.0))
    assert n_waves >= 2
    res = G.record(sc, tmp_path, 120, 40.0, dry=False, deadline_s=1e6)
    assert sorted(n for n, _ in ran) == sorted(s.name for s in sc) and {t for _, t in ran} == {120}
    ran.clear()
    res = G.record(sc, tmp_path, 120, 40.0, dry=False, deadline_s=10.0)  # no time for any wave
    assert not ran and all(r["error"].startswith("not run") for r in res.values())
    assert (tmp_path / "heldout.json").exists()
    ran.clear()
    G.record(sc, tmp_path, 20, 40.0, dry=True, deadline_s=1e6)  # fewer seconds than 30 asked: still run
    assert {t for _, t in ran} == {20}
    # time for one wave only (blind set 2909's call): the wave with the most scenarios runs, with all of it
    ran.clear()
    ws = sorted(G.waves(sc, 40.0), key=len, reverse=True)
    res = G.record(sc, tmp_path, 400, 40.0, dry=False, deadline_s=G.WAVE_RESERVE_S + 200)
    assert sorted(n for n, _ in ran) == sorted(s.name for s in ws[0])
    assert all(190 <= t <= 200 for _, t in ran), ran
    assert sum(1 for r in res.values() if "error" in r) == len(sc) - len(ws[0])


def test_as_many_waves_run_as_the_time_holds():
    assert G.fitting(2, 320, 200, 150) == 1  # 2909: 320 s held one wave of 170 s, not two of 10
    assert G.fitting(3, 600, 200, 150) == 3 and G.fitting(3, 10, 200, 150) == 0 and G.fitting(0, 600, 200, 150) == 0
    assert G.fitting(5, 1e9, 200, 150) == 5
