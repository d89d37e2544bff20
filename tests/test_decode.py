"""DecodeEngine: the static-cache decode computes what eager decode computes (CPU, tiny preset), and on a
GPU (marked, skipped in CI) the CUDA-graph path matches eager and re-captures when the shape changes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gpuwatch.workload import model as M  # noqa: E402
from gpuwatch.workload.presets import config_fields  # noqa: E402


def _reference(model, ids, new_tokens):
    """Eager decode with transformers' dynamic cache (step_decode's loop), recording each argmax."""
    return M.decode_eager(model, ids, new_tokens, keep_tokens=True)


def _build(device="cpu", precision="fp32", preset="tiny"):
    model, _ = M.build_model(config_fields(preset), torch.device(device), precision, seed=0)
    return model


@pytest.fixture(scope="module")
def tiny():
    return _build()


def _ids(batch, seq, device="cpu", seed=1):
    g = torch.Generator(device=device).manual_seed(seed)
    return M.random_ids(4096, batch, seq, torch.device(device), g)


@pytest.mark.parametrize("batch,prompt,new", [(4, 32, 8), (1, 17, 5), (3, 64, 1)])
def test_static_cache_decode_matches_eager(tiny, batch, prompt, new):
    ids = _ids(batch, prompt)
    ref_tokens, ref_logits = _reference(tiny, ids, new)
    _, ref_max = M.step_decode(tiny, ids, new)
    events = []
    eng = M.DecodeEngine(tiny, batch, prompt, new, "cpu", lambda k, m, **d: events.append((k, m, d)),
                         graphs=False, record_tokens=True)
    _, got_max = eng.step(ids)
    assert eng.mode == "static"
    assert torch.equal(eng.tokens, ref_tokens)  # the same greedy sequence
    assert torch.allclose(eng._st["logits"][:, 0], ref_logits, atol=1e-4, rtol=1e-4)
    assert got_max == pytest.approx(ref_max, rel=1e-4)
    assert events and events[0][0] == "compile" and events[0][2]["mode"] == "static"


def test_static_engine_reuses_its_cache_and_rebuilds_when_the_shape_or_dtype_changes(tiny):
    events = []
    eng = M.DecodeEngine(tiny, 2, 16, 4, "cpu", lambda k, m, **d: events.append(d), graphs=False, record_tokens=True)
    a = _ids(2, 16, seed=3)
    eng.step(a)
    first = eng.tokens.clone()
    eng.step(_ids(2, 16, seed=4))
    eng.step(a)  # a second run over the same cache gives the same answer (the cache is rewound)
    assert torch.equal(eng.tokens, first) and eng.captures == 1
    eng.step(_ids(3, 16, seed=5))  # the guard changed the batch
    assert eng.captures == 2 and eng._st["ids"].shape == (3, 16)
    ref, _ = _reference(tiny, _ids(3, 20, seed=6), 4)
    eng.step(_ids(3, 20, seed=6))  # a new prompt length
    assert eng.captures == 3 and torch.equal(eng.tokens, ref)


def test_prefill_only_engine_matches_step_prefill(tiny):
    ids = _ids(4, 32)
    _, ref = M.step_prefill(tiny, ids)
    eng = M.DecodeEngine(tiny, 4, 32, 0, "cpu", graphs=False)  # no graphs: prefill is plain step_prefill
    _, got = eng.step(ids)
    assert eng.mode == "eager" and got == pytest.approx(ref, rel=1e-6)


def test_small_prefill_through_the_static_cache_matches_step_prefill(tiny):
    """The body a small prefill's graph holds, run eagerly: same logits as step_prefill."""
    ids = _ids(4, 32)
    _, ref = M.step_prefill(tiny, ids)
    eng = M.DecodeEngine(tiny, 4, 32, 1, "cpu", graphs=False)
    eng.prepare(4, 32)
    with torch.inference_mode():
        eng._reset()
        eng._st["ids"].copy_(ids)
        eng._prefill_body()
    assert eng._st["logits"].abs().max().item() == pytest.approx(ref, rel=1e-4)


def test_large_prefill_stays_eager(tiny):
    eng = M.DecodeEngine(tiny, 64, 512, 0, "cpu", graphs=False)
    eng.prepare(64, 512)
    assert eng.mode == "eager" and not eng._st and not eng._forced_eager


