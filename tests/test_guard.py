"""The guard: its policy on score sequences, the controls every schedule honours, and the guard in
the loop on the CPU (tiny preset) driven by replayed real H200 telemetry."""

from __future__ import annotations

import json

import pytest

from gpuwatch.control.policy import GuardConfig, Observation, Policy
from gpuwatch.workload.schedule import Schedule

from conftest import RAMP


def obs(t, risk, planned=16, last=16, ceiling=None, precision="bf16", **feat):
    return Observation(now_s=t, risk=risk, threshold=0.5, planned_batch=planned, last_batch=last,
                       ceiling=ceiling, precision=precision, features=feat)


def test_lowers_the_ceiling_by_20_percent_then_waits_out_the_cooldown():
    p = Policy(GuardConfig(cooldown_s=2.0))
    a = p.decide(obs(0.0, 0.7))
    assert a.kind == "lower_ceiling" and a.value == 12  # 16 x 0.8 = 12.8 -> 12
    assert p.decide(obs(1.0, 0.9, ceiling=12)).kind == "none"  # cooldown
    assert p.decide(obs(2.5, 0.9, ceiling=12)).kind == "lower_ceiling"


def test_hysteresis_and_gradual_restore():
    p = Policy(GuardConfig(cooldown_s=0.0, restore_after_s=10.0, clear_ratio=0.5, restore_by=0.125))
    assert p.decide(obs(0, 0.6)).kind == "lower_ceiling"
    assert p.decide(obs(1, 0.4, ceiling=12)).kind == "none"  # below the threshold, not below 0.25: not low
    assert p.decide(obs(2, 0.2, ceiling=12)).kind == "none"  # low since t=2
    assert p.decide(obs(11, 0.2, ceiling=12)).kind == "none"  # 9 s low: not yet
    a = p.decide(obs(12.5, 0.2, ceiling=12))
    assert a.kind == "raise_ceiling" and a.value == 14  # +12.5 % of the schedule's 16
    assert p.decide(obs(13, 0.2, ceiling=14)).kind == "none"  # the next raise waits as long again
    assert p.decide(obs(23, 0.2, ceiling=14)).kind == "clear_ceiling"  # back to the schedule's own batch
    p2 = Policy(GuardConfig(cooldown_s=0.0, restore_after_s=10.0))
    p2.decide(obs(0, 0.6))
    p2.decide(obs(1, 0.1, ceiling=12))
    p2.decide(obs(5, 0.3, ceiling=12))  # back above the clear level: the low stretch starts again
    assert p2.decide(obs(12, 0.1, ceiling=12)).kind == "none"


def test_refuses_the_ramps_step_up():
    p = Policy(GuardConfig())
    a = p.decide(obs(0, 0.8, planned=20, last=16))
    assert a.kind == "refuse_step" and a.value == 16 and "refused" in a.why


def test_under_a_ceiling_the_ceiling_comes_down_instead_of_another_refusal():
    """The ramp still wants 20 while the ceiling holds 16 and 16 ran: with the risk still high (a longer
    sequence, a leak) refusing the step up again would hold 16 for ever; the ceiling is lowered."""
    p = Policy(GuardConfig())
    a = p.decide(obs(0, 0.8, planned=20, last=16, ceiling=16))
    assert a.kind == "lower_ceiling" and a.value == 12


def test_floor_and_precision_fallback():
    p = Policy(GuardConfig(cooldown_s=0))
    a = p.decide(obs(0, 0.9, planned=1, last=1))  # bf16 at batch 1: nothing left to do, and it says so
    assert a.kind == "unable" and "floor" in a.why and "sequence length" in a.value
    a = p.decide(obs(1, 0.9, planned=1, last=1, precision="fp32"))
    assert a.kind == "precision" and a.value == "bf16" and "floor" in a.why
    o = obs(2, 0.9, planned=8, last=8, precision="fp32", alloc_growth_frac_per_step=0.01, plan_growth=1.0)
    assert Policy(GuardConfig()).decide(o).kind == "precision"  # memory grows at a fixed batch
    o = obs(3, 0.9, planned=8, last=8, precision="fp32")
    o.bf16_ok = False
    o.features = {"alloc_growth_frac_per_step": 0.01}
    assert Policy(GuardConfig()).decide(o).value == "fp16"  # no bf16 on this device


