"""The causes of the H200's remaining guarded OOMs (call 23), pinned: tests/support/guard_sim.py runs the
library benchmark's ramps with simulated device memory through the real GuardedLoop, Guard, Policy and
peak estimator."""

from __future__ import annotations

import pytest

from gpuwatch.control.policy import GuardConfig, Observation, Policy

pytest.importorskip("torch")


def sim():
    from support import guard_sim  # torch at its import: only once the test knows torch is there

    return guard_sim


def o(t, risk, **kw):
    base = dict(now_s=t, risk=risk, threshold=0.5, planned_batch=16, last_batch=16, ceiling=None, precision="bf16")
    base.update(kw)
    return Observation(**base)


def test_at_the_alarm_the_batch_comes_down_before_the_cache_is_released():
    """Call 23: the caching allocator's hold of the last step's activations (reserved - allocated 86 %)
    read as fragmentation released the cache instead of splitting the step that then failed."""
    p = Policy(GuardConfig())
    a = p.decide(o(0, 0.8, features={"torch_reserved_gap_frac": 0.86, "mem_used_frac": 0.94,
                                     "next_peak_est_frac": 1.04}, alloc_frac=0.08))
    assert a.kind == "lower_ceiling"


def test_the_cache_release_starts_no_cooldown_and_a_fresh_alarm_acts_through_one():
    p = Policy(GuardConfig(cooldown_s=2.0))
    a = p.decide(o(0, 0.3, features={"mem_used_frac": 0.9}, frag_frac=0.12))
    assert a.kind == "release_cache"
    assert p.decide(o(0.5, 0.8, features={"next_peak_est_frac": 1.04}, alloc_frac=0.08)).kind == "lower_ceiling"
    # a risk of a round ago waits out the cooldown after an action; one scored for this plan, now, does not
    assert p.decide(o(1.0, 0.8, ceiling=12, features={"next_peak_est_frac": 1.04})).kind == "none"
    assert p.decide(o(1.0, 0.8, ceiling=12, fresh=True, features={"next_peak_est_frac": 1.04})).kind == "lower_ceiling"


def test_the_cache_a_step_reuses_is_not_fragmentation():
    """reserved beyond the last peak is waste; reserved beyond what is allocated after the step is
    the cache the next step reuses."""
    p = Policy(GuardConfig())
    assert p.decide(o(0, 0.3, features={"torch_reserved_gap_frac": 0.8, "mem_used_frac": 0.9},
                      frag_frac=0.01)).kind == "none"


def test_a_lowered_ceiling_is_sized_to_the_estimate():
    p = Policy(GuardConfig())
    a = p.decide(o(0, 0.9, features={"next_peak_est_frac": 1.5}, alloc_frac=0.1))
    assert a.kind == "lower_ceiling" and a.value == int(16 * 0.8 / 1.4)  # not 16 x 0.8


def test_hf_scores_the_next_length_with_the_recent_rise():
    pytest.importorskip("transformers")
    from gpuwatch.integrations.hf import next_seq_estimate

    assert next_seq_estimate([]) is None
    assert next_seq_estimate([100]) == 100
    assert next_seq_estimate([100, 130, 150, 170]) == 200
    assert next_seq_estimate([300, 200, 100]) == 100


@pytest.mark.parametrize("name", ["ramp-loop", "ramp-hf"])
def test_the_simulated_ramps_run_without_an_oom_and_keep_the_effective_batch(name):
    pytest.importorskip("transformers")
    m = sim()
    make, frag, peek = m.SCENARIOS[name]
    r = m.run(make(), frag=frag, peek_last=peek)
    assert r["ooms"] == 0, r["oom_rows"]
    assert r["steps"] == len(make()) and r["micro_batches_max"] >= 2
    assert ("lower_ceiling" in {a for _, a in r["actions"]})