def test_cpu_default_is_eager_and_says_so(tiny):
    events = []
    eng = M.DecodeEngine(tiny, 2, 16, 3, "cpu", lambda k, m, **d: events.append((k, m)))
    ids = _ids(2, 16)
    assert eng.step(ids)[1] == pytest.approx(M.step_decode(tiny, ids, 3)[1], rel=1e-5)
    eng.step(ids)
    assert eng.mode == "eager" and eng.compile_s == 0.0
    assert len(events) == 1 and events[0][0] == "compile" and "eager" in events[0][1]


def test_a_failed_capture_falls_back_to_the_ungraphed_step_and_says_why(tiny):
    """Asking for graphs where there is no CUDA (here: the CPU) must not break the step: the fast step
    runs without graphs (and would run eager if that failed too)."""
    events = []
    eng = M.DecodeEngine(tiny, 2, 16, 3, "cpu", lambda k, m, **d: events.append((k, m, d)), graphs=True)
    ids = _ids(2, 16)
    assert eng.step(ids)[1] == pytest.approx(M.step_decode(tiny, ids, 3)[1], rel=1e-5)
    assert eng.mode == "static" and eng.impl == "fast"
    said = [(m, d) for _, m, d in events if d.get("fallback")]
    assert len(said) == 1 and said[0][1]["fallback"] == "static"
    assert "could not build" in said[0][0] and "in CUDA graphs" in said[0][0] and "without graphs" in said[0][0]
    eng.step(_ids(3, 16))  # a rebuild does not try to capture again
    assert sum(bool(d.get("fallback")) for _, _, d in events) == 1 and eng.mode == "static"


def test_when_the_ungraphed_step_fails_too_decode_runs_eager(tiny, monkeypatch):
    from gpuwatch.workload import fastpath

    def refuse(self, *a, **k):
        raise RuntimeError("no such kernel for this dtype")
    monkeypatch.setattr(fastpath.FastDeepseek, "prefill", refuse)
    events = []
    eng = M.DecodeEngine(tiny, 2, 16, 3, "cpu", lambda k, m, **d: events.append((k, m, d)), graphs=True)
    ids = _ids(2, 16)
    assert eng.step(ids)[1] == pytest.approx(M.step_decode(tiny, ids, 3)[1], rel=1e-5)
    assert eng.mode == "eager"
    said = [(m, d) for _, m, d in events if d.get("fallback") == "eager"]
    # one line that names every plan tried and why each failed
    from gpuwatch.workload import kernels

    plans_in_graphs = 3 if kernels.usable(torch.device("cpu")) is None else 2  # + the fused kernels' plan
    assert len(said) == 1 and "no such kernel" in said[0][0] and said[0][0].count("in CUDA graphs:") == plans_in_graphs
    assert "gpuwatch's step without graphs: RuntimeError: no such kernel" in said[0][0]


def test_shapes_that_change_every_step_stop_recapturing(tiny):
    events = []
    eng = M.DecodeEngine(tiny, 2, 8, 2, "cpu", lambda k, m, **d: events.append(d), graphs=False)
    for seq in (8, 9, 10, 11, 12, 13):  # the fragment fault
        eng.step(_ids(2, seq))
    assert eng.mode == "eager" and any(d.get("reason") == "shapes unstable" for d in events)


