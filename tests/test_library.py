"""The guard in a user's own training loop (gpuwatch.integrations.GuardedLoop), the typed contract both
workloads implement, the remedies beyond the batch, and the README's library example run as-is."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from gpuwatch.contract import Action, GuardedWorkload, StepPlan  # noqa: E402
from gpuwatch.control.guard import Guard  # noqa: E402
from gpuwatch.control.policy import GuardConfig, Observation, Policy  # noqa: E402
from gpuwatch.integrations.batches import split as _split  # noqa: E402
from gpuwatch.integrations.loop import GuardedLoop  # noqa: E402
from gpuwatch.telemetry.bus import Bus  # noqa: E402

from conftest import RAMP, ROOT  # noqa: E402
from support.decisions import spy_decisions  # noqa: E402


def tiny_lm(seed: int = 0, vocab: int = 64, dim: int = 16) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(vocab, dim), torch.nn.Linear(dim, dim), torch.nn.Tanh(),
                               torch.nn.Linear(dim, vocab))


def lm_loss(model):
    def f(mb):
        ids = mb["input_ids"] if isinstance(mb, dict) else mb
        logits = model(ids[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    return f


def events(bus: Bus, kind: str) -> list:
    return [e for e in bus.events.latest(len(bus.events)) if e.kind == kind]


def offline_loop(model, **kw) -> GuardedLoop:
    """A loop with no recording, no risk model and a thread sampler: the step logic alone."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    return GuardedLoop(model, opt, record_dir=None, use_model=False, guard="off", sampler="thread", **kw)


# -- the contract ---------------------------------------------------------------------------------------
def test_the_plan_shows_the_micro_batch_the_step_runs_as_not_the_effective_batch():
    """A framework's per-device batch under accumulation (a Trainer's 4 x 4, Lightning's 8 x 2) is the shape the
    step runs: the plan the scorer and the planner see says 4 x 4, not 16 x 1 (s50: Lightning's 8 x 2 was shown
    as 16, so its observe arm said "would plan 8" at 108 of 150 steps and the risk estimated 16-row peaks)."""
    loop = offline_loop(tiny_lm())
    loop.decide(16, 32)
    assert (loop.next_plan().batch, loop.next_plan().micro_batches) == (16, 1)  # no framework, no ceiling: whole
    loop.largest = 4
    p = loop.decide(16, 32)
    assert (p.batch, p.micro_batches, p.effective_batch) == (4, 4, 16)
    loop.ceiling = 2
    assert (loop.next_plan().batch, loop.next_plan().micro_batches) == (2, 8)  # the ceiling below it
    loop.micro_batch_fixed = 8  # fixed until the framework's next change point: that runs, whatever the ceiling
    assert (loop.next_plan().batch, loop.next_plan().micro_batches) == (8, 2)
    assert loop.running_micro_batch(None) == 8 and loop.running_micro_batch(6) == 6


def test_both_workloads_implement_the_one_contract():
    from gpuwatch.workload.runner import Workload, WorkloadConfig

    w = Workload(Bus(), WorkloadConfig(mode="train", batch=8, seq_len=16, overrides={"num_hidden_layers": 1}))
    loop = offline_loop(tiny_lm())
    for x in (w, loop):
        assert isinstance(x, GuardedWorkload)
        assert {"lower_ceiling", "clear_ceiling", "stop"} <= x.accepts()
    p = w.next_plan()
    assert isinstance(p, StepPlan) and (p.batch, p.seq_len, p.mode, p.micro_batches) == (8, 16, "train", 1)
    w.apply(Action("lower_ceiling", 3, "test"))
    p = w.next_plan()  # a pending ceiling is already the plan the model scores
    assert (p.batch, p.micro_batches, p.effective_batch, p.wanted_batch) == (3, 3, 8, 8)
    assert p.scored() == {"batch": 3, "seq_len": 16, "precision": "fp32", "mode": "train", "effective_batch": 8,
                          "micro_batches": 3}


def test_a_step_decides_with_its_own_batch_in_hand(monkeypatch):
    """`step()` has the batch in hand: the plan it decides on says so (`in_hand`: the planner weighs that batch
    instead of the longest recent length) until the step has run; its lookahead stays what `wrap` knows (nothing
    here), so the risk model's inputs do not change; `decide()` alone (a framework deciding before it fetched
    the batch) is not in hand."""
    seen = spy_decisions(monkeypatch)
    loop = offline_loop(tiny_lm())
    loop.step(torch.randint(0, 32, (4, 12)), lm_loss(loop.model))
    p = seen[-1].plan
    assert p.in_hand and (p.seq_len, p.ahead_steps) == (12, None) and "in_hand" not in p.scored()
    assert not loop.next_plan().in_hand  # the batch has run: between steps the next one is not known
    assert loop.decide(4, 20) is not None and not loop.next_plan().in_hand  # a framework's, before its batch
    loop.close()