def test_precision_chosen_only_when_it_saves_what_a_smaller_batch_cannot():
    p = Policy(GuardConfig())
    o = obs(0, 0.9, planned=8, last=8, precision="fp32", next_peak_est_frac=1.05)
    o.act_frac = 0.4  # activations: 40 % of the limit. -20 % batch: 0.97 (not enough); bf16: 0.85
    assert p.decide(o).kind == "precision"
    o2 = obs(0, 0.9, planned=8, last=8, precision="fp32", next_peak_est_frac=1.02)
    o2.act_frac = 0.4  # a smaller batch already brings it to 0.94
    assert Policy(GuardConfig()).decide(o2).kind == "lower_ceiling"


def test_fixed_and_reactive_rules():
    f = Policy(GuardConfig(rule="fixed", cooldown_s=0))
    assert f.decide(obs(0, None, mem_used_frac=0.95)).value == 8  # halve above 90 %
    assert f.decide(obs(1, None, ceiling=8, mem_used_frac=0.2)).kind == "clear_ceiling"  # double below 30 %
    assert f.decide(obs(2, None, mem_used_frac=0.5)).kind == "none"
    acc, comp = Policy(GuardConfig(rule="accelerate")), Policy(GuardConfig(rule="composer"))
    assert acc.decide(obs(0, 0.99)).kind == "none"  # reactive: nothing before the failure
    assert acc.after_oom(20, 20) == ("batch", 18)
    assert comp.after_oom(20, 10) == ("ceiling", 5)
    assert Policy(GuardConfig()).after_oom(20, 20) is None  # the model rule leaves recovery to the schedule


@pytest.mark.parametrize("kind", ["steady", "soak", "sweep", "ramp", "long"])
def test_every_schedule_honours_the_ceiling(kind):
    s = Schedule(kind, batch=32, seq_len=64, max_batch=128)
    s.set_ceiling(5)
    seen = []
    for _ in range(200):
        p = s.plan()
        if p is None:
            break
        seen.append(p[0])
        s.done()
    assert seen and max(seen) <= 5, (kind, seen[:20])


def test_a_ramp_over_a_micro_batch_ceiling_keeps_its_batch_for_accumulation():
    """H200 (bench_guard ramp-train, the planner): the ramp at 20 under a ceiling of 10 ran 2 x 10 - the effective
    batch kept - until its next level cut the ramp itself to the ceiling and the effective batch fell to 10. Now
    the ramp stays at 20 (the steps still run at most the ceiling) and climbs on once the ceiling is lifted."""
    s = Schedule("ramp", batch=80, seq_len=64, per_level=1, accumulates=True)  # starts at 20
    s.set_ceiling(10)
    for _ in range(5):
        assert s.wanted()[0] == 20 and s.plan()[0] == 10
        s.done()
    s.hold()  # refusing the next step up holds the micro-batch that ran, not the batch it accumulated to
    assert s.ceiling == 10 and s.plan()[0] == 10
    s.set_ceiling(None)
    s.done()
    assert s.wanted()[0] == 25
    # a ramp that does not accumulate (inference; train with accumulation off) is still cut to the ceiling: its
    # steps run the ceiling itself, and lifting it climbs from there, not from a batch that never ran
    p = Schedule("ramp", batch=80, seq_len=64, per_level=1)
    p.set_ceiling(10)
    p.done()
    assert p.wanted()[0] == 10 and p.plan()[0] == 10
    p.hold()
    assert p.ceiling == 10


def test_refusal_after_the_ramp_stepped_holds_the_last_batch_that_ran():
    """Found on the H200 (call 7): the ramp had already moved to 20 when the guard refused it; the hold
    set the ceiling to 20 (overriding the guard's 16) and the step ran out of memory."""
    s = Schedule("ramp", batch=64, seq_len=64, per_level=1)
    s.done()  # ran at 16, the ramp now wants 20
    assert s.plan()[0] == 20
    s.hold()
    assert s.plan()[0] == 16 and s.ceiling == 16
    s.done()
    assert s.plan()[0] == 16


