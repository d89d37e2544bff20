"""The stress workload's speed switches (issue 30): each one a change to how transformers' DeepseekV3 runs
a train or prefill step, off by default, selectable like the decode fast path (`gpuwatch stress --tune
KEY=VALUE`, benchmarks/gpu_profile.py --variants) and recorded on every step row (its `expert_impl` label
gets "+KEY=VALUE" for each switch on). Tests compare each with transformers' own implementation on the
CPU (tests/test_workload_tuning.py: logits and gradients within fp32/bf16 tolerance).

  attention  sdpa (transformers' default: torch picks the SDPA kernel; MLA's head dims differ, q/k 192 and
             v 128, and SDPA's flash kernel needs them equal, so another runs: the profile names which),
             sdpa-flash (V zero-padded to q/k's width so SDPA's flash kernel can run, the padding sliced off
             after: the same attention, more PV FLOPs), sdpa-cudnn / sdpa-efficient / sdpa-math (that SDPA
             backend only: an error where it cannot run), flex (transformers' FlexAttention path), eager.
             The latent KV compression is kept in all: only the kernel over the expanded keys changes.
  optimizer  sgd (today's: torch's foreach SGD), sgd-fused, adamw, adamw-fused (fused=True: one kernel
             for all parameters; AdamW keeps two more tensors per parameter, in the weights' dtype).
  compile    off, moe (torch.compile each MoE block: router, experts, shared experts), layer (each decoder
             layer). The first steps of each shape pay the compile. Both are within bf16 of transformers'
             numerics measured as they must be (H200, session 39): compiled code hides the routes, so the GPU
             test holds the switch's logits, loss and gradients against the same weights in fp32 - no further
             from them than transformers' own bf16 (session 38's check against bf16 itself failed layer on 72
             of 1,024 tokens: near-tie routing flips either way of the truth, not errors).
  lean       off, on: bf16 without needless fp32 passes - RMSNorm as one fused kernel (F.rms_norm; the
             module upcasts to fp32 and back in seven), and the train step's max |logit| without an fp32
             copy of all the logits (batch x seq x vocab: 6.7 GB at v2-lite's 32 x 512). The router keeps
             its fp32 GEMM and the loss its fp32 logits (their precision matters: expert choice, gradients).
  experts    the model's experts implementation: transformers' grouped_mm (default), batched_mm, eager,
             deepgemm (needs the deep_gemm package), or gw-grouped (gpuwatch's: the same two grouped GEMMs with
             less glue - the routing weight folded into the intermediate, which is narrower than the output,
             before the linear down projection; the tokens gathered with index_select and put back with
             index_copy (backward: index_add and a gather, not the sort-based index_put of advanced indexing);
             the combine in the weights' dtype with fp32 accumulation, where transformers promotes the whole
             (tokens x top-k, hidden) product to fp32).
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch
import torch.nn.functional as F

KNOBS: dict[str, tuple[str, ...]] = {
    "attention": ("sdpa", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math", "flex", "eager"),
    "optimizer": ("sgd", "sgd-fused", "adamw", "adamw-fused"),
    "compile": ("off", "moe", "layer"),
    "lean": ("off", "on"),
    "experts": ("grouped_mm", "batched_mm", "eager", "deepgemm", "gw-grouped"),
}
DEFAULTS = {"attention": "sdpa", "optimizer": "sgd", "compile": "off", "lean": "off", "experts": "grouped_mm"}
COMPILE_BACKEND = "inductor"  # torch.compile's backend for the compile switch (tests trace with aot_eager)
LR = 1e-5  # the workload's learning rate (random weights: a small step keeps the loss finite for hours)


def check(tuning: dict[str, str] | None) -> dict[str, str]:
    """The switches asked for, checked (ValueError naming the bad key or value); defaults left out."""
    out = {}
    for k, v in (tuning or {}).items():
        if k not in KNOBS:
            raise ValueError(f"unknown tuning switch {k!r} (one of {', '.join(KNOBS)})")
        if v not in KNOBS[k]:
            raise ValueError(f"tuning {k}={v!r}: use one of {', '.join(KNOBS[k])}")
        if v != DEFAULTS[k]:
            out[k] = v
    return out


def label(tuning: dict[str, str] | None) -> str:
    """What a step row's expert_impl gets appended: "+attention=sdpa-flash+lean=on" ("" when all off)."""
    return "".join(f"+{k}={v}" for k, v in sorted(check(tuning).items()))


# -- attention -------------------------------------------------------------------------------------------
def _sdpa_with(backend: str | None, pad_v: bool) -> Callable:
    """transformers' sdpa attention with one SDPA backend forced and/or V padded to q/k's head width."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def forward(module, query, key, value, attention_mask, **kw):
        dv = value.shape[-1]
        if pad_v and dv < query.shape[-1]:
            value = F.pad(value, (0, query.shape[-1] - dv))
        if backend is None:
            out, w = sdpa_attention_forward(module, query, key, value, attention_mask, **kw)
        else:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([getattr(SDPBackend, backend)]):
                out, w = sdpa_attention_forward(module, query, key, value, attention_mask, **kw)
        return (out[..., :dv] if out.shape[-1] != dv else out), w
    return forward


_ATTN = {"sdpa-flash": ("FLASH_ATTENTION", True), "sdpa-cudnn": ("CUDNN_ATTENTION", False),
         "sdpa-efficient": ("EFFICIENT_ATTENTION", False), "sdpa-math": ("MATH", False)}


def attention_name(choice: str) -> str:
    """transformers' attn_implementation name for a choice (gpuwatch's own are registered with the sdpa mask)."""
    if choice in ("sdpa", "eager"):
        return choice
    if choice == "flex":
        return "flex_attention"
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    name = "gpuwatch_" + choice.replace("-", "_")
    AttentionInterface.register(name, _sdpa_with(*_ATTN[choice]))
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)  # the masks sdpa gets (None where causal suffices)
    return name


def _set_attention(model, name: str) -> None:
    try:
        model.set_attn_implementation(name)
    except (AttributeError, ValueError, ImportError):
        model.config._attn_implementation = name
    if model.config._attn_implementation != name:  # a version that refuses a registered name: set it directly
        model.config._attn_implementation = name


# -- experts -----------------------------------------------------------------------------------------------
def _grouped(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x (S, K) @ w[e] (K, N) for each expert's rows (offs: their cumulative ends): transformers' dispatcher
    where it has one (torch's grouped GEMM where it runs for this dtype and device, else its fallback), else
    torch's own (F.grouped_mm from torch 2.10, torch._grouped_mm before)."""
    from transformers.integrations import moe

    disp = getattr(moe, "_grouped_mm", None)
    if disp is not None:
        return disp(x, w, offs=offs)
    return (getattr(F, "grouped_mm", None) or torch._grouped_mm)(x, w, offs=offs)