def test_a_step_with_its_own_seq_len_keeps_wraps_lookahead(monkeypatch):
    """Review of 650cf89: `step(batch, fn, seq_len=...)` on `wrap`'s batches kept only the step's own shape (the
    given length is not wrap's): the 4 x 40 batch drawn ahead went unplanned."""
    decided = spy_decisions(monkeypatch)
    loop = offline_loop(tiny_lm())
    batches = [torch.randint(0, 64, (4, 12)), torch.randint(0, 64, (4, 40)), torch.randint(0, 64, (4, 12))]
    for b in loop.wrap(batches):
        loop.step(b, lm_loss(loop.model), seq_len=b.shape[1] - 1)
        break
    loop.close()
    p = decided[0].plan
    assert p.ahead_steps == 2 and p.ahead_seq_len == 40 and p.in_hand, p


class ContractOnly:
    """Lets through only the contract's members of the workload it wraps: anything else the guard
    touched would raise."""

    MEMBERS = {"gpu_index", "next_plan", "guard_view", "accepts", "apply", "request_snapshot"}

    def __init__(self, inner):
        object.__setattr__(self, "_inner", inner)

    def __getattr__(self, name):
        if name not in self.MEMBERS:
            raise AssertionError(f"the guard reached past the contract: {name}")
        return getattr(self._inner, name)


def test_the_guard_reads_nothing_but_the_contract():
    from gpuwatch.workload.runner import Workload, WorkloadConfig

    bus = Bus()
    w = Workload(bus, WorkloadConfig(mode="train", schedule="ramp", batch=16, seq_len=16,
                                     overrides={"num_hidden_layers": 1}))
    strict = ContractOnly(w)
    calls = []
    g = Guard(bus, GuardConfig(cooldown_s=0.0), {None: strict}, threshold=0.5,
              rescore=lambda gpu, plan: calls.append(plan) or (0.9, [], {"mem_used_frac": 0.95}))
    g.on_risk(None, 0.2, [], {}, {"batch": 1, "seq_len": 16}, True)
    w.last_ok_batch = 4
    act = g.before_step(strict)  # the plan grew since it was scored: re-scored, then acted on
    assert calls and calls[0]["batch"] == 4 and act.kind == "lower_ceiling"
    assert w.next_plan().batch == act.value  # applied through `apply`, pending until the next step
    g.after_oom(strict, 8, 8)
    assert events(bus, "guard_miss")


# -- the same update -------------------------------------------------------------------------------------
@pytest.mark.parametrize("as_dict", [False, True])
def test_accumulated_step_is_the_unsplit_step(as_dict):
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (12, 9), generator=gen) for _ in range(3)]

    def run(ceiling):
        model = tiny_lm()
        g = offline_loop(model)
        with g:
            if ceiling:
                g.apply(Action("lower_ceiling", ceiling, "test"))
            losses = [g.step({"input_ids": b} if as_dict else b, lm_loss(model)) for b in batches]
            rows = g.bus.steps.latest(10)
        return model, losses, rows
    m1, l1, r1 = run(None)
    m2, l2, r2 = run(5)  # 12 -> micro-batches of 4, 4, 4
    assert [r["micro_batches"] for r in r1] == [1, 1, 1] and [r["micro_batches"] for r in r2] == [3, 3, 3]
    assert [r["batch"] for r in r2] == [12, 12, 12]  # the effective batch holds
    assert l2 == pytest.approx(l1, rel=1e-5)
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.allclose(a, b, atol=1e-6), (a - b).abs().max()
    m3, l3, _ = run(1)  # and it does differ when the update differs: the comparison can fail
    assert any(not torch.equal(a, b) for a, b in zip(m1.parameters(), tiny_lm().parameters()))


def test_split_handles_uneven_batches_and_non_batch_leaves():
    b = {"input_ids": torch.arange(10).reshape(5, 2), "scale": torch.tensor(2.0), "names": list("abcde")}
    parts = _split(b, 2)
    assert [p["input_ids"].shape[0] for p in parts] == [3, 2]
    assert parts[1]["names"] == ["d", "e"] and parts[0]["scale"] is b["scale"]