def test_hold_stops_a_ramp_and_the_ceiling_can_be_lifted():
    s = Schedule("ramp", batch=16, seq_len=64, per_level=2)
    for _ in range(4):
        b = s.plan()[0]  # the last batch that ran
        s.done()
    s.hold()
    for _ in range(20):
        s.done()
    assert s.plan()[0] == b  # the ramp stays at the batch that fitted
    s.set_ceiling(None)
    for _ in range(4):
        s.done()
    assert s.plan()[0] > b


def test_train_accumulation_keeps_the_effective_batch_and_the_update():
    """A ceiling below the batch splits a train step into micro-batches; the update is the same."""
    torch = pytest.importorskip("torch")
    from gpuwatch.telemetry.bus import Bus
    from gpuwatch.workload.runner import Workload, WorkloadConfig

    def one(ceiling):
        bus = Bus()
        w = Workload(bus, WorkloadConfig(mode="train", batch=8, seq_len=16, integrity_every=0, max_steps=1,
                                         overrides={"num_hidden_layers": 1}))
        if ceiling:
            w.set_ceiling(ceiling, who="guard", why="test")
        w.run()
        return w, bus.steps.latest(1)[0], [p.detach().clone() for p in w.model.parameters()]
    w1, r1, p1 = one(None)
    w2, r2, p2 = one(2)
    assert r1["batch"] == r2["batch"] == 8 and r1["micro_batches"] == 1 and r2["micro_batches"] == 4
    assert r2["loss"] == pytest.approx(r1["loss"], rel=1e-4)
    for a, b in zip(p1, p2):
        assert torch.allclose(a, b, atol=1e-6)


def test_guard_in_the_loop_on_replayed_real_telemetry(tmp_path):
    """The tiny preset on the CPU stands in for GPU 0 of a real H200 ramp-to-OOM recording replayed
    as live; the real scorer and guard act between steps and record each action with its reasons.
    The CPU workload's steps carry no allocator figures, so the estimator has nothing to go on and the
    risk is the context classifier's alone (half its probability: 0.01-0.31 over this ramp, under the
    shipped alarm at 0.5): the alarm threshold is lowered to 0.1 for the test."""
    pytest.importorskip("torch")
    from gpuwatch.predict.model import DEFAULT_MODEL
    from gpuwatch.recording.reader import open_recording
    from gpuwatch.runtime import ModelChoice, Session, SessionConfig
    from gpuwatch.workload.factory import WorkloadSpec, make_workloads

    if not DEFAULT_MODEL.exists():
        pytest.skip("no shipped model")

    def factory(spec, bus, nvml_index):
        ws = make_workloads(spec, bus, nvml_index)
        for w in ws:
            w.cfg.gpu_index = 0
        return ws
    spec = WorkloadSpec(preset="tiny", device="cpu", mode="train", schedule="ramp", batch=16, seq_len=32,
                        integrity_every=0)
    cfg = SessionConfig(record_dir=tmp_path, name="guarded", source=str(RAMP), sampler="thread", workload=spec,
                        guard=GuardConfig(mode="on", cooldown_s=0.5), model=ModelChoice(threshold=0.1))
    with Session(cfg, workload_factory=factory) as s:
        s.wait(25, until_done=False)
    rec = open_recording(tmp_path / "guarded")
    acts = rec.events.filter(rec.events["kind"] == "guard_action")
    assert rec.risk.height > 50 and rec.risk["risk"].max() > 0  # the live risk was recorded
    assert acts.height >= 1, rec.events["kind"].value_counts()
    d = json.loads(acts["detail"][0])
    assert {"action", "risk", "threshold", "rule", "reasons"} <= set(d) and d["risk"] >= d["threshold"]
    ctl = rec.events.filter(rec.events["kind"] == "control")
    who = [json.loads(x)["who"] for x in ctl["detail"]]
    assert "guard" in who  # the guard's changes reached the workload, between steps