def gw_grouped_experts(self, hidden_states, top_k_index, top_k_weights):
    """DeepseekV3Experts.forward as two grouped GEMMs with less glue (see `experts` above)."""
    t, d = hidden_states.shape
    k = top_k_index.shape[-1]
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))
    tok = torch.div(perm, k, rounding_mode="floor")
    counts = torch.histc(expert_ids.int() if expert_ids.is_cuda else expert_ids.float(), bins=self.num_experts,
                         min=0, max=self.num_experts - 1)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    x = hidden_states.index_select(0, tok)
    gate, up = _grouped(x, self.gate_up_proj.transpose(-2, -1), offs).chunk(2, dim=-1)
    weight = top_k_weights.reshape(-1).index_select(0, perm).to(gate.dtype).unsqueeze(-1)
    y = _grouped(self.act_fn(gate) * up * weight, self.down_proj.transpose(-2, -1), offs)
    back = torch.empty_like(y).index_copy_(0, perm, y)  # (token, k) order again
    return back.view(t, k, d).sum(dim=1)


def experts_name(choice: str) -> str:
    if choice != "gw-grouped":
        return choice
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    name = "gpuwatch_grouped"
    ExpertsInterface.register(name, gw_grouped_experts)
    assert name in ALL_EXPERTS_FUNCTIONS
    return name


def _set_experts(model, name: str) -> None:
    try:
        model.set_experts_implementation(name)
    except (ValueError, KeyError):  # a version that checks against its own list: set it directly
        model.config._experts_implementation = name
    if getattr(model.config, "_experts_implementation", None) != name:
        model.config._experts_implementation = name


# -- lean ------------------------------------------------------------------------------------------------
def _rms_forward(self, x):
    return F.rms_norm(x, self.weight.shape, self.weight, self.variance_epsilon)


def max_abs(t: torch.Tensor) -> float:
    """max |t| without an fp32 (or any) copy of `t` (the same value as t.float().abs().max())."""
    lo, hi = torch.aminmax(t.detach())
    return max(abs(float(lo)), abs(float(hi)))


# -- applying and undoing ----------------------------------------------------------------------------------
class Applied:
    """The switches on one model, and how to take them off (`revert`): benchmarks reuse a model across arms."""

    def __init__(self, tuning: dict[str, str]) -> None:
        self.tuning = tuning
        self._undo: list[Callable[[], None]] = []
        self.lean = tuning.get("lean") == "on"

    def on_revert(self, undo: Callable[[], None]) -> None:
        """Register how to take one change off (run last-first by `revert`)."""
        self._undo.append(undo)

    def revert(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def apply(model, tuning: dict[str, str] | None) -> Applied:
    """Put the model-side switches of `tuning` on `model` (the optimizer is `make_optimizer`'s)."""
    t = check(tuning)
    done = Applied(t)
    if "experts" in t:
        old = getattr(model.config, "_experts_implementation", None) or "eager"
        _set_experts(model, experts_name(t["experts"]))
        done.on_revert(lambda: _set_experts(model, old))
    if "attention" in t:
        old_attn = model.config._attn_implementation
        _set_attention(model, attention_name(t["attention"]))
        done.on_revert(lambda: _set_attention(model, old_attn))
    if done.lean:
        _apply_lean(model, done)
    if t.get("compile", "off") != "off":
        _apply_compile(model, t["compile"], done)
    return done


def _patch(mod, name: str, fn, done: Applied) -> None:
    setattr(mod, name, types.MethodType(fn, mod))
    done.on_revert(lambda: mod.__dict__.pop(name, None))


def _apply_lean(model, done: Applied) -> None:
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon")]
    for m in norms:
        _patch(m, "forward", _rms_forward, done)


def _apply_compile(model, what: str, done: Applied) -> None:
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    layers = list(model.model.layers)
    mods = [lay.mlp for lay in layers if hasattr(lay.mlp, "experts")] if what == "moe" else layers
    for m in mods:
        m.compile(backend=COMPILE_BACKEND)
        done.on_revert(lambda m=m: setattr(m, "_compiled_call_impl", None))


def make_optimizer(model, tuning: dict[str, str] | None) -> torch.optim.Optimizer:
    """The train step's optimizer: today's SGD, or what `tuning["optimizer"]` asks for."""
    choice = check(tuning).get("optimizer", "sgd")
    params = model.parameters()
    fused: dict[str, Any] = {"fused": True} if choice.endswith("-fused") else {}
    if choice.startswith("adamw"):
        return torch.optim.AdamW(params, lr=LR, weight_decay=0.0, **fused)
    return torch.optim.SGD(params, lr=LR, **fused)