def test_split_cuts_a_list_of_batched_tensors_element_by_element():
    """A TensorDataset's batch is a list of tensors (Lightning's, a DataLoader's default collate): each is
    cut, where a list of the batch's rows is cut by rows (it used to come back whole in every part)."""
    ids, y = torch.arange(16).reshape(8, 2), torch.arange(8)
    parts = _split([ids, y], 3)
    assert [p[0].shape[0] for p in parts] == [3, 3, 2] and torch.equal(torch.cat([p[1] for p in parts]), y)
    rows = [torch.tensor([i, i]) for i in range(5)]  # per-row tensors: a list of the rows
    parts = _split({"x": torch.zeros(5, 1), "rows": rows}, 2)
    assert [len(p["rows"]) for p in parts] == [3, 2] and parts[1]["rows"][0] is rows[3]
    # per-row dicts (object detection's labels) and per-row strings in a tuple: by rows, the dicts untouched
    labels = [{"boxes": torch.zeros(i + 1, 4), "class_labels": torch.arange(4)} for i in range(4)]
    parts = _split({"pixel_values": torch.zeros(4, 3), "labels": labels, "ids": ("a", "b", "c", "d")}, 2)
    assert [len(p["labels"]) for p in parts] == [2, 2] and parts[1]["labels"][0] is labels[2]
    assert parts[1]["ids"] == ("c", "d")
    # a 0-d setting first is not the batch
    assert [p["x"].shape[0] for p in _split({"temperature": torch.tensor(0.7), "x": torch.zeros(5, 2)}, 2)] == [3, 2]


def test_an_oom_retries_at_half_then_stops_cleanly_at_the_floor_with_the_checkpoint():
    model = tiny_lm()
    saved = []
    g = offline_loop(model, checkpoint=lambda step: saved.append(step) or "ckpt.pt")
    limit = {"rows": 4}

    def loss(mb):
        if mb.shape[0] > limit["rows"]:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return lm_loss(model)(mb)
    with g:
        ids = torch.randint(0, 64, (16, 8))
        assert g.step(ids, loss) is not None  # 16 -> 8 -> 4: two OOMs, same step retried
        assert g.ceiling == 4 and g.bus.steps.latest(1)[0]["batch"] == 16
        limit["rows"] = 0  # now nothing fits: at the floor the loop stops instead of looping
        for _ in g.wrap([ids] * 50):
            g.step(ids, loss)
        bus = g.bus
    assert g.stopped and "floor" in g.stopped and saved == [1]
    ooms = events(bus, "oom")
    assert len(ooms) == 2 + 3  # 4 -> 2 -> 1 -> floor: no OOM loop
    assert events(bus, "oom_recovered")[-1].detail["decision"] == "stop"


# -- the policy's remedies beyond the batch ---------------------------------------------------------------
def obs(t, risk, **feat):
    return Observation(now_s=t, risk=risk, threshold=0.5, planned_batch=8, last_batch=8, ceiling=None,
                       precision="bf16", features=feat)


def test_a_leak_is_named_once_then_stopped_before_the_crash_whatever_the_risk():
    p = Policy(GuardConfig(cooldown_s=5.0))
    a = p.decide(obs(0, 0.1, alloc_growth_frac_per_step=0.02, next_peak_est_frac=0.6, plan_growth=1.0))
    assert a.kind == "name_leak" and "leak" in a.why
    assert p.decide(obs(1, 0.1, alloc_growth_frac_per_step=0.02, next_peak_est_frac=0.7)).kind == "none"
    a = p.decide(obs(1.5, 0.1, alloc_growth_frac_per_step=0.02, next_peak_est_frac=0.93))  # in the cooldown
    assert a.kind == "stop" and "before the OOM" in a.why
    growing_plan = obs(2, 0.1, alloc_growth_frac_per_step=0.02, next_peak_est_frac=0.95, plan_growth=1.5)
    assert Policy(GuardConfig()).decide(growing_plan).kind != "stop"  # a ramp is not a leak
    jump = obs(2, 0.1, alloc_growth_frac_per_step=0.05, next_peak_est_frac=0.95)
    jump.alloc_rising_steps = 1  # one jump (the optimizer's state after step 1), not a rise every step
    assert Policy(GuardConfig()).decide(jump).kind == "none"
    jump.alloc_rising_steps = 4
    assert Policy(GuardConfig()).decide(jump).kind == "stop"