def test_the_captured_bodies_never_read_a_tensor_value_on_the_host():
    """What a CUDA graph needs, checked without a GPU: the prefill and one-token bodies run on the meta
    device, where any host read of a value (.item(), a Python branch on a tensor, nonzero) raises. bf16:
    grouped_mm's meta kernel (like the CUDA one) takes bf16."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = DeepseekV3ForCausalLM(DeepseekV3Config(**config_fields("tiny"))).eval()
    finally:
        torch.set_default_dtype(old)
    eng = M.DecodeEngine(model, 2, 8, 3, "meta", graphs=False)
    eng._build(2, 8)
    with torch.inference_mode():
        eng._prefill_body()
        eng._decode_body()
        eng._decode_body()
    assert eng._st["tok"].shape == (2, 1) and eng._st["logits"].shape == (2, 1, 4096)


# -- the engine's builds (static cache + graphs) are bounded: defect 8 ---------------------------------------------

class _FakeGraph:
    """What `_capture` gives on a CPU in these tests: replay() runs the captured body, reset() is counted
    (a CUDAGraph's reset() gives its private memory pool back)."""

    def __init__(self, body):
        self.body, self.resets = body, 0

    def replay(self):
        self.body()

    def reset(self):
        self.resets += 1


def _fake_capture(monkeypatch):
    made = []

    def capture(self, body):
        made.append(_FakeGraph(body))
        return made[-1]
    monkeypatch.setattr(M.DecodeEngine, "_capture", capture)
    return made


def test_a_moved_batch_releases_the_last_batchs_graphs_and_cache(tiny, monkeypatch):
    """keep=1 (the default): when the batch moves, the graphs of the batch no longer run are reset and its
    static KV cache freed before the new one is built; the engine holds one build, whatever it visited."""
    import gc
    import weakref

    made = _fake_capture(monkeypatch)
    eng = M.DecodeEngine(tiny, 2, 8, 2, "cpu", graphs=True)
    ids2 = _ids(2, 8)
    assert eng.step(ids2)[1] == pytest.approx(M.step_decode(tiny, ids2, 2)[1], rel=1e-5)
    assert eng.mode == "graphs" and eng.captures == 1 and len(made) == 2  # prefill + decode graphs
    first = list(made)
    cache = weakref.ref(eng._st["fast"].kv)
    eng.step(ids2)
    assert eng.captures == 1  # same batch: replayed, not captured again
    for b in (3, 4, 2):
        eng.step(_ids(b, 8))
        eng.step(_ids(b, 8))
        assert eng.held_builds == 1
    assert eng.captures == 4 and eng.mode == "graphs"
    assert all(g.resets == 1 for g in first), [g.resets for g in first]
    gc.collect()
    assert cache() is None, "the first batch's static KV cache is still alive"
    assert all(g.resets == 1 for g in made[:-2]) and all(g.resets == 0 for g in made[-2:])
    eng.release()
    assert eng.held_builds == 0 and all(g.resets == 1 for g in made)


def test_keep_n_reuses_the_builds_of_recent_batches_and_evicts_the_least_recent(tiny, monkeypatch):
    made = _fake_capture(monkeypatch)
    eng = M.DecodeEngine(tiny, 2, 16, 3, "cpu", graphs=True, keep=2)
    for b in (2, 3):
        eng.step(_ids(b, 16))
        eng.step(_ids(b, 16))
    assert eng.captures == 2 and eng.held_builds == 2
    ids2 = _ids(2, 16, seed=7)
    assert not eng.needs_build(2, 16)  # held: no compiling phase, no capture
    assert eng.step(ids2)[1] == pytest.approx(M.step_decode(tiny, ids2, 3)[1], rel=1e-5)
    assert eng.captures == 2 and eng.compile_s == 0.0 and eng.mode == "graphs"
    eng.step(_ids(4, 16))  # batch 3 is now the least recently run: evicted
    assert eng.captures == 3 and eng.held_builds == 2
    assert [g.resets for g in made] == [0, 0, 1, 1, 0, 0]
    M.apply_precision(tiny, "fp32")  # same dtype: nothing stale
    assert eng.held_builds == 2


def test_builds_of_other_weights_are_dropped(tiny, monkeypatch):
    """A precision change gives the weights new storage: builds over the old weights would pin them."""
    made = _fake_capture(monkeypatch)
    model = _build()
    eng = M.DecodeEngine(model, 2, 16, 3, "cpu", graphs=True, keep=4)
    for b in (2, 3):
        eng.step(_ids(b, 16))
        eng.step(_ids(b, 16))
    M.apply_precision(model, "bf16")
    eng.step(_ids(2, 16))
    assert eng.held_builds == 1 and [g.resets for g in made[:4]] == [1, 1, 1, 1]


# -- on a GPU (run on the H200; skipped in CI) ------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("moe,compiled", [("dense", False), ("module", False), ("dense", True)])
def test_fast_path_on_cuda_in_fp32_decodes_what_transformers_decodes(moe, compiled):
    """The same math on CUDA kernels (and, compiled, inductor's fused ones): fp32 (no TF32), no graphs (the
    experts loop of transformers' eager implementation needs no bf16), same greedy tokens and logits as
    transformers' eager decode."""
    model = _build("cuda:0", "fp32", "small")
    ids = _ids(8, 64, "cuda:0")
    ref_tokens, ref_logits = _reference(model, ids, 8)
    eng = M.DecodeEngine(model, 8, 64, 8, "cuda:0", graphs=False, record_tokens=True, moe=moe, compile=compiled)
    eng.step(ids)
    assert eng.impl == "fast" and eng.mode == "static" and bool(eng.detail.get("compiled")) == compiled
    assert torch.equal(eng.tokens, ref_tokens)
    scale = ref_logits.abs().max().item()
    assert (eng._st["logits"][:, 0] - ref_logits).abs().max().item() <= 1e-3 * scale


@pytest.mark.gpu
@pytest.mark.parametrize("moe", ["dense", "module"])
def test_cuda_graph_replays_exactly_what_the_same_step_computes_without_graphs(moe):
    """bf16: the captured step gives the tokens the ungraphed fast step gives (the same kernels). Tokens are
    not compared with transformers in bf16: with random weights the MoE routing flips on bf16 rounding
    differences, and then the sequences part (transformers' own cached decode and its full forward
    disagree the same way)."""
    model = _build("cuda:0", "bf16", "small")
    ids = _ids(8, 64, "cuda:0")
    events = []
    eng = M.DecodeEngine(model, 8, 64, 8, "cuda:0", lambda k, m, **d: events.append((k, m, d)), record_tokens=True,
                         moe=moe, compile=False)
    eng.step(ids)
    assert eng.mode == "graphs" and eng.impl == "fast", events
    graphed = eng.tokens.clone()
    plain = M.DecodeEngine(model, 8, 64, 8, "cuda:0", graphs=False, record_tokens=True, moe=moe, compile=False)
    plain.step(ids)
    assert plain.mode == "static" and torch.equal(plain.tokens, graphed)
    eng.step(ids)
    assert torch.equal(eng.tokens, graphed)  # a replay over the rewound cache: the same answer


@pytest.mark.gpu
def test_cuda_graph_engine_recaptures_on_batch_and_precision_change():
    model = _build("cuda:0", "bf16", "small")
    eng = M.DecodeEngine(model, 4, 32, 4, "cuda:0", record_tokens=True)
    eng.step(_ids(4, 32, "cuda:0"))
    assert eng.mode == "graphs" and eng.captures == 1 and eng.compile_s > 0
    eng.step(_ids(4, 32, "cuda:0"))
    assert eng.captures == 1 and eng.compile_s == 0.0
    eng.step(_ids(2, 32, "cuda:0"))
    assert eng.captures == 2
    M.apply_precision(model, "fp16")
    try:
        M.step_decode(model, _ids(2, 32, "cuda:0"), 1)
    except RuntimeError as e:  # e.g. grouped_mm without fp16 on this torch: eager cannot run it either
        pytest.skip(f"eager fp16 decode fails here: {e}")
    events = []
    eng.on_event = lambda k, m, **d: events.append((m, d))
    eng.step(_ids(2, 32, "cuda:0"))
    eng.step(_ids(2, 32, "cuda:0"))
    print(events)
    # re-captured for the new weights, or (fp16 kernels this torch cannot capture) said why and ran anyway
    assert eng.captures == 3 or any(d.get("fallback") for _, d in events), events
    last = eng._st["logits"] if eng.mode != "eager" else None
    assert last is None or last.isfinite().all()


@pytest.mark.gpu
def test_cuda_graph_small_prefill_matches_step_prefill():
    model = _build("cuda:0", "bf16", "small")
    ids = _ids(2, 64, "cuda:0")
    _, ref = M.step_prefill(model, ids)
    eng = M.DecodeEngine(model, 2, 64, 0, "cuda:0")
    _, got = eng.step(ids)
    assert eng.mode == "graphs" and eng._st["g_prefill"] is not None
    assert got == pytest.approx(ref, rel=0.02)
    _, big = M.DecodeEngine(model, 64, 512, 0, "cuda:0").step(_ids(64, 512, "cuda:0"))  # compute-bound: eager
    assert big > 0


# -- the fast path (absorbed MLA over a latent cache, dense experts): same logits as transformers ----------------

def _variant(**over):
    fields = {**config_fields("tiny"), **over}
    model, _ = M.build_model(fields, torch.device("cpu"), "fp32", seed=0)
    with torch.no_grad():  # a non-zero router bias, so the group/bias routing is really exercised
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    return model


VARIANTS = {
    "tiny": {},
    # DeepSeek-V3's shape of things: query LoRA, group-limited routing, normalised top-k, scaling 2.5
    "v3-like": dict(q_lora_rank=48, n_group=4, topk_group=2, n_routed_experts=16, num_experts_per_tok=4,
                    norm_topk_prob=True, routed_scaling_factor=2.5),
    "no-interleave": dict(rope_interleave=False, num_hidden_layers=3, first_k_dense_replace=2),
    # normalised, scaled top-k without group limits: the fused kernel's own choice against the router's
    "norm-scaled": dict(n_routed_experts=12, num_experts_per_tok=3, norm_topk_prob=True, routed_scaling_factor=2.5,
                        n_group=1, topk_group=1),
}


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("moe", ["dense", "module"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fast_path_computes_what_transformers_computes(variant, moe, fused):
    """fused: the Triton kernels (in Triton's interpreter on a CPU, tests/conftest.py), or torch ops only."""
    from gpuwatch.workload import kernels
    from gpuwatch.workload.fastpath import FastDeepseek

    if fused and kernels.usable(torch.device("cpu")):
        pytest.skip(kernels.usable(torch.device("cpu")))
    model = _variant(**VARIANTS[variant])
    ids = _ids(3, 21, seed=7)
    ref_tokens, ref_logits = _reference(model, ids, 6)
    events = []
    eng = M.DecodeEngine(model, 3, 21, 6, "cpu", lambda k, m, **d: events.append((m, d)), graphs=False,
                         record_tokens=True, moe=moe, fused=fused)
    eng.step(ids)
    assert eng.impl == "fast" and isinstance(eng._st["fast"], FastDeepseek) and eng._st["fast"].moe == moe
    assert eng._st["fast"].fused is fused and eng.detail["kernels"].startswith("fused" if fused else "torch")
    assert torch.equal(eng.tokens, ref_tokens)
    assert torch.allclose(eng._st["logits"][:, 0], ref_logits, atol=1e-4, rtol=1e-4)
    assert "absorbed MLA" in events[0][0] and events[0][1]["impl"] == "fast"


@pytest.mark.slow
def test_torch_compile_of_the_fast_step_traces_it_whole_on_a_cpu_too():
    """torch.compile (fullgraph) traces neither Triton launches nor matmuls into strided out= views: asked to
    compile, the step is built from torch ops only, compiles whole, and decodes transformers' tokens."""
    model = _variant(**VARIANTS["tiny"])
    ids = _ids(8, 9, seed=3)
    ref_tokens, _ = _reference(model, ids, 3)
    events = []
    eng = M.DecodeEngine(model, 8, 9, 3, "cpu", lambda k, m, **d: events.append((m, d)), graphs=False,
                         record_tokens=True, moe="dense", compile=True)
    eng.step(ids)
    assert eng.detail.get("compiled") is True, events
    assert eng.detail["kernels"] == "torch (for torch.compile)" and torch.equal(eng.tokens, ref_tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fused_kernels_compiled_on_cuda_decode_what_transformers_decodes(variant):
    """The CPU variants (query LoRA, group-limited routing, normalised/scaled top-k, no interleave, ...) on
    CUDA in fp32 with the Triton kernels compiled for real, dense experts: transformers' exact tokens."""
    model = _variant(**VARIANTS[variant]).to("cuda:0")
    ids = _ids(8, 21, "cuda:0", seed=7)
    ref_tokens, ref_logits = _reference(model, ids, 6)
    eng = M.DecodeEngine(model, 8, 21, 6, "cuda:0", graphs=False, record_tokens=True, moe="dense")
    eng.step(ids)
    assert eng.impl == "fast" and eng._st["fast"].fused is True and eng.detail["kernels"] == "fused (Triton)"
    assert torch.equal(eng.tokens, ref_tokens)
    assert torch.allclose(eng._st["logits"][:, 0], ref_logits, atol=1e-4, rtol=1e-4)


def test_a_failed_capture_keeps_the_fused_kernels_for_the_step_without_graphs():
    """Graphs fail (no CUDA here): the step runs without them, still with the kernels - the kernels did not fail."""
    from gpuwatch.workload import kernels

    if kernels.usable(torch.device("cpu")):
        pytest.skip(kernels.usable(torch.device("cpu")))
    model = _variant(**VARIANTS["tiny"])
    ids = _ids(8, 9, seed=3)
    ref_tokens, _ = _reference(model, ids, 3)
    events = []
    eng = M.DecodeEngine(model, 8, 9, 3, "cpu", lambda k, m, **d: events.append((m, d)), graphs=True, record_tokens=True)
    eng.step(ids)
    assert eng.mode == "static" and eng._st["fast"].fused is True and torch.equal(eng.tokens, ref_tokens)
    said = [(m, d) for m, d in events if d.get("fallback")]
    assert len(said) == 1 and said[0][1]["fallback"] == "static"
    assert "running gpuwatch's step with fused kernels without graphs instead" in said[0][0]
    eng.step(_ids(3, 9))  # a rebuild: the plan that worked, at once
    assert eng._st["fast"].fused is True and sum(bool(d.get("fallback")) for _, d in events) == 1


def test_a_fused_kernel_that_fails_falls_back_to_the_fast_step_without_it_and_says_so(monkeypatch):
    from gpuwatch.workload import kernels

    if kernels.usable(torch.device("cpu")):
        pytest.skip(kernels.usable(torch.device("cpu")))

    def broken(*a, **k):
        raise RuntimeError("PTX assembly aborted\nmore text")
    monkeypatch.setattr(kernels, "route_act", broken)
    model = _variant(**VARIANTS["tiny"])
    ids = _ids(8, 9, seed=3)
    ref_tokens, _ = _reference(model, ids, 3)
    events = []
    eng = M.DecodeEngine(model, 8, 9, 3, "cpu", lambda k, m, **d: events.append((m, d)), graphs=False,
                         record_tokens=True)
    eng.step(ids)
    assert eng.impl == "fast" and eng._st["fast"].fused is False and torch.equal(eng.tokens, ref_tokens)
    assert eng.detail["kernels"] == "torch (the fused kernels failed to build (see the compile events))"
    said = [(m, d) for m, d in events if d.get("fallback")]
    assert len(said) == 1 and said[0][1]["fallback"] == "unfused", events
    assert "with fused kernels without graphs: RuntimeError: PTX assembly aborted" in said[0][0]
    assert "running gpuwatch's step without graphs instead" in said[0][0]


def test_fast_path_prefill_logits_match_transformers_at_every_position_of_the_cache():
    """Prefill writes latents that decode then reads: a decode after a prefill of S tokens must equal a
    transformers forward over S+1 tokens (checked for the last logits), for several S in one cache."""
    from gpuwatch.workload.fastpath import FastDeepseek

    model = _variant(**VARIANTS["v3-like"])
    with torch.inference_mode():
        fast = FastDeepseek(model, 2, 40, moe="dense")
        for s in (1, 5, 33):
            ids = _ids(2, s + 1, seed=s)
            fast.reset()
            fast.prefill(ids[:, :s])
            got = fast.decode(ids[:, s:])
            ref = model(input_ids=ids).logits[:, -1:]
            assert int(fast.pos) == s + 1
            assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4)


def test_the_transformers_forward_is_still_there_when_asked_or_when_the_layout_is_unknown(tiny, monkeypatch):
    from gpuwatch.workload import fastpath

    ids = _ids(2, 16)
    ref_tokens, _ = _reference(tiny, ids, 4)
    eng = M.DecodeEngine(tiny, 2, 16, 4, "cpu", graphs=False, record_tokens=True, fast=False)
    eng.step(ids)
    assert eng.impl == "transformers" and torch.equal(eng.tokens, ref_tokens)

    def refuse(self, model, *a, **k):
        raise fastpath.Unsupported("unexpected DeepSeek module layout ('x' has no attribute 'y')")
    monkeypatch.setattr(fastpath.FastDeepseek, "__init__", refuse)
    events = []
    eng = M.DecodeEngine(tiny, 2, 16, 4, "cpu", lambda k, m, **d: events.append((m, d)), graphs=False,
                         record_tokens=True)
    eng.step(ids)
    eng.step(_ids(3, 16))  # a rebuild: the fall-back is said once
    assert eng.impl == "transformers"
    said = [m for m, d in events if d.get("fallback") == "transformers"]
    assert len(said) == 1 and "fast path unavailable" in said[0] and "layout" in said[0]


def test_auto_experts_choice_follows_how_many_experts_a_batch_touches():
    from gpuwatch.workload.fastpath import choose_moe, expected_touched
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(**config_fields("v2-lite"))
    assert expected_touched(64, 6, 32) == pytest.approx(61.3, abs=0.1)  # the figure in docs/BENCHMARKS.md
    assert choose_moe(cfg, 32) == "dense" and choose_moe(cfg, 1) == "module" and choose_moe(cfg, 4) == "module"
    assert choose_moe(cfg, 1, "dense") == "dense"


def test_compiled_decode_step_computes_what_the_uncompiled_one_does():
    """torch.compile of the fast path's one-token step (inductor; on a CPU its C++ backend, ~40 s here).
    Where no compiler works, the engine must say so and run uncompiled, with the same answer."""
    model = _variant(**VARIANTS["v3-like"])
    ids = _ids(2, 12, seed=9)
    ref_tokens, ref_logits = _reference(model, ids, 3)
    events = []
    eng = M.DecodeEngine(model, 2, 12, 3, "cpu", lambda k, m, **d: events.append((m, d)), graphs=False,
                         record_tokens=True, compile=True, moe="dense")
    eng.step(ids)
    assert torch.equal(eng.tokens, ref_tokens)
    assert torch.allclose(eng._st["logits"][:, 0], ref_logits, atol=1e-4, rtol=1e-4)
    if eng.detail.get("compiled"):
        assert eng._st.get("decode_fn") is not None and "torch.compile" in events[-1][0]
        assert events[-1][1]["torch_compile_s"] > 0
    else:
        assert any(d.get("fallback") == "uncompiled" for _, d in events), events


def test_a_step_that_overflowed_leaves_nothing_behind_for_the_next(tiny):
    """Masked cache positions weigh 0, but 0 x inf is NaN: the rewind between steps clears the cache."""
    eng = M.DecodeEngine(tiny, 2, 8, 4, "cpu", graphs=False)
    ids = _ids(2, 8)
    _, first = eng.step(ids)
    with torch.inference_mode():
        eng._st["fast"].ckv[:, :, -1] = float("inf")  # what an fp16 overflow would leave at the last position
        eng._st["fast"].kpe[:, :, -1] = float("nan")
    _, again = eng.step(ids)
    assert again == pytest.approx(first, rel=1e-6)


@pytest.mark.parametrize("over", [{"n_shared_experts": 0}, {"qk_nope_head_dim": 31}, {"kv_lora_rank": 63},
                                  {"attention_bias": True}, {"first_k_dense_replace": 0}])
def test_fast_path_handles_unusual_shapes(over):
    model = _variant(**over)
    ids = _ids(8, 9, seed=3)  # batch 8: the dense experts path (auto) on the tiny preset
    ref_tokens, ref_logits = _reference(model, ids, 3)
    events = []
    eng = M.DecodeEngine(model, 8, 9, 3, "cpu", lambda k, m, **d: events.append(m), graphs=False, record_tokens=True)
    eng.step(ids)
    assert eng.impl == "fast" and eng.mode == "static", events
    assert torch.equal(eng.tokens, ref_tokens)
    assert torch.allclose(eng._st["logits"][:, 0], ref_logits, atol=1e-4, rtol=1e-4)


def test_a_prefill_only_engine_says_it_runs_expanded_attention(tiny):
    eng = M.DecodeEngine(tiny, 2, 8, 0, "cpu", graphs=False, prefill_graph_tokens=4096)
    eng.want_graphs = False
    eng.prefill_graph_tokens = 0
    fast = eng._fast(2, 8)
    assert eng.detail["attention"] == "expanded MLA (SDPA)" and fast is not None


def test_needs_build_is_true_only_when_prepare_would_rebuild(tiny):
    eng = M.DecodeEngine(tiny, 2, 8, 2, "cpu", graphs=False)
    assert eng.needs_build(2, 8)
    eng.prepare(2, 8)
    assert not eng.needs_build(2, 8) and eng.needs_build(3, 8) and eng.needs_build(2, 9)


def test_joined_projections_are_views_so_no_copy_is_kept_and_training_still_updates_what_decode_reads():
    """The fast step joins the query and latent projections (and gate/up) into one GEMM each by re-pointing
    the modules' weights into one matrix: the model keeps its parameters (same count, same values), a
    rebuild reuses the matrix, and an optimizer step on the model is what the next decode reads."""
    from gpuwatch.workload.fastpath import FastDeepseek

    tiny = _build()  # its own model: this test trains it
    before = {n: p.detach().clone() for n, p in tiny.named_parameters()}
    with torch.inference_mode():
        fast = FastDeepseek(tiny, 2, 20)
        again = FastDeepseek(tiny, 3, 20)
    assert {n: p.shape for n, p in tiny.named_parameters()} == {n: p.shape for n, p in before.items()}
    assert all(torch.equal(p, before[n]) for n, p in tiny.named_parameters())
    at = tiny.model.layers[0].self_attn
    assert again._qkv_w[0] is fast._qkv_w[0]
    assert at.q_proj.weight.untyped_storage().data_ptr() == fast._qkv_w[0].untyped_storage().data_ptr()
    assert not at.q_proj.weight.is_inference() and at.q_proj.weight.requires_grad
    opt = torch.optim.SGD(tiny.parameters(), lr=0.1)
    M.step_train(tiny, _ids(2, 16), opt, None)
    assert not torch.equal(at.q_proj.weight, before["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(fast._qkv_w[0][: at.q_proj.weight.shape[0]], at.q_proj.weight)
    # a precision change gives the modules new tensors: the old matrix is not kept alive, a rebuild joins anew
    import weakref

    old = weakref.ref(fast._qkv_w[0])
    del fast, again
    tiny.to(torch.float64)
    assert old() is None
    with torch.inference_mode():
        fast = FastDeepseek(tiny, 2, 20)
    assert fast._qkv_w[0].dtype == torch.float64 and at.q_proj.weight.data_ptr() == fast._qkv_w[0].data_ptr()


@pytest.mark.gpu
def test_cuda_graph_memory_at_a_batch_is_the_same_after_visiting_other_batches():
    """Defect 8: every re-capture kept 32 MiB (a new warm-up stream each build, and cuBLAS keeps a workspace
    per stream for good): a decode ramp grew from 1.10 to 2.03 GiB allocated at the same batch. Now the
    allocation at batch 8 is the same at every visit after the first round (which may still allocate
    once what is lazily made on first use, e.g. a stream's cuBLAS workspace: at most 64 MiB)."""
    import gc

    model = _build("cuda:0", "bf16", "small")
    eng = M.DecodeEngine(model, 8, 64, 8, "cuda:0")

    def visit(b):
        for _ in range(2):
            eng.step(_ids(b, 64, "cuda:0"))
        torch.cuda.synchronize()
        gc.collect()
        return torch.cuda.memory_allocated()

    at8 = [visit(8)]
    assert eng.mode == "graphs"
    for _ in range(4):
        for b in (16, 32, 16):
            visit(b)
        at8.append(visit(8))
    print([f"{(a - at8[0]) / 2**20:+.1f} MiB" for a in at8])
    assert eng.mode == "graphs" and eng.captures == 1 + 4 * 4 and eng.held_builds == 1
    assert at8[1] - at8[0] <= 64 * 2**20, at8
    assert max(at8[1:]) - min(at8[1:]) <= 4 * 2**20, [f"{(a - at8[1]) / 2**20:+.1f} MiB" for a in at8[1:]]
