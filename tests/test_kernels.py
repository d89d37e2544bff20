"""The fast decode step's fused Triton kernels against the torch code they replace (gpuwatch/workload/
kernels.py). Without a GPU they run in Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1), so CI checks the kernels' own code; on the H200 the same tests run compiled."""

from __future__ import annotations

import pytest
import torch

kernels = pytest.importorskip("gpuwatch.workload.kernels")
if kernels.triton is None:  # pragma: no cover - the test extra installs Triton on Linux x86_64
    pytest.skip("Triton is not installed", allow_module_level=True)

DEV = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rand(*shape, seed=0, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=_g(seed)) * scale).to(DEV, dtype)


def test_the_kernels_are_usable_here():
    assert kernels.usable(DEV) is None
    assert kernels.usable(torch.device("meta")) is not None


@pytest.mark.parametrize("t,e,i,k,norm,scale", [
    (32, 64, 1408 // 16, 6, False, 1.0),   # v2-lite's routing (intermediate scaled down)
    (5, 16, 40, 4, True, 2.5),             # V3-like normalised, scaled top-k
    (3, 12, 24, 2, True, 1.0),             # experts not a power of two
    (1, 8, 7, 8, False, 1.0),              # every expert chosen, odd width
])
def test_route_act_chooses_the_routers_experts_and_weights_them(t, e, i, k, norm, scale):
    logits = _rand(t, e, seed=1, scale=2.0)
    bias = _rand(e, seed=2, scale=0.3)
    gu = _rand(t, e, 2 * i, seed=3)
    route = kernels.route_torch(logits, bias, k, norm, scale)
    want = kernels.route_act_torch(gu, route)
    got = kernels.route_act(gu, logits, bias, k, norm, scale)
    # the kernel's choice: exactly k experts a token carry anything (gate/up are dense random values)
    assert ((got != 0).any(-1).transpose(0, 1).sum(-1) == k).all()
    assert got.shape == (e, t, i) and got.is_contiguous()
    torch.testing.assert_close(got, want.contiguous(), atol=1e-5, rtol=1e-5)


def test_a_nan_router_logit_makes_the_token_nan_as_torch_does():
    """torch's top-k ranks NaN highest, so a NaN router output reaches the step's result; the kernel (whose
    comparisons never pick a NaN) must not hide it."""
    t, e, i = 3, 8, 16
    logits, bias, gu = _rand(t, e, seed=30), torch.zeros(e, device=DEV), _rand(t, e, 2 * i, seed=31)
    logits[1, 2] = float("nan")
    got = kernels.route_act(gu, logits, bias, 2, True, 1.0)
    want = kernels.route_act_torch(gu, kernels.route_torch(logits, bias, 2, True, 1.0))
    assert not torch.isfinite(want[:, 1]).all() and torch.isnan(got[:, 1]).all()
    torch.testing.assert_close(got[:, [0, 2]], want[:, [0, 2]].contiguous(), atol=1e-5, rtol=1e-5)


def test_route_act_with_a_given_route_applies_it():
    """Group-limited routing (DeepSeek-V3): torch chooses, the kernel applies the route it is given."""
    t, e, i = 4, 16, 24
    logits, bias, gu = _rand(t, e, seed=4), _rand(e, seed=5, scale=0.1), _rand(t, e, 2 * i, seed=6)
    route = kernels.route_torch(logits, bias, 4, True, 2.5, n_group=4, topk_group=2)
    chosen = (route > 0).view(t, 4, 4).any(-1).sum(-1)
    assert (chosen <= 2).all()  # at most topk_group groups per token
    got = kernels.route_act(gu, logits, bias, 4, True, 2.5, route=route)
    torch.testing.assert_close(got, kernels.route_act_torch(gu, route).contiguous(), atol=1e-5, rtol=1e-5)


def test_route_act_reads_a_strided_gate_up_view():
    """The experts' GEMM output is viewed (T, E, 2I) with its rows strided: the kernel takes the strides."""
    t, e, i = 6, 8, 20
    big = _rand(t, e, 2 * i + 8, seed=7)
    gu = big[:, :, : 2 * i]
    logits, bias = _rand(t, e, seed=8), torch.zeros(e, device=DEV)
    got = kernels.route_act(gu, logits, bias, 3, False, 1.0)
    want = kernels.route_act_torch(gu, kernels.route_torch(logits, bias, 3, False, 1.0))
    torch.testing.assert_close(got, want.contiguous(), atol=1e-5, rtol=1e-5)


def test_bf16_rounds_once_and_stays_within_bf16_of_the_torch_ops():
    t, e, i = 8, 16, 32
    logits, bias = _rand(t, e, seed=9), _rand(e, seed=10, scale=0.1)
    gu = _rand(t, e, 2 * i, seed=11, dtype=torch.bfloat16)
    got = kernels.route_act(gu, logits, bias, 4, False, 1.0)
    want = kernels.route_act_torch(gu.float(), kernels.route_torch(logits, bias, 4, False, 1.0))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.contiguous(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("shape", [(3, 1, 2 * 40), (7, 2 * 1000), (2, 1, 0)])
def test_silu_mul_is_silu_of_the_gate_times_the_up(shape):
    x = _rand(*shape, seed=12)
    got = kernels.silu_mul(x)
    assert got.shape == (*shape[:-1], shape[-1] // 2)
    torch.testing.assert_close(got, kernels.silu_mul_torch(x), atol=1e-6, rtol=1e-5)


def test_sum_experts_adds_every_expert_and_the_residual():
    o3 = _rand(12, 5, 300, seed=13)
    res = _rand(5, 1, 300, seed=14)
    torch.testing.assert_close(kernels.sum_experts(o3, res), kernels.sum_experts_torch(o3, res), atol=1e-5, rtol=1e-5)


class _Norm(torch.nn.Module):
    def __init__(self, r: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(_rand(r, seed=20) * 0.1 + 1)
        self.variance_epsilon = 1e-6


@pytest.mark.parametrize("b,h,dn,dr,r,pos", [(2, 4, 16, 8, 24, 5), (3, 16, 128, 64, 512, 0), (1, 3, 5, 6, 10, 9)])
def test_rope_cache_writes_what_the_torch_ops_write(b, h, dn, dr, r, pos):
    """The latent normalised and the rotary key rotated into the cache row at `pos` (nothing else touched),
    the queries' rotary part rotated into the query buffer; inputs are views with strided rows."""
    dq, length = dn + dr, 12
    both = _rand(b, h * dq + r + dr + 3, seed=21)  # one GEMM's output: [queries | latent | key | padding]
    q = both[:, : h * dq].view(b, h, dq)
    kv = both[:, h * dq: h * dq + r + dr]
    ang = torch.rand(dr // 2, generator=_g(22)) * 6.28
    freqs = torch.polar(torch.full_like(ang, 1.1), ang).to(DEV)  # yarn's scale folded in, as the model does
    ln, p = _Norm(r).to(DEV), torch.tensor(pos, device=DEV)
    caches, qcats = [], []
    for fn in (kernels.rope_cache, kernels.rope_cache_torch):
        cache = _rand(b, length, r + dr, seed=23)
        qcat = torch.zeros(h, b, r + dr, device=DEV)
        fn(q, dn, kv, ln, freqs, p, cache, qcat)
        caches.append(cache)
        qcats.append(qcat)
    torch.testing.assert_close(caches[0], caches[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(qcats[0], qcats[1], atol=1e-5, rtol=1e-5)
    untouched = torch.ones(length, dtype=torch.bool)
    untouched[pos] = False
    torch.testing.assert_close(caches[0][:, untouched], _rand(b, length, r + dr, seed=23)[:, untouched])
    # a position past the cache writes nothing (the torch code raises there; the engine never gets there)
    cache = _rand(b, length, r + dr, seed=23)
    kernels.rope_cache(q, dn, kv, ln, freqs, torch.tensor(length, device=DEV), cache, torch.zeros_like(qcats[0]))
    torch.testing.assert_close(cache, _rand(b, length, r + dr, seed=23))


@pytest.mark.gpu
def test_offsets_past_2_31_elements_on_a_gpu():
    """DeepSeek-V3's widths at a large decode batch: (E, T, D) = (256, 1200, 7168) is 2.2 G elements, past
    int32 offsets (a 32-bit index would wrap to another address or fault)."""
    e, t, d = 256, 1200, 7168
    o3 = torch.ones(e, t, d, device="cuda", dtype=torch.bfloat16)
    o3[-1, -1, -1] = 3.0
    res = torch.zeros(t, 1, d, device="cuda", dtype=torch.bfloat16)
    out = kernels.sum_experts(o3, res)
    assert out[0, 0].item() == e and out[-1, -1].item() == e + 2
    del o3
    i = 1024
    gu = torch.ones(2100, 1024, 2 * i, device="cuda", dtype=torch.bfloat16)  # t * E * 2I past 2**31
    route = torch.zeros(2100, 1024, device="cuda")
    route[-1, -1] = 1.0
    a = kernels.route_act(gu, None, None, 1, False, 1.0, route=route)
    assert a[-1, -1, 0].item() == pytest.approx(torch.nn.functional.silu(torch.tensor(1.0)).item(), rel=1e-2)
    assert a[0, 0].abs().sum().item() == 0