def test_fragmentation_releases_the_cache_and_switches_to_expandable_segments_once():
    p = Policy(GuardConfig(cooldown_s=0.0, frag_every_s=10.0))
    a = p.decide(obs(0, 0.3, torch_reserved_gap_frac=0.12, mem_used_frac=0.9))
    assert a.kind == "release_cache" and a.value is True and "fragmentation" in a.why
    assert p.decide(obs(5, 0.3, torch_reserved_gap_frac=0.12, mem_used_frac=0.9)).kind == "none"
    a = p.decide(obs(11, 0.3, torch_reserved_gap_frac=0.12, mem_used_frac=0.9))
    assert a.kind == "release_cache" and a.value is True  # the first was decided, not applied (observe mode)
    p.applied(a)
    a = p.decide(obs(22, 0.3, torch_reserved_gap_frac=0.12, mem_used_frac=0.9))
    assert a.kind == "release_cache" and a.value is False  # expandable segments only once
    assert Policy(GuardConfig()).decide(obs(0, 0.3, torch_reserved_gap_frac=0.12, mem_used_frac=0.5)).kind == "none"
    o = obs(0, 0.3, torch_reserved_gap_frac=0.12, mem_used_frac=0.9)
    o.accepts = frozenset({"lower_ceiling"})  # a CPU workload cannot release a CUDA cache
    assert Policy(GuardConfig()).decide(o).kind == "none"


class FloorWorkload:
    """A workload at its floor with nothing lower to fall back to."""

    gpu_index = 0

    def __init__(self):
        self.applied = []

    def next_plan(self):
        return StepPlan(batch=1, seq_len=64, precision="bf16")

    def guard_view(self):
        from gpuwatch.contract import WorkloadView

        return WorkloadView(gpu=0, ceiling=1, last_ok_batch=1)

    def accepts(self):
        return frozenset({"lower_ceiling", "stop"})

    def apply(self, action, who="guard"):
        self.applied.append(action)

    def request_snapshot(self, directory, reason):
        pass


def test_a_guard_that_cannot_act_says_so_once_with_what_would_help():
    bus, w = Bus(), FloorWorkload()
    g = Guard(bus, GuardConfig(cooldown_s=0.0), {0: w}, threshold=0.5)
    for i in range(30):
        g.on_risk(0, 0.9, [("mem_used_frac", 0.3)], {"mem_used_frac": 0.97}, None, i == 0)
        g.before_step(w)
    un = events(bus, "guard_unable")
    assert len(un) == 1 and "floor" in un[0].message and "would help" in un[0].message and not w.applied
    assert not events(bus, "guard_action")
    bus2 = Bus()
    Guard(bus2, GuardConfig(mode="observe"), {0: w}, threshold=0.5)
    Guard(bus2, GuardConfig(), {None: w}, threshold=0.5, unable="no GPU: nothing to score")
    msgs = [e.message for e in events(bus2, "guard_unable")]
    assert len(msgs) == 2 and "observe" in msgs[0] and "CUDA GPU" in msgs[1]


def _framework_loop(largest):
    """A loop as a framework drives it (its per-device batch `largest`), with a threshold-rule guard driven by hand."""
    from gpuwatch.predict.peak import usable_limit

    loop, bus, lim = offline_loop(tiny_lm()), Bus(), 80 * 2**30
    loop.bus, loop.session = bus, object()
    g = Guard(bus, GuardConfig(cooldown_s=0.0, plan=False), {None: loop}, threshold=0.5, limits={None: lim})
    loop.guard, loop.largest, loop.last_ok_batch = g, largest, largest
    u = usable_limit(lim)
    loop._last = {"torch_peak_bytes": int(0.8 * u), "torch_allocated_bytes": int(0.5 * u),
                  "torch_reserved_bytes": int(0.8 * u), "batch": 16, "seq_len": 32}
    return loop, g


@pytest.mark.parametrize("first", [False, True])
def test_the_threshold_rule_sizes_its_cut_for_the_micro_batch_that_runs(first):
    """A Trainer's 8 x 2, no ceiling; the risk's estimate is for the 8 rows that run (1.2 of the usable limit, the
    weights 0.5: 4 rows fit). Sized from the effective 16 (review of 5c2159a), the cut was a refusal held at 8 or a
    ceiling of 9: neither changed the step."""
    loop, g = _framework_loop(8)
    loop.last_ok_batch = None if first else 8
    plan = loop.decide(16, 32)
    assert plan.batch == 8
    g.on_risk(None, 0.9, [], {"next_peak_est_frac": 1.2, "mem_used_frac": 0.9}, plan.scored(), False)
    g.before_step(loop)
    loop.decide(16, 32)
    assert loop.next_plan().batch <= 4


