"""Fused Triton kernels for the fast decode step (fastpath.FastDeepseek), each beside the torch code that
computes the same thing (the fall-back where Triton is missing or the tensors are not on a GPU, and the
reference the tests compare against).

Why (torch.profiler on the H200, docs/BENCHMARKS.md "Issue 10"): after the experts' two GEMMs, which run
at ~86 % of HBM bandwidth, the rest of a v2-lite decode token was ~45 small kernels per layer - the router
alone eleven (cast, sigmoid, bias, top-k, gather, sum, divide, zeros, scatter, ...), the experts' activation
three over a strided (T, E, I) view, the rotary embedding eight, two cache writes - each a launch and a
few microseconds of a GPU that has little to do. Fused here:

- `route_act`: the router's choice (sigmoid scores + correction bias, top-k, weights from the uncorrected
  scores, optional normalisation, scaling) and SiLU(gate) x up x routing weight for every expert, in one
  kernel; the output is laid out (E, T, I) for the down projection's batched GEMM. With group-limited
  routing (DeepSeek-V3's n_group > topk_group) the route is computed by torch and passed in.
- `silu_mul`: SiLU(gate) x up over a [gate | up] GEMM output (shared experts, dense MLP).
- `sum_experts`: the experts' outputs summed over E plus the residual, one pass.
- `rope_cache`: RMSNorm of the new latent and its write into the cache at `pos`, the shared rotary key
  rotated and written beside it, every head's rotary query part rotated into the query buffer.

Each computes in fp32 and rounds once at the end (the torch code rounds after each op in bf16): the
results agree to bf16 rounding, exactly in fp32 up to summation order.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

try:  # Triton ships with CUDA builds of torch; the CPU build has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def interpreted() -> bool:
    """Triton's interpreter (TRITON_INTERPRET=1) runs kernels on CPU tensors: what the CPU tests use."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def usable(device: torch.device) -> str | None:
    """None if the kernels can run on `device`, else why not."""
    if triton is None:
        return "Triton is not installed"
    if device.type != "cuda" and not (device.type == "cpu" and interpreted()):
        return f"Triton kernels need a CUDA device (this is {device.type})"
    return None


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# -- the router and the experts' activation ------------------------------------------------------------------
def route_torch(logits: torch.Tensor, bias: torch.Tensor, top_k: int, norm: bool, scale: float,
                n_group: int = 1, topk_group: int = 1) -> torch.Tensor:
    """DeepseekV3TopkRouter's choice as a dense (T, E) fp32 matrix, from the router's fp32 logits."""
    scores = logits.sigmoid()
    choice = scores + bias
    e = scores.shape[-1]
    if topk_group < n_group:
        per = e // n_group
        group_scores = choice.view(-1, n_group, per).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, group_idx, 1).bool()
        choice = choice.masked_fill(~keep.unsqueeze(-1).expand(-1, n_group, per).reshape(-1, e), float("-inf"))
    idx = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    w = scores.gather(1, idx)
    if norm:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    if scale != 1.0:
        w = w * scale
    return torch.zeros_like(scores).scatter_(1, idx, w)


