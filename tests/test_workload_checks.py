"""What a workload is refused for before anything is built: a model config that torch would fail on (or
that would run a degenerate model), and a preset too large for the device's memory. Either is one line,
a non-zero exit and no session folder - not a failure inside torch after seconds of building."""

from __future__ import annotations

import time

import pytest

from gpuwatch.errors import UsageError
from gpuwatch.workload import sizing
from gpuwatch.workload.presets import PRESETS, check_config, config_fields

GiB = 2**30


# -- defect 6: the config's own constraints ------------------------------------------------------------------

@pytest.mark.parametrize("overrides, needle", [
    ({"hidden_size": 0}, "--set hidden_size=0: hidden_size must be at least 1"),
    ({"hidden_size": 7}, "--set hidden_size=7: hidden_size must be a multiple of 8"),
    ({"moe_intermediate_size": 12}, "moe_intermediate_size must be a multiple of 8"),
    ({"n_routed_experts": 0}, "--set n_routed_experts=0: n_routed_experts must be at least 1"),
    ({"num_hidden_layers": 0}, "--set num_hidden_layers=0: num_hidden_layers must be at least 1"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok must be at least 1"),
    ({"n_routed_experts": 4, "num_experts_per_tok": 8}, "num_experts_per_tok (8) must be at most n_routed_experts (4)"),
    ({"first_k_dense_replace": 3}, "first_k_dense_replace (3) must be at most num_hidden_layers (2)"),
    ({"num_attention_heads": 0}, "num_attention_heads must be at least 1"),
    ({"num_key_value_heads": 2}, "num_key_value_heads (2) must equal num_attention_heads (4)"),
    ({"vocab_size": 0}, "vocab_size must be at least"),
    ({"kv_lora_rank": 0}, "kv_lora_rank must be at least 1"),
    ({"q_lora_rank": 0}, "q_lora_rank must be at least 1 (or None"),
    ({"v_head_dim": 0}, "v_head_dim must be at least 1"),
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim must be even"),
    ({"n_group": 3}, "n_routed_experts (8) must be a multiple of n_group (3)"),
    ({"n_group": 8, "topk_group": 8}, "at least 2 experts per group"),
    ({"n_group": 2, "topk_group": 3}, "topk_group (3) must be at most n_group (2)"),
    ({"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}, "num_experts_per_tok (3) must be at most"),
    ({"hidden_act": "nope"}, "hidden_act 'nope' is not an activation"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps must be > 0"),
])
def test_bad_configs_are_refused_naming_the_field(overrides, needle):
    with pytest.raises(UsageError) as e:
        check_config(config_fields("tiny", overrides), overrides, "tiny")
    msg = str(e.value)
    assert needle in msg and "\n" not in msg, msg


def test_a_preset_field_in_conflict_is_named_as_the_presets():
    # the override is fine on its own; the preset's own num_experts_per_tok (2) is what it conflicts with
    with pytest.raises(UsageError) as e:
        check_config(config_fields("tiny", {"n_routed_experts": 1}), {"n_routed_experts": 1}, "tiny")
    assert "--set n_routed_experts=1" in str(e.value)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_passes(name):
    check_config(config_fields(name), {}, name)


def test_odd_but_valid_configs_pass():
    for ov in ({"hidden_size": 96}, {"num_hidden_layers": 1, "first_k_dense_replace": 1}, {"first_k_dense_replace": 0},
               {"q_lora_rank": None}, {"q_lora_rank": 32}, {"n_shared_experts": 0}, {"n_group": 2, "topk_group": 1},
               {"num_attention_heads": 3, "num_key_value_heads": 3}):
        check_config(config_fields("tiny", ov), ov, "tiny")


def test_make_workloads_checks_the_config_before_building(monkeypatch):
    from gpuwatch.telemetry.bus import Bus
    from gpuwatch.workload import factory, runner

    built = []
    monkeypatch.setattr(runner.Workload, "__init__", lambda self, *a, **k: built.append(1))
    spec = factory.WorkloadSpec(preset="tiny", device="cpu", overrides={"num_hidden_layers": 0})
    with pytest.raises(UsageError, match="num_hidden_layers must be at least 1"):
        factory.make_workloads(spec, Bus())
    assert built == []


# -- defect 5: the preset's size against the device's memory ------------------------------------------------

def test_the_estimate_counts_weights_gradients_and_activations():
    f = config_fields("v3-slice")
    from gpuwatch.workload.flops import param_count

    params = param_count(f)
    infer = sizing.estimate(f, "prefill", "fp32", 1, 512)
    train = sizing.estimate(f, "train", "fp32", 1, 512)
    assert infer.weights == params * 4 and infer.state == 0 and infer.activations > 0
    assert train.weights == infer.weights and train.state == params * 4  # SGD: the gradients
    assert train.activations > infer.activations  # a train step keeps every layer's activations for backward
    half = sizing.estimate(f, "prefill", "bf16", 1, 512)
    assert half.weights == params * 2
    big = sizing.estimate(f, "prefill", "fp32", 16, 512)
    assert big.activations > infer.activations
    assert infer.total == infer.weights + infer.state + infer.activations


def test_the_estimate_of_the_tiny_preset_is_small():
    est = sizing.estimate(config_fields("tiny"), "train", "fp32", 4, 64)
    assert est.total < 256 * 2**20


def test_v3_slice_on_a_23_gib_cpu_is_refused_up_front(monkeypatch):
    monkeypatch.setattr(sizing, "available_bytes", lambda dev, limit=None: int(23.5 * GiB))
    from gpuwatch.telemetry.bus import Bus
    from gpuwatch.workload import factory

    spec = factory.WorkloadSpec(preset="v3-slice", device="cpu")
    t0 = time.monotonic()
    with pytest.raises(UsageError) as e:
        factory.make_workloads(spec, Bus())
    msg = str(e.value)
    assert time.monotonic() - t0 < 5  # no build
    assert "v3-slice" in msg and "23.5 GiB" in msg and "\n" not in msg, msg
    assert "GiB" in msg and "cpu" in msg.lower()


def test_a_preset_that_fits_is_not_refused(monkeypatch):
    monkeypatch.setattr(sizing, "available_bytes", lambda dev, limit=None: int(23.5 * GiB))
    est = sizing.estimate(config_fields("small"), "train", "fp32", 8, 512)
    sizing.check_fits(est, int(23.5 * GiB), "small", "train", "fp32", "cpu")  # no raise


def test_stress_v3_slice_on_a_small_cpu_is_one_line_exit_2_and_no_session(monkeypatch, tmp_path, capsys):
    from gpuwatch.cli import main

    monkeypatch.setattr(sizing, "available_bytes", lambda dev, limit=None: int(23.5 * GiB))
    t0 = time.monotonic()
    rc = main(["stress", "--preset", "v3-slice", "--device", "cpu", "--duration", "10s", "--no-model",
               "--sampler", "thread", "-o", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and time.monotonic() - t0 < 20
    assert len(err) == 1 and "v3-slice" in err[0] and "Traceback" not in err[0], err
    assert list(tmp_path.iterdir()) == []  # no session folder


def test_stress_bad_set_is_one_line_exit_2_and_no_session(monkeypatch, tmp_path, capsys):
    from gpuwatch.cli import main

    rc = main(["stress", "--preset", "tiny", "--device", "cpu", "--set", "hidden_size=7", "--no-model",
               "--sampler", "thread", "-o", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "hidden_size must be a multiple of 8" in err[0], err
    assert list(tmp_path.iterdir()) == []


# -- defect 5: --duration during a long build ------------------------------------------------------------------

class _SlowModel:
    """Stands in for DeepseekV3ForCausalLM: registers a module every 0.1 s for 5 s (a large preset's build)."""

    built: list[int] = []

    def __new__(cls, config):
        import torch

        m = torch.nn.Module()
        m.parts = torch.nn.ModuleList()
        for i in range(50):
            time.sleep(0.1)
            m.parts.append(torch.nn.Linear(4, 4))
            cls.built.append(i)
        m.config = config
        return m


def _slow_workload(monkeypatch):
    from gpuwatch.telemetry.bus import Bus
    from gpuwatch.workload import model as M
    from gpuwatch.workload.runner import Workload, WorkloadConfig

    monkeypatch.setattr(M, "DeepseekV3ForCausalLM", _SlowModel)
    bus = Bus()
    return Workload(bus, WorkloadConfig(preset="tiny", integrity_every=0)), bus


def _wait_state(w, state, timeout=10.0):
    deadline = time.monotonic() + timeout
    while w.state != state and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w.state == state


def test_stop_during_a_long_build_ends_it_at_once(monkeypatch):
    w, bus = _slow_workload(monkeypatch)
    w.start()
    _wait_state(w, "building")
    time.sleep(0.3)
    t0 = time.monotonic()
    w.stop()  # what the session does when --duration ends
    took = time.monotonic() - t0
    assert took < 1.5, f"stop waited {took:.1f} s for the build"
    assert w.state == "stopped" and len(bus.steps) == 0
    kinds = [e.kind for e in bus.events.latest(20)]
    assert "workload_error" not in kinds and kinds[-1] == "workload_stop"


def test_a_deadline_that_passes_during_the_build_ends_the_build_and_no_step_runs(monkeypatch):
    w, bus = _slow_workload(monkeypatch)
    _SlowModel.built.clear()
    w.ends_at = time.time() + 0.3
    w.start()
    time.sleep(1.5)
    assert len(_SlowModel.built) < 10, "the build went on past the run's deadline"
    t0 = time.monotonic()
    w.stop()
    assert time.monotonic() - t0 < 1.0
    assert w.state == "stopped" and len(bus.steps) == 0
    assert "workload_error" not in [e.kind for e in bus.events.latest(20)]


@pytest.mark.parametrize("name, peak", [("NVIDIA H200", 989.4), ("NVIDIA H200 NVL", 835.5), ("NVIDIA H100 PCIe", 756.5),
                                        ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA A100-SXM4-80GB", 312.0)])
def test_a_step_rows_mfu_is_against_the_peak_of_the_gpu_it_ran_on(name, peak):
    """The health matrix's compute row is the median of the step rows' mfu: each row must divide by the peak of
    the GPU the step ran on (its form factor too: an H200 NVL's 835 TFLOP/s, not the SXM's 989)."""
    from gpuwatch.telemetry.bus import Bus
    from gpuwatch.workload import flops as F
    from gpuwatch.workload.runner import Workload, WorkloadConfig

    assert F.peak_tflops(name, "bf16") == peak and F.peak_tflops("CPU", "bf16") is None
    w = Workload(Bus(), WorkloadConfig(preset="tiny", mode="prefill", batch=1, seq_len=8, integrity_every=0,
                                       overrides={"vocab_size": 512}, precision="bf16"))
    w.device_name = name  # what torch.cuda.get_device_name says on that GPU
    w.build()
    row = w.timed_step(1, 8, "steady")
    assert row["mfu"] == pytest.approx(row["tflops"] / peak)