def test_the_steps_row_records_the_plan_the_live_guard_scores():
    """A Trainer's 4 x 4: the row's next_batch (what score, replay and training read back) is the live plan's 4."""
    loop, g = _framework_loop(4)
    loop._wanted = (16, 32)
    loop.record_step(16, 32, 4, 0.1)
    assert (loop.last_step["next_batch"], loop.last_step["micro_batches"]) == (loop.next_plan().batch, 4) == (4, 4)


class OpenWorkload(FloorWorkload):
    """Batch 16 (or `batch`), no ceiling: room to lower it; `manual`: the user's override."""

    batch, manual = 16, False

    def next_plan(self):
        return StepPlan(batch=self.batch, seq_len=64, precision="bf16")

    def guard_view(self):
        from gpuwatch.contract import WorkloadView

        return WorkloadView(gpu=0, ceiling=None, last_ok_batch=self.batch, manual=self.manual)


def test_observing_the_same_would_be_action_is_said_once_while_it_keeps_coming():
    """Observe mode changes nothing, so the same decision comes every step: said once while it keeps coming (s50's
    Lightning observe arm said "would plan" at 108 of 150 steps), through the policy's cooldown (review of fd3676c: the
    cooldown's "none" steps restarted it), again after WOULD_QUIET_S without it, an unable state, a manual step or a
    mode switch; acting, every time."""
    from gpuwatch.control.guard import WOULD_QUIET_S

    def run(mode, risks, cooldown_s=2.0, between=None):
        bus, w, t = Bus(), OpenWorkload(), [0.0]
        g = Guard(bus, GuardConfig(mode=mode, cooldown_s=cooldown_s), {0: w}, threshold=0.5, clock=lambda: t[0])
        kinds = []
        for i, r in enumerate(risks):
            if between is not None and i == len(risks) // 2:
                between(g, w, t)
            g.on_risk(0, r, [("mem_used_frac", 0.3)], {"mem_used_frac": 0.97}, None, i == 0)
            kinds.append(g.before_step(w).kind)
            t[0] += 0.5
        return kinds, [e.message for e in events(bus, "guard_action")], w

    kinds, said, w = run("observe", [0.9] * 16)  # a 2 s cooldown: "none" on most steps between
    assert 1 < kinds.count("lower_ceiling") < 16 and len(said) == 1 and said[0].startswith("would lower ceiling")
    assert not w.applied
    quiet = [0.9] * 4 + [0.1] * int(WOULD_QUIET_S / 0.5 + 2) + [0.9] * 4
    assert len(run("observe", quiet, cooldown_s=0.0)[1]) == 2  # quiet long enough: said again
    assert len(run("observe", [0.9] * 4 + [0.1] * 4 + [0.9] * 4, cooldown_s=0.0)[1]) == 1  # a short lull: not

    def unable(g, w, t):  # a step at the floor (unable), then back
        w.batch = 1
        g.on_risk(0, 0.9, [], {"mem_used_frac": 0.97}, None, False)
        g.before_step(w)
        w.batch = 16

    def manual(g, w, t):
        w.manual = True
        g.before_step(w)
        w.manual = False

    def switch(g, w, t):
        g.set_mode("on")
        g.set_mode("observe")

    for between in (unable, manual, switch):
        assert len(run("observe", [0.9] * 6, cooldown_s=0.0, between=between)[1]) == 2, between.__name__
    kinds, said, w = run("on", [0.9] * 6, cooldown_s=0.0)
    assert len(w.applied) == len(said) == 6


def test_stress_stops_cleanly_on_a_leak_with_the_summary():
    """The DeepSeek workload applies the guard's stop: no further step, state stopped, the summary says why."""
    from gpuwatch.workload.runner import Workload, WorkloadConfig
    from gpuwatch.workload.summary import format_summary, summarize

    bus = Bus()
    w = Workload(bus, WorkloadConfig(mode="train", batch=2, seq_len=8, integrity_every=0, max_steps=50,
                                     overrides={"num_hidden_layers": 1}))
    g = Guard(bus, GuardConfig(), {None: w}, threshold=0.5)
    w.guard = g
    g.on_risk(None, 0.2, [], {"alloc_growth_frac_per_step": 0.05, "next_peak_est_frac": 0.9, "plan_growth": 1.0},
              None, False)
    w.run()
    assert w.state == "stopped" and w._step == 0 and "leak" in w.stopped_by
    text = format_summary(summarize(w, bus))
    assert "STOPPED CLEANLY BY THE GUARD" in text
    assert [e for e in events(bus, "guard_action") if "stop" in e.message]