def route_act_torch(gu: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
    """gu (T, E, 2I) = [gate | up] per expert, route (T, E) -> SiLU(gate) x up x route as (E, T, I)."""
    gate, up = gu.chunk(2, dim=-1)
    return (F.silu(gate) * up * route.unsqueeze(-1).to(gu.dtype)).transpose(0, 1)


if triton is not None:
    @triton.jit
    def _route_act_kernel(logit_ptr, bias_ptr, route_ptr, gu_ptr, out_ptr, T, E, I, scale, s_gut, s_gue,
                          HAS_ROUTE: tl.constexpr, TOPK: tl.constexpr, NORM: tl.constexpr,
                          BLOCK_E: tl.constexpr, BLOCK_I: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)  # int64 offsets: (T, E, 2I) and (E, T, I) pass 2**31 elements
        offs_e = tl.arange(0, BLOCK_E)
        me = offs_e < E
        if HAS_ROUTE:
            w = tl.load(route_ptr + t * E + offs_e, mask=me, other=0.0).to(tl.float32)
        else:
            # every program of row t recomputes its top-k: E values, cheaper than another launch
            s = tl.sigmoid(tl.load(logit_ptr + t * E + offs_e, mask=me, other=0.0).to(tl.float32))
            b = tl.load(bias_ptr + offs_e, mask=me, other=0.0).to(tl.float32)
            choice = tl.where(me, s + b, float("-inf"))
            sel = offs_e < 0
            for _ in tl.static_range(TOPK):
                m = tl.max(choice, axis=0)
                first = tl.min(tl.where(choice == m, offs_e, BLOCK_E), axis=0)
                hit = offs_e == first
                sel = sel | hit
                choice = tl.where(hit, float("-inf"), choice)
            w = tl.where(sel, s, 0.0)
            if NORM:
                w = w / (tl.sum(w, axis=0) + 1e-20)
            w = w * scale
            # a NaN logit is never chosen above (no comparison holds): make the whole token NaN instead, as
            # torch's top-k (which ranks NaN highest) would, so the step's non-finite check sees it
            bad = tl.sum(tl.where(s != s, 1, 0), axis=0) > 0
            w = tl.where(bad, float("nan"), w)
        offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        m2 = me[:, None] & (offs_i < I)[None, :]
        src = gu_ptr + t * s_gut + offs_e[:, None] * s_gue + offs_i[None, :]
        g = tl.load(src, mask=m2, other=0.0).to(tl.float32)
        u = tl.load(src + I, mask=m2, other=0.0).to(tl.float32)
        a = g * tl.sigmoid(g) * u * w[:, None]
        dst = out_ptr + offs_e[:, None].to(tl.int64) * T * I + t * I + offs_i[None, :]
        tl.store(dst, a.to(out_ptr.dtype.element_ty), mask=m2)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, J, s_xt, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < J
        g = tl.load(x_ptr + t * s_xt + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + t * s_xt + J + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * J + offs, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _sum_experts_kernel(o_ptr, res_ptr, out_ptr, E, T, D, BLOCK_E: tl.constexpr, BLOCK: tl.constexpr):
        # one (E, BLOCK) tile per program, all loads issued at once, summed over E in fp32
        t = tl.program_id(0).to(tl.int64)
        offs_e = tl.arange(0, BLOCK_E).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < D
        x = tl.load(o_ptr + (offs_e[:, None] * T + t) * D + offs[None, :], mask=(offs_e < E)[:, None] & m[None, :],
                    other=0.0).to(tl.float32)
        acc = tl.sum(x, axis=0) + tl.load(res_ptr + t * D + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * D + offs, acc.to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _rope_cache_kernel(q_ptr, s_qb, kv_ptr, s_kvb, lnw_ptr, eps, f_ptr, pos_ptr, c_ptr, s_cb, s_cl, L,
                           qc_ptr, s_qch, s_qcb, H, DQ, DN, R, HALF,
                           BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_J: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr)
        dst = c_ptr + b * s_cb + pos * s_cl
        # the new latent, RMS-normalised, into the cache
        offs_r = tl.arange(0, BLOCK_R)
        mr = offs_r < R
        x = tl.load(kv_ptr + b * s_kvb + offs_r, mask=mr, other=0.0).to(tl.float32)
        y = x * tl.rsqrt(tl.sum(x * x, axis=0) / R + eps) * tl.load(lnw_ptr + offs_r, mask=mr, other=0.0).to(tl.float32)
        # a position past the cache writes nothing (the torch code raises; the engine never gets there)
        tl.store(dst + offs_r, y.to(c_ptr.dtype.element_ty), mask=mr & (offs_r * 0 + pos < L))
        # interleaved pairs (x0, x1) -> (x0 c - x1 s, x0 s + x1 c); f = (cos, sin) pairs, fp32
        offs_j = tl.arange(0, BLOCK_J)
        mj = offs_j < HALF
        c = tl.load(f_ptr + 2 * offs_j, mask=mj, other=0.0)
        s = tl.load(f_ptr + 2 * offs_j + 1, mask=mj, other=0.0)
        k = kv_ptr + b * s_kvb + R + 2 * offs_j
        k0 = tl.load(k, mask=mj, other=0.0).to(tl.float32)
        k1 = tl.load(k + 1, mask=mj, other=0.0).to(tl.float32)
        tl.store(dst + R + 2 * offs_j, (k0 * c - k1 * s).to(c_ptr.dtype.element_ty), mask=mj & (offs_j * 0 + pos < L))
        tl.store(dst + R + 2 * offs_j + 1, (k0 * s + k1 * c).to(c_ptr.dtype.element_ty), mask=mj & (offs_j * 0 + pos < L))
        offs_h = tl.arange(0, BLOCK_H)
        m2 = (offs_h < H)[:, None] & mj[None, :]
        q = q_ptr + b * s_qb + offs_h[:, None] * DQ + DN + 2 * offs_j[None, :]
        q0 = tl.load(q, mask=m2, other=0.0).to(tl.float32)
        q1 = tl.load(q + 1, mask=m2, other=0.0).to(tl.float32)
        o = qc_ptr + offs_h[:, None] * s_qch + b * s_qcb + R + 2 * offs_j[None, :]
        tl.store(o, (q0 * c[None, :] - q1 * s[None, :]).to(qc_ptr.dtype.element_ty), mask=m2)
        tl.store(o + 1, (q0 * s[None, :] + q1 * c[None, :]).to(qc_ptr.dtype.element_ty), mask=m2)


def route_act(gu: torch.Tensor, logits: torch.Tensor | None, bias: torch.Tensor | None, top_k: int, norm: bool,
              scale: float, route: torch.Tensor | None = None) -> torch.Tensor:
    """Triton: gu (T, E, 2I) with its last dim contiguous, the router's fp32 logits (T, E) and correction bias
    (E,) - or a precomputed `route` (T, E) - -> SiLU(gate) x up x routing weight as a contiguous (E, T, I)."""
    t, e, i2 = gu.shape
    i = i2 // 2
    out = torch.empty(e, t, i, device=gu.device, dtype=gu.dtype)
    be = _pow2(e)
    bi = max(16, min(_pow2(i), 4096 // be))
    has_route = route is not None
    r = route.contiguous() if has_route else logits.contiguous()
    _route_act_kernel[(t, triton.cdiv(i, bi))](
        r, r if has_route else bias, r, gu, out, t, e, i, float(scale), gu.stride(0), gu.stride(1),
        HAS_ROUTE=has_route, TOPK=int(top_k), NORM=bool(norm), BLOCK_E=be, BLOCK_I=bi)
    return out


def silu_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton: x (..., 2J) = [gate | up], last dim contiguous -> SiLU(gate) x up (..., J), contiguous."""
    j = x.shape[-1] // 2
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    out = torch.empty(*x.shape[:-1], j, device=x.device, dtype=x.dtype)
    if not out.numel():  # no shared experts (zero width): nothing to launch
        return out
    block = min(1024, _pow2(j))
    _silu_mul_kernel[(x2.shape[0], triton.cdiv(j, block))](x2, out, j, x2.stride(0), BLOCK=block)
    return out


def sum_experts_torch(o3: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return o3.sum(0) + residual.reshape(o3.shape[1:])


def sum_experts(o3: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """Triton: o3 (E, T, D) contiguous, residual with T x D elements, contiguous -> (T, D) sum over E + residual."""
    e, t, d = o3.shape
    res = residual.reshape(t, d)
    out = torch.empty(t, d, device=o3.device, dtype=o3.dtype)
    be = _pow2(e)
    block = max(16, min(_pow2(d), 8192 // be))
    _sum_experts_kernel[(t, triton.cdiv(d, block))](o3, res, out, e, t, d, BLOCK_E=be, BLOCK=block)
    return out


def rope_cache_torch(q: torch.Tensor, dn: int, kv: torch.Tensor, ln, freqs: torch.Tensor, pos: torch.Tensor,
                     cache: torch.Tensor, qcat: torch.Tensor) -> None:
    """What `rope_cache` does, with torch ops: q (b, H, dq), kv (b, r + dr) (views), freqs complex (dr/2,),
    cache (b, L, r + dr), qcat (H, b, r + dr)."""
    r = cache.shape[-1] - (q.shape[-1] - dn)
    at = pos.view(1)

    def rot(x):
        y = x.float()
        if not y.is_contiguous() or y.storage_offset() % 2:  # complex views need an even offset
            y = y.clone(memory_format=torch.contiguous_format)
        c = torch.view_as_complex(y.reshape(*x.shape[:-1], -1, 2)) * freqs
        return torch.view_as_real(c).flatten(-2).to(x.dtype)
    lat = F.rms_norm(kv[:, :r], (r,), ln.weight, ln.variance_epsilon)
    cache[:, :, :r].index_copy_(1, at, lat.unsqueeze(1))
    cache[:, :, r:].index_copy_(1, at, rot(kv[:, r:]).unsqueeze(1))
    qcat[:, :, r:].copy_(rot(q[:, :, dn:]).transpose(0, 1))


def rope_cache(q: torch.Tensor, dn: int, kv: torch.Tensor, ln, freqs: torch.Tensor, pos: torch.Tensor,
               cache: torch.Tensor, qcat: torch.Tensor) -> None:
    """Triton, in place: the new latent kv[:, :r] RMS-normalised (`ln`'s weight and eps) and the rotary key
    kv[:, r:] rotated by `freqs` written to cache[:, pos]; the rotary query part q[:, :, dn:] of every head
    rotated into qcat[:, :, r:]. Interleaved pairs (DeepSeek's rope_interleave)."""
    b, h, dq = q.shape
    dr = dq - dn
    r = cache.shape[-1] - dr
    f = torch.view_as_real(freqs.reshape(-1)).contiguous()  # (dr/2, 2) fp32: cos, sin
    assert q.stride(2) == 1 and q.stride(1) == dq and kv.stride(1) == 1 and cache.stride(2) == 1 and qcat.stride(2) == 1
    _rope_cache_kernel[(b,)](
        q, q.stride(0), kv, kv.stride(0), ln.weight, float(ln.variance_epsilon), f, pos, cache, cache.stride(0),
        cache.stride(1), cache.shape[1], qcat, qcat.stride(0), qcat.stride(1), h, dq, dn, r, dr // 2,
        BLOCK_R=_pow2(r), BLOCK_H=_pow2(h), BLOCK_J=_pow2(dr // 2))
