"""A decode path for transformers' DeepseekV3ForCausalLM that reads what a decode step has to read and
little more: absorbed multi-head latent attention over a latent KV cache, and the routed experts as two
batched matmuls over static shapes. It runs the model's own modules and weights (embedding, norms,
projections, rotary embedding, router, shared experts, lm_head); only the order of the attention's
matmuls and the experts' dispatch differ from transformers' forward, and tests check it computes the
same logits (CPU, fp32, several configs).

Why (measured on the H200, docs/BENCHMARKS.md "Issue 10"): transformers' MLA keeps the latent cache but
re-expands all of it through `kv_b_proj` into full per-head keys and values on every token (v2-lite at
batch 32: ~8 GB a token, more than all the weights), and its grouped-GEMM experts launch sorting and
scatter kernels around a GEMM that is tiny per expert.

Attention, absorbed (DeepSeek-V2 paper, section 2.1.3): with kv_b_proj's weight split per head into W_UK
(nope key) and W_UV (value), q_nope . (W_UK c) = (W_UK^T q_nope) . c, so a query is moved into the latent
space once per token and the scores are taken against the cached latents c (kv_lora_rank wide) plus the
shared rotary key; the context stays latent (softmax(.) c) and W_UV maps it out per head. Nothing of size
cache x heads x head_dim is ever built. Prefill (many queries) uses the expanded form with SDPA, which is
the cheaper way when the queries are as many as the keys, and writes the latents into the cache.

Experts at decode: when a batch's tokens touch most experts (v2-lite, batch 32, top-6 of 64: 61 of 64
expected), every expert's weights are read anyway; computing all experts for all tokens as two batched
matmuls (FLOPs are cheap at these sizes) and weighting them with a dense routing matrix reads each weight
once, needs no sort, no nonzero() and no data-dependent shape, so it can be captured in a CUDA graph. With
few tokens (few experts touched) the model's own experts implementation (grouped_mm) reads less; `moe`
chooses ("auto": dense when >= DENSE_TOUCHED of the experts are expected to be touched).

Everything has static shapes and the position is a device tensor, so a decode step can be captured once
and replayed for every token.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
import torch.nn.functional as F

from gpuwatch.workload import kernels

DENSE_TOUCHED = 0.75  # dense experts when a batch is expected to touch at least this fraction of them


class Unsupported(Exception):
    """The model is not laid out the way this path expects (another architecture or transformers version)."""


def expected_touched(n_experts: int, top_k: int, tokens: int) -> float:
    """Expected number of distinct experts a batch of `tokens` routes to (uniform routing)."""
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** tokens)


def choose_moe(config, tokens: int, moe: str = "auto") -> str:
    if moe != "auto":
        return moe
    e, k = int(config.n_routed_experts), int(config.num_experts_per_tok)
    return "dense" if expected_touched(e, k, tokens) >= DENSE_TOUCHED * e else "module"


def _fuse_rows(mods) -> torch.Tensor | None:
    """One weight matrix for bias-free Linears that read the same input: their weights concatenated by rows,
    each module's weight re-pointed to its rows of it (a view: the model computes what it did and no second
    copy is kept). Reused while the modules still hold those views (a rebuild); None if they cannot be
    joined (a bias, different widths or dtypes)."""
    ws = [m.weight for m in mods]
    if any(getattr(m, "bias", None) is not None for m in mods) or len({(w.dtype, w.device, w.shape[1]) for w in ws}) != 1:
        return None
    held = getattr(mods[0], "_gw_fused", None)
    joined = held[0]() if held is not None else None
    if joined is not None and [w.data_ptr() for w in ws] == held[1]:
        return joined
    with torch.inference_mode(False), torch.no_grad():  # normal tensors: a train step may use them later
        joined = torch.cat([w.detach() for w in ws], 0)
        off = 0
        for m, w in zip(mods, ws):
            n = w.shape[0]
            m.weight = torch.nn.Parameter(joined[off:off + n], requires_grad=w.requires_grad)
            off += n
    # a weak reference: after model.to(dtype) the modules hold new tensors and the old matrix must go
    mods[0]._gw_fused = (weakref.ref(joined), [m.weight.data_ptr() for m in mods])
    return joined


class FastDeepseek:
    """Prefill and one-token decode over a latent KV cache for `batch` sequences of up to `max_len` tokens.

    `prefill(ids)` (batch, S) fills positions [0, S) and returns the last position's logits (batch, 1, V);
    `decode(tok)` (batch, 1) appends one position and returns its logits. `pos` is a device tensor."""

    def __init__(self, model, batch: int, max_len: int, moe: str = "auto", fused: bool | None = None,
                 for_compile: bool = False, unfused_why: str | None = None) -> None:
        """`fused`: the Triton kernels of `kernels` (None: where they can run, a CUDA device with Triton;
        True: required; False: torch ops only, `unfused_why` says why). `for_compile`: for torch.compile, which traces neither
        the Triton launches nor matmuls into strided `out=` views: torch ops, results copied."""
        if for_compile:
            fused = False
        self.for_compile = for_compile
        self.model = model
        cfg = model.config
        a0 = self._bind_modules(model, cfg)
        if any(getattr(lay.self_attn, "q_lora_rank", None) != getattr(a0, "q_lora_rank", None) for lay in self.layers):
            raise Unsupported("layers differ in their query projection")
        self.batch, self.max_len = batch, max_len
        w = a0.kv_a_proj_with_mqa.weight
        dev, dt = w.device, w.dtype
        n = len(self.layers)
        why = kernels.usable(dev)
        if fused and why:
            raise Unsupported(f"fused kernels asked for: {why}")
        self.fused = why is None if fused is None else bool(fused)
        self.unfused_why = None if self.fused else "for torch.compile" if for_compile else why or unfused_why
        self._silu = getattr(cfg, "hidden_act", "silu") in ("silu", "swish")
        # one cache row per position: [normed latent (r) | rotated shared key (dr)], so the scores are one
        # batched GEMM against [latent query | rotary query]; ckv and kpe are views of its two parts
        self.kv = torch.zeros(n, batch, max_len, self.r + self.dr, device=dev, dtype=dt)
        self.ckv, self.kpe = self.kv[..., : self.r], self.kv[..., self.r:]
        self.qcat = torch.zeros(self.H, batch, self.r + self.dr, device=dev, dtype=dt)  # decode's [q_lat | q_rot]
        self.obuf = torch.zeros(batch, self.H, self.dv, device=dev, dtype=dt)  # decode's heads' outputs, o_proj's input
        # per layer: the projections that read the same input as one GEMM (the modules' weights become views
        # of one matrix: no copy is kept): query (or its LoRA down-projection) + latent; [gate | up] of the
        # shared experts / dense MLP
        self._qkv_w, self._q_width, self._gu_w = [], [], []
        for layer in self.layers:
            at = layer.self_attn
            q_in = at.q_proj if at.q_proj is not None else at.q_a_proj
            self._qkv_w.append(_fuse_rows([q_in, at.kv_a_proj_with_mqa]))
            self._q_width.append(q_in.weight.shape[0])
            mlp = layer.mlp
            gu = mlp.shared_experts if hasattr(mlp, "experts") else mlp
            ok = self._silu and all(hasattr(gu, k) for k in ("gate_proj", "up_proj", "down_proj"))
            self._gu_w.append(_fuse_rows([gu.gate_proj, gu.up_proj]) if ok else None)
        self.pos = torch.zeros((), dtype=torch.long, device=dev)  # the next position to write
        self._ar = torch.arange(max_len, device=dev)
        self.moe = choose_moe(cfg, batch, moe)
        # per MoE layer: the router's weight in fp32, cast once (the module casts it on every call)
        self._router_w = [layer.mlp.gate.weight.float() if hasattr(layer.mlp, "experts") else None
                          for layer in self.layers]
        # per layer: W_UK (H, dn, r) and W_UV (H, dv, r): views of kv_b_proj's weight (no copy)
        self._wuk, self._wuv = [], []
        for layer in self.layers:
            wkv = layer.self_attn.kv_b_proj.weight.view(self.H, self.dn + self.dv, self.r)
            self._wuk.append(wkv[:, : self.dn])
            self._wuv.append(wkv[:, self.dn:])

    def _bind_modules(self, model, cfg):
        """The DeepSeek modules this class reads, bound once (every attribute it needs is touched here,
        so a layout it does not know is `Unsupported` now, not a failure mid-step); returns layer 0's
        attention."""
        try:
            inner = model.model
            self.layers = list(inner.layers)
            self.embed, self.norm, self.rotary = inner.embed_tokens, inner.norm, inner.rotary_emb
            self.lm_head = model.lm_head
            a0 = self.layers[0].self_attn
            self.H = a0.num_heads
            self.dn, self.dr, self.dv = a0.qk_nope_head_dim, a0.qk_rope_head_dim, a0.v_head_dim
            self.r = a0.kv_lora_rank
            self.scaling = float(a0.scaling)
            mod = sys.modules[type(a0).__module__]
            # interleaved pairs (DeepSeek's checkpoints): rotated here as complex numbers, the pairs kept in
            # place (transformers de-interleaves q and k alike; a dot product does not care which order
            # both use, and only this class reads the cache); otherwise transformers' rotate_half function
            self._interleave = bool(getattr(cfg, "rope_interleave", False))
            self._rope = mod.apply_rotary_pos_emb
            norms = [self.norm] + [m for lay in self.layers for m in (lay.input_layernorm, lay.post_attention_layernorm,
                                                                      lay.self_attn.kv_a_layernorm)]
            for m in norms:
                m.weight, float(m.variance_epsilon)  # noqa: B018 - F.rms_norm below needs both
            for layer in self.layers:
                at = layer.self_attn
                at.kv_a_proj_with_mqa, at.kv_a_layernorm, at.kv_b_proj, at.o_proj  # noqa: B018
                mlp = layer.mlp
                if hasattr(mlp, "experts"):
                    mlp.shared_experts, mlp.experts.gate_up_proj, mlp.experts.down_proj  # noqa: B018
                    g = mlp.gate
                    g.weight, g.e_score_correction_bias, g.top_k, g.num_group, g.topk_group  # noqa: B018
                    g.norm_topk_prob, g.routed_scaling_factor, g.num_experts  # noqa: B018
        except AttributeError as e:
            raise Unsupported(f"unexpected DeepSeek module layout ({e})") from None
        return a0

    # -- pieces --------------------------------------------------------------------------------------------
    @staticmethod
    def _rms(mod, x):
        """DeepseekV3RMSNorm as one fused kernel (transformers' module launches seven)."""
        return F.rms_norm(x, mod.weight.shape, mod.weight, mod.variance_epsilon)

    def _freqs(self, x, positions):
        """What the rotary embedding gives for `positions`: cos/sin (transformers' layout) or, for interleaved
        pairs, the unit complex numbers (times yarn's attention scaling) of shape (1, S, dr/2)."""
        cos, sin = self.rotary(x, positions)
        if not self._interleave:
            return cos, sin
        half = cos.shape[-1] // 2
        return torch.complex(cos[..., :half].float(), sin[..., :half].float())

    def _rotate(self, q_rot, k_rot, freqs):
        """q_rot (b, H, S, dr), k_rot (b, 1, S, dr) rotated by position."""
        if not self._interleave:
            return self._rope(q_rot, k_rot, *freqs)
        f = freqs.unsqueeze(1)  # (1, 1, S, dr/2)

        def rot(t):
            c = torch.view_as_complex(t.float().contiguous().reshape(*t.shape[:-1], -1, 2)) * f
            return torch.view_as_real(c).flatten(-2).to(t.dtype)
        return rot(q_rot), rot(k_rot)

    def _q(self, at, h, b: int, s: int):
        q = at.q_proj(h) if at.q_proj is not None else at.q_b_proj(at.q_a_layernorm(at.q_a_proj(h)))
        q = q.view(b, s, self.H, self.dn + self.dr).transpose(1, 2)  # (b, H, s, dq)
        return torch.split(q, [self.dn, self.dr], dim=-1)

    def _latent(self, at, h, b: int, s: int):
        """The new tokens' latents (not yet normalised) and shared rotary keys (not yet rotated)."""
        c = at.kv_a_proj_with_mqa(h)
        kv, k_rot = torch.split(c, [self.r, self.dr], dim=-1)
        return kv, k_rot.reshape(b, 1, s, self.dr)

    def _route_logits(self, i: int, x):
        """The router's fp32 logits; its weight cast to fp32 once (the module casts it on every call)."""
        return F.linear(x.float(), self._router_w[i])

    def _route(self, i: int, mlp, x):
        """DeepseekV3TopkRouter's choice (sigmoid scores + correction bias, group-limited top-k, weights
        from the uncorrected scores, optional normalisation, scaling) as a dense (T, E) fp32 matrix. The
        same arithmetic as the module, with its fp32 weight cast once instead of every token, and the
        group step skipped when every group is kept (n_group == topk_group: v2-lite), where it selects
        everything."""
        g = mlp.gate
        return kernels.route_torch(self._route_logits(i, x), g.e_score_correction_bias, g.top_k, g.norm_topk_prob,
                                   g.routed_scaling_factor, g.num_group, g.topk_group)

    @staticmethod
    def _linear_add(x, a, lin):
        """x + lin(a) as one GEMM with x as its addend (cuBLAS's C = A W^T + X), for a bias-free Linear."""
        if lin.bias is not None:
            return x + lin(a)
        return torch.addmm(x.flatten(0, -2), a.flatten(0, -2), lin.weight.t()).view_as(x)

    def _experts_dense(self, i: int, mlp, h2, residual):
        """All experts for all tokens (one GEMM for gate/up, one bmm for down), weighted by a dense (tokens,
        experts) routing matrix, plus `residual`, plus the shared experts. The routing weight scales each
        expert's intermediate (the down projection is linear), so the experts' outputs are summed by one
        reduction. Fused: the route and the activation in one kernel, the sum and the residual in another."""
        ex, g = mlp.experts, mlp.gate
        x = h2.reshape(-1, h2.shape[-1])  # (T, D)
        w = ex.gate_up_proj  # (E, 2I, D), contiguous: all experts' gate/up rows are one (E*2I, D) matrix
        gu = F.linear(x, w.reshape(-1, w.shape[-1])).view(x.shape[0], w.shape[0], w.shape[1])  # one GEMM: (T, E, 2I)
        down = ex.down_proj.transpose(1, 2)  # (E, I, D)
        if self.fused and self._silu:
            logits = self._route_logits(i, x)
            route = None
            if g.topk_group < g.num_group:  # group-limited routing: torch chooses, the kernel applies
                route = kernels.route_torch(logits, g.e_score_correction_bias, g.top_k, g.norm_topk_prob,
                                            g.routed_scaling_factor, g.num_group, g.topk_group)
            a = kernels.route_act(gu, logits, g.e_score_correction_bias, g.top_k, g.norm_topk_prob,
                                  g.routed_scaling_factor, route=route)  # (E, T, I)
            y = kernels.sum_experts(torch.bmm(a, down), residual)
        else:
            route = self._route(i, mlp, x)
            gate, up = gu.chunk(2, dim=-1)
            a = ex.act_fn(gate) * up * route.unsqueeze(-1).to(gu.dtype)  # (T, E, I)
            y = torch.bmm(a.transpose(0, 1), down).sum(0) + residual.reshape(x.shape)
        return self._mlp_add(i, mlp.shared_experts, h2, y)

    def _mlp_add(self, i: int, mod, h, y):
        """y + mod(h) for a gated MLP (shared experts, dense MLP): [gate | up] as one GEMM, SiLU x up, and
        the down projection with y added inside its GEMM."""
        y = y.reshape(h.shape)
        wgu = self._gu_w[i]
        if wgu is not None:
            gu = F.linear(h, wgu)
            inner = kernels.silu_mul(gu) if self.fused else kernels.silu_mul_torch(gu)
            return self._linear_add(y, inner, mod.down_proj)
        if all(hasattr(mod, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return self._linear_add(y, mod.act_fn(mod.gate_proj(h)) * mod.up_proj(h), mod.down_proj)
        return y + mod(h)

    def _q_kv(self, i: int, at, h, b: int):
        """This token's queries (b, H, dq) and [latent | rotary key] (b, r + dr), the query (or its LoRA
        down-projection) and the latent from one GEMM where the weights could be joined."""
        w = self._qkv_w[i]
        if w is not None:
            both = F.linear(h, w).view(b, -1)
            nq = self._q_width[i]
            q, kv = both[:, :nq], both[:, nq:]
            if at.q_proj is None:
                q = at.q_b_proj(at.q_a_layernorm(q))
        else:
            q = (at.q_proj(h) if at.q_proj is not None else at.q_b_proj(at.q_a_layernorm(at.q_a_proj(h)))).view(b, -1)
            kv = at.kv_a_proj_with_mqa(h).view(b, -1)
        return q.view(b, self.H, self.dn + self.dr), kv

    def _rope_cache(self, i: int, at, q, kv, freqs) -> None:
        """The new latent normalised and the rotary key rotated into cache[:, pos]; the queries' rotary part
        rotated into qcat[..., r:]."""
        if self._interleave:
            fn = kernels.rope_cache if self.fused else kernels.rope_cache_torch
            fn(q, self.dn, kv, at.kv_a_layernorm, freqs.reshape(-1), self.pos, self.kv[i], self.qcat)
            return
        b, r = q.shape[0], self.r
        q_rot, k_rot = self._rope(q[:, :, self.dn:].unsqueeze(2), kv[:, r:].view(b, 1, 1, self.dr), *freqs)
        at_pos = self.pos.view(1)
        self.ckv[i].index_copy_(1, at_pos, self._rms(at.kv_a_layernorm, kv[:, :r]).unsqueeze(1))
        self.kpe[i].index_copy_(1, at_pos, k_rot[:, 0])
        self.qcat[:, :, r:].copy_(q_rot[:, :, 0].transpose(0, 1))

    # -- prefill: expanded attention with SDPA, latents written to the cache -----------------------------------
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        x = self.embed(ids)
        freqs = self._freqs(x, torch.arange(s, device=ids.device).unsqueeze(0))
        for i, layer in enumerate(self.layers):
            at = layer.self_attn
            h = layer.input_layernorm(x)
            q_nope, q_rot = self._q(at, h, b, s)
            kv, k_rot = self._latent(at, h, b, s)
            kv = at.kv_a_layernorm(kv)
            q_rot, k_rot = self._rotate(q_rot, k_rot, freqs)
            self.ckv[i, :, :s].copy_(kv)
            self.kpe[i, :, :s].copy_(k_rot[:, 0])
            kvx = at.kv_b_proj(kv).view(b, s, self.H, self.dn + self.dv).transpose(1, 2)
            k_nope, v = torch.split(kvx, [self.dn, self.dv], dim=-1)
            k = torch.cat((k_nope, k_rot.expand(b, self.H, s, self.dr)), dim=-1)
            q = torch.cat((q_nope, q_rot), dim=-1)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling)
            x = x + at.o_proj(o.transpose(1, 2).reshape(b, s, self.H * self.dv))
            x = x + layer.mlp(layer.post_attention_layernorm(x))  # prefill: the model's own MLP / experts
        self.pos.fill_(s)
        return self.lm_head(self.norm(x[:, -1:]))

    # -- decode: absorbed attention over the latent cache --------------------------------------------------
    def decode(self, tok: torch.Tensor) -> torch.Tensor:
        b = tok.shape[0]
        x = self.embed(tok)  # (b, 1, D)
        freqs = self._freqs(x, self.pos.view(1, 1))
        # (1, 1, L) additive mask: 0 for the positions written so far (this one too), -inf after; once a token
        visible = (self._ar <= self.pos).view(1, 1, -1)
        mask = torch.zeros(visible.shape, dtype=x.dtype, device=x.device).masked_fill_(~visible, float("-inf"))
        mask = mask.expand(b, self.H, -1)
        for i, layer in enumerate(self.layers):
            at = layer.self_attn
            h = self._rms(layer.input_layernorm, x)
            q, kv = self._q_kv(i, at, h, b)  # (b, H, dq), (b, r + dr): views
            self._rope_cache(i, at, q, kv, freqs)  # cache[:, pos] and qcat[..., r:] written
            qcat, cache = self.qcat, self.kv[i]
            # the query moved into the latent space, written beside its rotary part: (H, b, r)
            q_nope = q[:, :, : self.dn].transpose(0, 1)
            if self.for_compile:
                qcat[:, :, : self.r].copy_(torch.bmm(q_nope, self._wuk[i]))
            else:
                torch.bmm(q_nope, self._wuk[i], out=qcat[:, :, : self.r])
            # scaled scores plus the mask in one fused multiply-add; softmax accumulates in fp32 inside
            scores = torch.baddbmm(mask, qcat.transpose(0, 1), cache.transpose(1, 2), alpha=self.scaling)
            ctx = torch.bmm(scores.softmax(-1), cache[..., : self.r])  # (b, H, r)
            # each head's value projection written straight into (b, H, dv) rows, o_proj's input (no copy)
            if self.for_compile:
                self.obuf.copy_(torch.bmm(ctx.transpose(0, 1), self._wuv[i].transpose(1, 2)).transpose(0, 1))
            else:
                torch.bmm(ctx.transpose(0, 1), self._wuv[i].transpose(1, 2), out=self.obuf.transpose(0, 1))
            x = self._linear_add(x, self.obuf.view(b, 1, self.H * self.dv), at.o_proj)  # x + o_proj(o)
            h2 = self._rms(layer.post_attention_layernorm, x)
            mlp = layer.mlp
            if not hasattr(mlp, "experts"):
                x = self._mlp_add(i, mlp, h2, x)
            elif self.moe == "dense":
                x = self._experts_dense(i, mlp, h2, x)
            else:
                x = x + mlp(h2)
        self.pos.add_(1)
        return self.lm_head(self._rms(self.norm, x))

    def reset(self) -> None:
        """Rewind to position 0 and clear the cache: masked positions weigh 0, but 0 x inf is NaN, so a step
        that overflowed must not leave its values behind for the next one (one memset a step, not a token)."""
        self.pos.zero_()
        self.kv.zero_()

    def describe(self, decode: bool = True) -> dict[str, Any]:
        """What runs: the decode step's path, or (prefill only) the expanded attention and the model's experts."""
        dense = decode and self.moe == "dense"
        return {"attention": "absorbed MLA (latent cache)" if decode else "expanded MLA (SDPA)",
                "experts": "dense bmm" if dense else "model's experts module",
                "kernels": "fused (Triton)" if self.fused and decode else f"torch ({self.unfused_why or 'asked'})",
                "cache_bytes": self.kv.numel() * self.kv.element_size()}