# -- the loop guarded on real telemetry, recorded as a normal session ---------------------------------------
def recorded_allocator(path):
    """The allocator's figures of a recorded session's steps as a function of the micro-batch: the median
    peak and allocated bytes and the largest reserved bytes of each recorded batch, linear between them and
    extended past the largest by its last two points (the DeepSeek ramp's peak is linear in the batch)."""
    import numpy as np
    import polars as pl
    from gpuwatch.recording.reader import open_recording

    t = (open_recording(path).steps.group_by("batch")
         .agg(pl.col("torch_peak_bytes").median(), pl.col("torch_allocated_bytes").median(),
              pl.col("torch_reserved_bytes").max()).sort("batch"))
    b = t["batch"].to_numpy().astype(float)

    def at(col: str, n: float) -> int:
        y = t[col].to_numpy().astype(float)
        if n <= b[-1]:
            return int(np.interp(n, b, y))
        return int(y[-1] + (y[-1] - y[-2]) / (b[-1] - b[-2]) * (n - b[-1]))

    def figures(n: int | None) -> dict:
        if not n:
            return {"torch_allocated_bytes": at("torch_allocated_bytes", b[0]), "torch_reserved_bytes": None,
                    "torch_peak_bytes": None}
        peak = at("torch_peak_bytes", n)
        return {"torch_allocated_bytes": at("torch_allocated_bytes", n), "torch_peak_bytes": peak,
                "torch_reserved_bytes": max(peak, at("torch_reserved_bytes", n))}
    return figures


def test_the_user_loop_is_guarded_and_recorded_as_a_normal_session(tmp_path):
    """A user's loop stands in for GPU 0 of a real H200 ramp-to-OOM recording, replayed as live: its
    data loader ramps the batch as that run did (2 up to 16, held), and its allocator reads what the
    recorded run's allocator read at the same micro-batch (a CPU has no allocator figures). The real
    scorer sees batch 16 coming (over the card at about 138 of 140 GiB) and the real guard splits those
    steps into micro-batches; the effective batch holds, and the session opens in score, report and the
    training data builder."""
    from gpuwatch.predict.model import DEFAULT_MODEL
    from gpuwatch.recording.reader import open_recording

    if not DEFAULT_MODEL.exists():
        pytest.skip("no shipped model")
    import itertools
    import time

    sizes = [n for n in range(2, 16, 2) for _ in range(4)]

    def loader():
        gen = torch.Generator().manual_seed(0)
        for n in itertools.chain(sizes, itertools.repeat(16)):
            yield torch.randint(0, 64, (n, 32), generator=gen)

    model = tiny_lm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    figures = recorded_allocator(RAMP)
    with GuardedLoop(model, opt, record_dir=tmp_path, name="lib", source=str(RAMP), gpu_index=0, sampler="thread",
                     guard_config=GuardConfig(cooldown_s=0.5)) as g:
        g._mem = lambda: figures(g.last_ok_batch)
        t0 = time.monotonic()  # 20 s of the replayed ramp and at least 60 steps, however loaded the machine
        for ids in g.wrap(loader()):
            g.step(ids, lm_loss(model))
            time.sleep(0.02)
            if (time.monotonic() - t0 >= 20 and g.steps >= 60) or time.monotonic() - t0 > 90:
                break
        folder = g.session_dir
    rec = open_recording(folder)
    st = rec.steps
    assert st.height >= 60 and st["batch"].to_list() == (sizes + [16] * st.height)[:st.height]  # the effective batch held
    at16 = st.filter(st["batch"] == 16)
    assert at16.height > 0 and at16["micro_batches"].min() > 1  # the guard split every step of 16, the first too
    assert st.filter(st["batch"] <= 12)["micro_batches"].max() == 1  # and none well under the card
    acts = rec.events.filter(rec.events["kind"] == "guard_action")
    assert acts.height >= 1 and rec.risk.height > 20
    who = [json.loads(x)["who"] for x in rec.events.filter(rec.events["kind"] == "control")["detail"]]
    assert "guard" in who
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["config"]["workloads"][0]["library"] == "gpuwatch.integrations.GuardedLoop"
    env = {"PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "gpuwatch", "score", str(folder), "--json"], capture_output=True,
                       text=True, timeout=120, env={**__import__("os").environ, **env})
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["actions"]
    r = subprocess.run([sys.executable, "-m", "gpuwatch", "report", str(folder), "-o", str(tmp_path / "r.md")],
                       capture_output=True, text=True, timeout=120, env={**__import__("os").environ, **env})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "user" in (tmp_path / "r.md").read_text()
    from gpuwatch.predict.dataset import session_timelines
    from gpuwatch.recording.source import ReplaySource

    src = ReplaySource(folder)  # what `gpuwatch replay` opens
    assert src.gpus and src.gpus[0].index == 0 and src.events_df.height > 5

    tls = session_timelines(folder, stride=5)
    assert tls and sum(len(t.X) for t in tls) > 10


