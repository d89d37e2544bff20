"""benchmarks/gpu_profile.py on the CPU (issue 30): the workload built as gpuwatch builds it, each mode timed and
profiled, the tables and the Markdown written; the kernel-name categories on real H200 kernel names."""

from __future__ import annotations

import importlib.util

import pytest

from conftest import ROOT


def _load():
    spec = importlib.util.spec_from_file_location("gpu_profile", ROOT / "benchmarks" / "gpu_profile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def gp():
    return _load()


@pytest.mark.parametrize("name, cat", [
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "dense GEMMs"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "dense GEMMs"),
    ("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int> >",
     "expert GEMMs (grouped_mm)"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<192, 128, 64, 4, false>>", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t>)", "attention"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::sigmoid_kernel_cuda(at::TensorIteratorBase&)>", "router/topk"),
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>", "router/topk"),
    ("void at::native::_scatter_gather_elementwise_kernel<128, 8>", "permutation/scatter/gather"),
    ("void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<>", "permutation/scatter/gather"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::TensorListMetadata<3>>",
     "optimizer"),
    ("Memcpy HtoD (Pageable -> Device)", "memcpy"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>", "elementwise/norms/upcasts"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float>", "elementwise/norms/upcasts"),
    ("aten::_grouped_mm", "expert GEMMs (grouped_mm)"),
    ("_route_act_kernel", "router/topk"), ("_rope_cache_kernel", "elementwise/norms/upcasts"),  # the decode's Triton
    ("_sum_experts_kernel", "elementwise/norms/upcasts"), ("triton_poi_fused_mul_silu_0", "elementwise/norms/upcasts"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wmma_f16_knob_3_64x64x64_4x1x1_kernel0", "attention"),
    ("aten::addmm", "dense GEMMs"),
])
def test_kernel_categories(gp, name, cat):
    assert gp.category(name) == cat


def test_union_of_overlapping_kernels(gp):
    assert gp._union_us([(0, 10), (5, 15), (20, 25)]) == 20
    assert gp._union_us([]) == 0


def test_profiles_every_mode_on_the_cpu(gp, tmp_path):
    res = gp.main(["--preset", "tiny", "--device", "cpu", "--seq-len", "16", "--batch", "train=2", "--batch", "prefill=2",
                   "--batch", "decode=2", "--new-tokens", "2", "--warmup", "0", "--steps", "1", "--out", str(tmp_path),
                   "--set", "num_hidden_layers=2"])
    assert [r["mode"] for r in res] == ["train", "prefill", "decode"]
    for r in res:
        assert "error" not in r, r
        p = r["profile"]
        assert p["wall_ms"] > 0 and p["kernel_ms"] > 0
        assert p["categories_ms"]["dense GEMMs"] > 0
        assert sum(p["categories_ms"].values()) == pytest.approx(p["kernel_ms"], rel=0.05, abs=0.05)
        assert p["top_kernels"] and all(k["category"] == gp.category(k["name"]) for k in p["top_kernels"])
        assert r["expert_impl"] and r["mfu"] is None  # a CPU: no peak to compare with
    train, _, decode = res
    assert train["profile"]["categories_ms"]["expert GEMMs (grouped_mm)"] > 0
    assert train["profile"]["scopes_ms"]["experts"] > 0 and train["profile"]["scopes_ms"]["attention"] > 0
    assert decode["decode_ms_per_token"] > 0 and decode["bound_ms_per_token"] > 0
    assert decode["bandwidth_fraction"] == pytest.approx(decode["bound_ms_per_token"] / decode["decode_ms_per_token"],
                                                         abs=1e-4)
    md = (tmp_path / "profile.md").read_text()
    assert md.count("| tiny |") == 3 and "idle/launch gaps" in md
    assert len((tmp_path / "profile.jsonl").read_text().splitlines()) == 3


def test_the_run_plan_puts_baselines_first_and_sweeps_switches_only_when_asked(gp):
    batches = {"train": [8, 16], "prefill": [32]}.get
    plan = gp.plan_runs(["train", "prefill"], ["baseline", "optimizer=sgd-fused", "lean=on"], {"train", "prefill"}, batches)
    assert plan == [("train", "baseline", 8), ("train", "baseline", 16), ("prefill", "baseline", 32),
                    ("train", "optimizer=sgd-fused", None), ("train", "lean=on", None), ("prefill", "lean=on", None)]
    swept = gp.plan_runs(["train"], ["lean=on"], {"train"}, batches, sweep=True)
    assert swept == [("train", "baseline", 8), ("train", "baseline", 16), ("train", "lean=on", 8), ("train", "lean=on", 16)]
    assert gp.plan_runs(["decode"], ["baseline", "lean=on"], {"train", "prefill"}, lambda m: [32]) == [("decode", "baseline", 32)]


def test_a_bad_variant_is_refused(gp):
    assert gp.parse_variant("baseline") == {}
    assert gp.parse_variant("attention=cudnn+optimizer=adamw-fused") == {"attention": "cudnn", "optimizer": "adamw-fused"}
    with pytest.raises(SystemExit):
        gp.parse_variant("cudnn")


def test_switches_run_beside_the_baseline_timed_and_reverted(gp, tmp_path):
    res = gp.main(["--preset", "tiny", "--device", "cpu", "--seq-len", "8", "--batch", "train=2", "--batch", "prefill=2",
                   "--modes", "train,prefill", "--variants", "baseline,optimizer=adamw-fused,lean=on", "--warmup", "0",
                   "--steps", "1", "--profile-steps", "0", "--variant-warmup", "0", "--variant-steps", "1",
                   "--out", str(tmp_path)])
    got = [(r["mode"], r["variant"]) for r in res]
    assert got == [("train", "baseline"), ("prefill", "baseline"), ("train", "optimizer=adamw-fused"),
                   ("train", "lean=on"), ("prefill", "lean=on")]  # the optimizer only where there is one
    assert all("error" not in r and r["profile"] is None for r in res)
    assert [r["expert_impl"] for r in res[2:]] == ["grouped_mm+optimizer=adamw-fused", "grouped_mm+lean=on",
                                                    "grouped_mm+lean=on"]
    md = (tmp_path / "profile.md").read_text()
    assert md.count("| x") == 3  # each switch's step time against its baseline's


def test_the_meter_reports_power_clocks_and_reasons_while_running(gp):
    import time
    import types

    reads = iter(range(10_000))

    def power(h):
        return 600_000 + 1000 * (next(reads) % 3)  # mW

    nv = types.SimpleNamespace(nvmlDeviceGetPowerUsage=power, NVML_CLOCK_SM=1, NVML_TEMPERATURE_GPU=0,
                               nvmlDeviceGetClockInfo=lambda h, c: 1980, nvmlDeviceGetTemperature=lambda h, t: 61,
                               nvmlDeviceGetCurrentClocksThrottleReasons=lambda h: 0x4,  # an older pynvml's name
                               nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=99),
                               nvmlDeviceGetEnforcedPowerLimit=lambda h: 700_000)
    m = gp.Meter(None)
    m._nv, m._h = nv, object()
    with m:
        time.sleep(0.4)
    s = m.summary()
    assert s["nvml_samples"] >= 2 and 600 <= s["power_w"] <= s["power_max_w"] <= 602
    assert s["sm_clock_mhz"] == 1980 and s["temp_max_c"] == 61 and s["clock_event_reasons"] == "0x4"
    assert s["power_limit_w"] == 700 and s["gpu_util_pct"] == 99
    assert gp.Meter(None).summary()["power_w"] is None  # no NVML: nulls, not a failure


@pytest.mark.gpu
def test_gpu_profile_of_the_small_preset_names_where_the_time_goes(gp, tmp_path):
    """On the GPU: every mode profiles, the kernels fall into the named categories (an "other" share above 15 %
    means kernel names the patterns miss: look at the top kernels), MFU is against the GPU's peak, decode's
    fraction of the bandwidth bound is a fraction."""
    res = gp.main(["--preset", "small", "--device", "cuda", "--warmup", "1", "--steps", "2", "--new-tokens", "16",
                   "--out", str(tmp_path)])
    assert [r["mode"] for r in res] == ["train", "prefill", "decode"]
    for r in res:
        assert "error" not in r, r
        cats = r["profile"]["categories_frac"]
        assert cats["dense GEMMs"] > 0 and cats["other"] < 0.15, r["profile"]["top_kernels"]
        assert r["mfu"] is not None and 0 < r["mfu"] < 1 and r["power_w"] and r["sm_clock_mhz"]
    train, prefill, decode = res
    for r in (train, prefill):
        assert r["profile"]["categories_ms"]["expert GEMMs (grouped_mm)"] > 0, r["profile"]["top_kernels"]
        assert r["profile"]["categories_ms"]["attention"] > 0, r["profile"]["top_kernels"]
    assert train["profile"]["categories_ms"]["optimizer"] > 0
    assert 0 < decode["bandwidth_fraction"] < 1.2
