"""The tiny DeepSeek preset on the CPU: every mode and schedule, controls, failures, FLOP counting."""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")

from gpuwatch.telemetry.bus import Bus  # noqa: E402
from gpuwatch.workload import flops as F  # noqa: E402
from gpuwatch.workload import model as M  # noqa: E402
from gpuwatch.workload.presets import choose_preset, config_fields, parse_overrides  # noqa: E402
from gpuwatch.workload.runner import Faults, Workload, WorkloadConfig  # noqa: E402
from gpuwatch.workload.schedule import Schedule  # noqa: E402

FAST = {"num_hidden_layers": 2, "vocab_size": 512}


def run(bus=None, **kw):
    bus = bus or Bus()
    kw.setdefault("overrides", FAST)
    kw.setdefault("integrity_every", 0)
    w = Workload(bus, WorkloadConfig(**kw))
    w.run()
    return w, bus


@pytest.mark.parametrize("mode", ["prefill", "decode", "train"])
def test_every_mode_runs_and_reports_step_metrics(mode):
    w, bus = run(mode=mode, batch=2, seq_len=16, max_steps=3)
    assert w.state == "finished" and len(bus.steps) == 3
    row = bus.steps.latest(1)[0]
    assert row["mode"] == mode and row["batch"] == 2 and row["seq_len"] == 16
    assert row["tokens_per_s"] > 0 and row["tflops"] > 0 and row["mfu"] is None  # no peak for a CPU
    assert row["expert_impl"] and row["precision"] == "fp32"
    assert (row["loss"] is not None) == (mode == "train")
    if mode == "train":
        assert 5.0 < row["loss"] < 8.0  # ~ln(512) for random weights


@pytest.mark.parametrize("schedule, expect", [
    ("steady", {"steady"}), ("soak", {"warmup"}), ("long", {"long"}), ("ramp", {"ramp b=1", "ramp b=2"}),
])
def test_schedules(schedule, expect):
    w, bus = run(schedule=schedule, batch=4, seq_len=8, max_steps=12, long_seq=256)
    phases = {r["phase"] for r in bus.steps.latest(50)}
    assert expect <= phases
    if schedule == "long":
        assert {(r["batch"], r["seq_len"]) for r in bus.steps.latest(50)} == {(1, 256)}


def test_sweep_runs_each_level_then_finishes():
    w, bus = run(schedule="sweep", seq_len=8, max_batch=4)
    assert w.state == "finished"
    assert [r["batch"] for r in bus.steps.latest(50)] == [1] * 6 + [2] * 6 + [4] * 6


def test_soak_overloads_after_warmup():
    s = Schedule("soak", batch=10, seq_len=8, warmup_steps=2)
    plans = []
    for _ in range(4):
        plans.append(s.plan()[:1] + s.plan()[2:])
        s.done()
    assert plans == [(5, "warmup"), (5, "warmup"), (11, "overload"), (11, "overload")]


def test_a_model_of_your_own_runs_as_built_and_is_described_by_its_config():
    """`Workload(model=)`: the caller's DeepseekV3ForCausalLM (here one layer and a vocabulary of 300, where the
    tiny preset says two and 4096) is run as given, not rebuilt, and the step figures follow its config."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    fields = config_fields("tiny", {"num_hidden_layers": 1, "vocab_size": 300})
    mine = DeepseekV3ForCausalLM(DeepseekV3Config(**fields))
    bus = Bus()
    w = Workload(bus, WorkloadConfig(preset="tiny", mode="train", batch=2, seq_len=8, integrity_every=0,
                                     max_steps=2), model=mine)
    assert w.params == F.param_count(fields) < F.param_count(config_fields("tiny"))
    w.run()
    assert w.state == "finished" and w.model is mine and len(bus.steps) == 2
    start = next(e for e in bus.events.latest(50) if e.kind == "workload_start")
    assert start.detail["build_s"] == 0.0
    assert bus.steps.latest(1)[0]["tflops"] == pytest.approx(
        F.step_flops(fields, "train", 2, 8, 0) / bus.steps.latest(1)[0]["step_time_s"] / 1e12, rel=1e-6)


def test_a_model_of_your_own_in_a_session_is_recorded_like_gpuwatchs(tmp_path):
    """The library path docs/LIBRARY.md shows: a Session running your model through the stress workload."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from gpuwatch.recording.reader import open_recording
    from gpuwatch.runtime import ModelChoice, Session, SessionConfig

    mine = DeepseekV3ForCausalLM(DeepseekV3Config(**config_fields("tiny", FAST)))
    cfg = SessionConfig(record_dir=tmp_path, sampler="thread", model=ModelChoice(enabled=False))
    wcfg = WorkloadConfig(preset="tiny", mode="prefill", batch=2, seq_len=8, integrity_every=0, max_steps=3)
    with Session(cfg, workloads=lambda bus, nvml_index: [Workload(bus, wcfg, model=mine)]) as s:
        assert s.wait(duration_s=120, until_done=True) == "done"
    rec = open_recording(next(tmp_path.iterdir()))
    assert rec.steps["step"].to_list() == [0, 1, 2] and s.workloads[0].model is mine