def test_a_cpu_loop_says_once_that_the_guard_cannot_act(tmp_path):
    model = tiny_lm()
    with GuardedLoop(model, torch.optim.SGD(model.parameters(), lr=0.1), record_dir=tmp_path, name="cpu",
                     sampler="thread") as g:
        for _ in range(5):
            g.step(torch.randint(0, 64, (4, 8)), lm_loss(model))
        msgs = [e.message for e in events(g.bus, "guard_unable")]
    assert g.session.guard is not None  # on a CPU, `guard on` is not switched off silently
    assert len(msgs) == 1 and "cannot act" in msgs[0]


# -- the README example, run as-is -------------------------------------------------------------------------
def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    after = text.split("<!-- library-example -->", 1)[1]
    m = re.search(r"```python\n(.*?)```", after, re.S)
    assert m, "README.md: no python block after <!-- library-example -->"
    return m.group(1)


def test_the_readme_library_example_runs_as_is(tmp_path, env):
    (tmp_path / "train.py").write_text(readme_example())  # a script with no __main__ guard, as users write them
    r = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.count(" steps, last loss ") == 1  # the spawned sampler did not run the script again
    sessions = [p for p in (tmp_path / "recordings").iterdir() if (p / "meta.json").exists()]
    assert len(sessions) == 1
    from gpuwatch.recording.reader import open_recording

    rec = open_recording(sessions[0])
    assert rec.steps.height >= 10 and rec.samples.height > 0
    assert set(rec.events["kind"].to_list()) >= {"session_start", "workload_start", "session_end"}


# -- the H200 benchmark's scenarios, dry run (CPU, tiny, simulated OOMs): their code paths and their JSON ---------
def test_the_guard_library_benchmark_dry_run(tmp_path, env):
    """support/library_scenarios.py, the scenarios benchmarks/guard_library.py runs on the H200."""
    out = tmp_path / "dry.json"
    env = dict(env, PYTHONPATH=str(ROOT / "tests") + os.pathsep + env["PYTHONPATH"])
    code = f"from support.library_scenarios import run; run({str(out)!r}, dry=True, budget_s=1000)"
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    s = res["scenarios"]
    assert not [k for k, v in s.items() if "error" in v], {k: v.get("traceback") for k, v in s.items()}
    assert set(s) == {"ramp-loop", "healthy", "fragment", "leak", "ramp-hf"}
    ramp = s["ramp-loop"]
    assert ramp["unguarded"]["ooms"] > 0 and ramp["unguarded"]["steps_lost"] > 0  # the ramp does pass the limit
    assert ramp["guarded"]["steps_lost"] == 0 and ramp["guarded"]["effective_batch"] == [16]
    assert ramp["guarded"]["guard_unable"] == 1  # a CPU: the guard says once it cannot act
    leak = s["leak"]["guarded"]
    assert leak["stopped"] and leak["checkpoint_calls"]  # never an OOM loop: checkpoint, then a clean stop
    hf = s["ramp-hf"]
    assert hf["unguarded"]["ooms"] > 0 and hf["guarded"]["crashed"] is None
    assert hf["guarded"]["effective_batch_per_step"] == [16] and hf["guarded"]["global_step"] == hf["steps"]
    assert set(res["targets"]) == {"ramp_loop_zero_ooms", "ramp_hf_zero_ooms", "fragment_zero_ooms", "leak_clean_stop",
                                   "healthy_ratio_ge_0.98"}
    assert 0 < s["healthy"]["tokens_per_s_ratio"]


class AllocWorkload(FloorWorkload):
    """torch allocated after each step follows `series` (one value per step)."""

    def __init__(self, series):
        super().__init__()
        self.series, self.i = series, 0

    def next_plan(self):
        return StepPlan(batch=8, seq_len=64, precision="bf16")

    def guard_view(self):
        from gpuwatch.contract import WorkloadView

        a = self.series[min(self.i, len(self.series) - 1)]
        self.i += 1
        return WorkloadView(gpu=0, ceiling=None, last_ok_batch=8, last_allocated_bytes=a, device="cuda")

    def accepts(self):
        return frozenset({"lower_ceiling", "stop", "name_leak"})


