"""The library benchmark's fragment scenario (tests/support/guard_fragment.py) and the false alarm of its
guarded arm on the H200 (calls 25 and 28, step 4), on the CPU."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]


def load(name):
    """support.guard_sim / support.guard_fragment, imported once torch is known to be there."""
    return importlib.import_module(f"support.{name}")


def test_the_step4_false_alarm_is_reproduced_and_gone_when_the_smaller_plan_is_rescored():
    """Calls 25/28: 'lower ceiling: risk 0.62 >= 0.50 (peak_cross_p); batch ceiling 8 -> 6' before step 4.
    The alarm was scored during step 3 for step 3's 18,784 tokens (p 0.99: the buffers' growth of the first
    steps carried over the 5 s horizon); step 3 then fit, and the guard split the 12,496-token step 4 on it."""
    m = load("guard_sim")
    old = m.fragment_false_alarm(rescore_smaller=False)
    assert [(a["step"], a["message"]) for a in old["actions"] if a["action"] == "lower_ceiling"] == [
        (4, "lower ceiling: risk 0.62 >= 0.50 (peak_cross_p); batch ceiling 8 -> 6")]
    assert [r for r in old["rounds"] if r["risk"] >= 0.5] == [
        {"step": 3, "plan_tokens": 18784, "risk": 0.618, "peak_cross_p": 0.989, "next_peak_est_frac": 0.548}]
    new = m.fragment_false_alarm()
    assert not [a for a in new["actions"] if a["action"] in ("lower_ceiling", "refuse_step")]
    assert new["ooms"] == 0


def test_a_smaller_plan_is_rescored_only_at_an_alarm_scored_for_a_larger_one():
    import torch

    m = load("guard_sim")
    calls = []
    loop = m.SimLoop(cap=m.CAP25, per_token=m.PER_TOKEN25, precision="bf16", allow_bf16=False)
    g = m.Guard(loop.bus, m.GuardConfig(), {0: loop}, threshold=0.5, limits={0: m.CAP25},
                rescore=lambda gpu, plan: calls.append(plan) or (0.0, [], {}))
    loop.guard = g
    loop.step(torch.zeros(8, 1000, dtype=torch.long), lambda mb: torch.zeros(()))
    assert [c["seq_len"] for c in calls] == [1000]  # the first step: nothing scored yet, the guard scores it (once)
    calls.clear()
    big = {"batch": 8, "seq_len": 2000, "precision": "bf16", "mode": "train", "effective_batch": 8, "micro_batches": 1}
    g.on_risk(0, 0.3, [], {}, big, False)  # no alarm: nothing re-scored
    loop.step(torch.zeros(8, 1000, dtype=torch.long), lambda mb: torch.zeros(()))
    assert calls == []
    g.on_risk(0, 0.7, [], {}, big, False)  # an alarm for a larger plan: this one is scored, and it is clear
    loop.step(torch.zeros(8, 1000, dtype=torch.long), lambda mb: torch.zeros(()))
    assert [c["seq_len"] for c in calls] == [1000] and loop.ceiling is None
    assert g.latest_risk(0)["plan"]["seq_len"] == 1000


def test_fragment_criteria():
    f = load("guard_fragment")
    cap = 10**10
    u = {"ooms": 3, "tokens": 900, "tokens_per_s": 90.0,
         "oom_rows": [{"reserved_gap_at_failure": 3 * 10**9}, {"reserved_gap_at_failure": 10**8}, {}]}
    g = {"ooms": 0, "tokens": 1000, "tokens_per_s": 95.0, "remedies": ["cache released, allocator switched to "
         "expandable segments"], "actions": [{"step": 4, "action": "release_cache"}]}
    c = f.criteria({"unguarded": u, "guarded": g}, cap)
    assert c["shown"] and c["unguarded_fragmentation_ooms"] == 1 and c["reserved_gap_at_failure_frac"] == [0.3, 0.01]
    assert c["guard_release_cache_steps"] == [4] and c["tokens_per_s_ratio"] == pytest.approx(95 / 90, abs=1e-4)
    assert not f.criteria({"unguarded": u, "guarded": dict(g, ooms=1)}, cap)["shown"]
    assert not f.criteria({"unguarded": u, "guarded": dict(g, remedies=[])}, cap)["shown"]


def test_the_fragment_scenario_dry_run(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "dry.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]), CUDA_VISIBLE_DEVICES="")
    code = f"from support.library_scenarios import run; run({str(out)!r}, dry=True, only=['fragment'])"
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    s = json.loads(out.read_text())["scenarios"]["fragment"]
    assert "error" not in s, s.get("traceback")
    assert s["unguarded"]["ooms"] > 0 and all("error" in row for row in s["unguarded"]["oom_rows"])
    c = s["criteria"]
    assert set(c) >= {"unguarded_ooms", "unguarded_fragmentation_ooms", "reserved_gap_at_failure_frac", "guarded_ooms",
                      "guard_release_cache_steps", "expandable_segments", "tokens_per_s_ratio", "shown"}
    assert c["shown"] is False  # a CPU: no allocator to fragment, no guard that can act