def test_a_model_of_your_own_on_another_device_or_of_another_family_is_refused():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        on_meta = DeepseekV3ForCausalLM(DeepseekV3Config(**config_fields("tiny")))
        gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="model= is on meta; this workload runs on cpu"):
        Workload(Bus(), WorkloadConfig(preset="tiny"), model=on_meta)
    with pytest.raises(ValueError, match="model= takes a DeepseekV3ForCausalLM; got GPT2LMHeadModel"):
        Workload(Bus(), WorkloadConfig(preset="tiny"), model=gpt2)


def test_controls_apply_between_steps():
    bus = Bus()
    w = Workload(bus, WorkloadConfig(batch=2, seq_len=8, overrides=FAST, integrity_every=0, max_steps=6))
    w.build()
    w.run_step(*w.schedule.plan())
    w.set_batch_size(3)
    w.set_seq_len(12)
    w.set_precision("bf16")
    assert bus.steps.latest(1)[0]["batch"] == 2  # nothing changes mid-step
    w._apply_controls()
    w.run_step(*w.schedule.plan())
    row = bus.steps.latest(1)[0]
    assert (row["batch"], row["seq_len"], row["precision"]) == (3, 12, "bf16")
    assert next(w.model.parameters()).dtype == torch.bfloat16
    kinds = [e.kind for e in bus.events.latest(10)]
    assert kinds.count("control") == 3
    with pytest.raises(ValueError):
        w.set_precision("int3")


def test_pause_resume_stop_from_another_thread():
    import time

    bus = Bus()
    w = Workload(bus, WorkloadConfig(batch=1, seq_len=8, overrides=FAST, integrity_every=0))
    w.start()
    while len(bus.steps) < 2:
        time.sleep(0.01)
    w.pause()
    time.sleep(0.2)
    n = len(bus.steps)
    time.sleep(0.3)
    assert w.state == "paused" and len(bus.steps) <= n + 1
    w.resume()
    while len(bus.steps) < n + 3:
        time.sleep(0.01)
    w.stop()
    assert w.state == "stopped"


def test_an_oom_is_recovered_outside_the_handler_and_recorded(monkeypatch):
    bus = Bus()
    w = Workload(bus, WorkloadConfig(batch=8, seq_len=8, overrides=FAST, integrity_every=0, max_steps=4))
    real = M.step_prefill
    calls = {"n": 0}

    def flaky(model, ids):
        calls["n"] += 1
        if calls["n"] == 2:
            big = torch.ones(1024, 1024)  # a tensor the failed step holds
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {big.numel()} bytes")
        return real(model, ids)
    monkeypatch.setattr(M, "step_prefill", flaky)
    w.run()
    assert w.state == "finished" and w.ooms == 1 and w.recovered == 1
    kinds = [e.kind for e in bus.events.latest(20)]
    assert kinds.index("oom") < kinds.index("oom_recovered")
    rec = next(e for e in bus.events.latest(20) if e.kind == "oom_recovered")
    assert "batch halved to 4" in rec.message
    assert [r["batch"] for r in bus.steps.latest(10)] == [8, 4, 4, 4]


def test_an_unrecoverable_error_is_an_event_not_a_crash(monkeypatch):
    def broken(model, ids):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(M, "step_prefill", broken)
    w, bus = run(batch=1, seq_len=8, max_steps=3)
    assert w.state == "failed" and "illegal memory access" in w.unrecovered
    assert [e.kind for e in bus.events.latest(5)][-2:] == ["workload_error", "workload_stop"]


def test_fp16_overflow_fault_gives_nonfinite_events():
    w, bus = run(mode="train", precision="fp16", batch=1, seq_len=8, max_steps=3,
                 faults=Faults(fp16_overflow=True))
    assert w.nonfinite >= 1
    assert any(e.kind == "nonfinite" for e in bus.events.latest(20))
    assert w.state == "finished"  # and it carried on


def test_fragmentation_fault_varies_sequence_length():
    w, bus = run(batch=1, seq_len=64, max_steps=8, faults=Faults(fragment=True))
    lens = {r["seq_len"] for r in bus.steps.latest(20)}
    assert len(lens) > 2 and all(16 <= s <= 64 for s in lens)