@pytest.mark.parametrize("series,stops", [([100 + 10 * i for i in range(12)], True),  # rises every step: a leak
                                          ([100] * 2 + [300] * 10, False)])  # one jump (optimizer state)
def test_the_guard_stops_a_leak_that_rises_every_step_not_a_one_off_jump(series, stops):
    bus, w = Bus(), AllocWorkload(series)
    g = Guard(bus, GuardConfig(cooldown_s=0.0), {0: w}, threshold=0.9, limits={0: 1000})
    g.on_risk(0, 0.1, [], {"alloc_growth_frac_per_step": 0.02, "next_peak_est_frac": 0.95, "plan_growth": 1.0},
              None, False)
    kinds = [g.before_step(w).kind for _ in series]
    assert ("stop" in kinds) is stops, kinds
    if stops:
        assert kinds.index("stop") >= 4 and g.stopped[0]


def test_a_grown_plan_is_rescored_only_when_it_could_matter():
    bus, w = Bus(), AllocWorkload([0])
    calls = []
    g = Guard(bus, GuardConfig(), {0: w}, threshold=0.9,
              rescore=lambda gpu, plan: calls.append(plan) or (0.1, [], {"next_peak_est_frac": 0.5}))
    g.on_risk(0, 0.05, [], {"next_peak_est_frac": 0.4}, {"batch": 8, "seq_len": 48}, False)
    g.before_step(w)  # 8 x 64 against 8 x 48: 0.4 x 1.33 = 0.53 < 0.8, risk far from the alarm
    assert not calls
    g.on_risk(0, 0.05, [], {"next_peak_est_frac": 0.7}, {"batch": 8, "seq_len": 48}, False)
    g.before_step(w)  # 0.7 x 1.33 = 0.93: scored before the step
    assert len(calls) == 1 and calls[0]["seq_len"] == 64
    g.on_risk(0, 0.6, [], {"next_peak_est_frac": 0.3}, {"batch": 8, "seq_len": 48}, False)
    g.before_step(w)  # the risk is within reach of the alarm
    assert len(calls) == 2


def test_stress_never_loops_on_ooms_at_batch_1_when_guarded():
    """recordings/sample-h200-guard-leak looped "OOM -> recovered: batch halved to 1" every 2 s."""
    from gpuwatch.workload.runner import Faults, Workload, WorkloadConfig
    from gpuwatch.workload.summary import format_summary, summarize

    bus = Bus()
    w = Workload(bus, WorkloadConfig(mode="prefill", batch=4, seq_len=16, integrity_every=0, max_steps=20,
                                     faults=Faults(oom_above_tokens=8), overrides={"num_hidden_layers": 1}))
    w.guard = Guard(bus, GuardConfig(), {None: w}, threshold=0.5, unable="no GPU: nothing to score")
    w.run()
    assert w.state == "stopped" and w.ooms == 4 and "twice in a row" in w.stopped_by  # 4, 2, 1, 1: then stop
    assert "STOPPED CLEANLY" in format_summary(summarize(w, bus))


def test_stress_on_a_cpu_keeps_its_guard_and_says_once_it_cannot_act():
    """`gpuwatch stress --guard on` on a CPU used to drop the guard without a word (`guard: null`)."""
    from gpuwatch.runtime import Session, SessionConfig
    from gpuwatch.workload.factory import WorkloadSpec

    s = Session(SessionConfig(sampler="thread", workload=WorkloadSpec(preset="tiny", device="cpu"),
                              guard=GuardConfig(mode="on")))
    try:
        assert s.guard is not None and s.guard.unable
        msgs = [e.message for e in events(s.bus, "guard_unable")]
        assert len(msgs) == 1 and "What would help" in msgs[0]
    finally:
        s.stop()


def test_a_cpu_loop_in_a_session_that_watches_gpus_says_so_once():
    """On a GPU machine, a loop whose model stayed on the CPU is not guarded in silence."""
    from gpuwatch.predict.model import DEFAULT_MODEL

    if not DEFAULT_MODEL.exists():
        pytest.skip("no shipped model")
    model = tiny_lm()
    with GuardedLoop(model, torch.optim.SGD(model.parameters(), lr=0.1), record_dir=None, source=str(RAMP),
                     sampler="thread") as g:
        for _ in range(3):
            g.step(torch.randint(0, 64, (4, 8)), lm_loss(model))
        msgs = [e.message for e in events(g.bus, "guard_unable")]
    assert len(msgs) == 1 and "runs on cpu" in msgs[0] and "CUDA device" in msgs[0]