def test_integrity_check_passes_and_catches_a_mismatch(monkeypatch):
    w, bus = run(batch=1, seq_len=8, max_steps=2, integrity_every=1)
    assert w.integrity_failures == 0
    flip = {"n": 0}

    def noisy(module, inputs, output):
        flip["n"] += 1
        return output + flip["n"]  # a different answer each call, as a broken GPU would give
    w.model.get_input_embeddings().register_forward_hook(noisy)
    w._integrity()
    assert w.integrity_failures == 1
    assert bus.events.latest(1)[0].kind == "integrity_mismatch"


def test_flop_count_matches_a_hand_count():
    c = config_fields("tiny")
    h, heads, V = 128, 4, 4096
    q = h * heads * 48  # no q LoRA: hidden -> heads x (32 nope + 16 rope)
    kv_a = h * (64 + 16)
    kv_b = 64 * heads * (32 + 32)
    o = heads * 32 * h
    attn = q + kv_a + kv_b + o
    dense_mlp = 3 * h * 256
    moe = (2 + 1) * 3 * h * 64 + h * 8  # top-2 routed + 1 shared expert, plus the router
    body = 2 * attn + dense_mlp + moe
    assert F.active_matmul_params(c) == body + V * h
    b, s = 2, 16
    attn_flops = 2 * 2 * heads * (48 + 32) * (s + 1) / 2  # 2 layers, QK and PV, mean causal span
    expect_prefill = b * s * (2 * body + attn_flops) + b * 2 * V * h
    assert F.step_flops(c, "prefill", b, s) == pytest.approx(expect_prefill)
    expect_train = 3 * (b * s * (2 * body + attn_flops) + b * s * 2 * V * h)
    assert F.step_flops(c, "train", b, s) == pytest.approx(expect_train)
    assert F.param_count(config_fields("v2-lite")) == pytest.approx(15.7e9, rel=0.01)


def test_preset_choice_and_overrides():
    assert choose_preset(None) == "tiny"
    assert choose_preset(141 * 2**30) == "v2-lite"
    assert choose_preset(8 * 2**30) == "small"
    assert parse_overrides(["num_hidden_layers=4", "q_lora_rank=None", "rope_theta=1e4", "x=true"]) == {
        "num_hidden_layers": 4, "q_lora_rank": None, "rope_theta": 1e4, "x": True}


def test_bad_device_is_a_usage_error():
    from gpuwatch.errors import UsageError

    with pytest.raises(UsageError):
        M.resolve_device("tpu:9")


def test_the_workload_offers_the_controls_a_guard_drives():
    from gpuwatch.control import WorkloadControls

    w = Workload(Bus(), WorkloadConfig(batch=2, seq_len=8, overrides=FAST))
    assert isinstance(w, WorkloadControls)
    assert w.batch == 2 and w.precision == "fp32" and w.state == "idle"


def test_decode_capture_is_a_compiling_phase_and_the_step_rows_say_what_ran(monkeypatch):
    """While the decode engine (re)builds its cache and graphs the workload's state is `compiling` (the TUI
    shows it); the build is an event; each step row names the path that ran it."""
    from gpuwatch.ui.render import workload_lines

    seen = []
    real = M.DecodeEngine.prepare

    def prepare(self, batch, prompt_len):
        state, before = w.state, self.captures
        out = real(self, batch, prompt_len)
        if self.captures != before:  # a (re)build happened in this call
            seen.append(state)
        return out
    monkeypatch.setattr(M.DecodeEngine, "prepare", prepare)

    class StaticEngine(M.DecodeEngine):  # a CPU runs eager by default; build the static fast step instead
        def __init__(self, *a, **k):
            super().__init__(*a, **{**k, "graphs": False})
    monkeypatch.setattr(M, "DecodeEngine", StaticEngine)
    bus = Bus()
    w = Workload(bus, WorkloadConfig(mode="decode", batch=2, seq_len=8, overrides=FAST, integrity_every=0,
                                     max_steps=2, graphs="on", decode_tokens=3))
    w.run()
    assert seen and set(seen) == {"compiling"} and w.state == "finished"
    rows = bus.steps.latest(10)
    # "+fused": the Triton kernels ran (in Triton's interpreter on a CPU: tests/conftest.py)
    assert rows and all(re.fullmatch(r".+\+mla-absorbed(\+fused)?/static", r["expert_impl"]) for r in rows), rows
    compile_events = [e for e in bus.events.latest(50) if e.kind == "compile"]
    assert any("absorbed MLA" in e.message and e.detail.get("impl") == "fast" for e in compile_events)
    line = workload_lines(rows, {"state": "compiling", "preset": "tiny"}, None, wide=True)[0]
    assert "compiling" in line.plain
    assert any(sp.style == "bold yellow" and line.plain[sp.start:sp.end] == "compiling" for sp in line.spans)
