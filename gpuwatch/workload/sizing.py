"""Will a preset fit? An estimate of a workload's memory from its config alone - the weights (parameter
count x bytes of the precision), a train step's gradients (the optimizer is plain SGD: no state of its
own), and the activations of one step - checked against what the device has, before anything is built.

Why: `stress --preset v3-slice` on a CPU-only host with 23.5 GiB built for 32 s, then died allocating
30 GB (one MoE layer's experts in fp32) and left a session folder. Now it is one line and exit 2.

The activation estimate is rough on purpose (within a factor of ~2 of what torch holds): the largest
tensors of a layer per token, a train step's every layer kept for backward, the attention scores of one
layer, the logits, and the decode KV cache (transformers' expanded one). Weights dominate every preset
that can fail this check. No torch import at module level (the CUDA query imports it lazily)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpuwatch.errors import UsageError
from gpuwatch.workload.flops import param_count

BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}
GiB = 2**30


@dataclass(frozen=True)
class Estimate:
    weights: int
    state: int  # train: the gradients (SGD keeps no optimizer state); 0 otherwise
    activations: int
    batch: int
    seq_len: int

    @property
    def total(self) -> int:
        return self.weights + self.state + self.activations


def _per_token_layer(c: dict[str, Any]) -> int:
    """Elements one token holds in the largest layer while it runs: residual and norm, queries, the
    expanded keys/values and the heads' outputs, and the MLP (a dense layer's or the routed + shared
    experts' intermediates)."""
    h, heads = c["hidden_size"], c["num_attention_heads"]
    dq = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    attn = 2 * h + heads * (2 * dq + c["qk_nope_head_dim"] + 2 * c["v_head_dim"]) + c["kv_lora_rank"]
    dense = 3 * c["intermediate_size"] if c.get("first_k_dense_replace", 0) > 0 else 0
    i = c["moe_intermediate_size"]
    moe = c["num_experts_per_tok"] * (3 * i + 2 * h) + 3 * i * c.get("n_shared_experts", 0) + c["n_routed_experts"]
    return attn + max(dense, moe if c["num_hidden_layers"] > c.get("first_k_dense_replace", 0) else 0)


def estimate(c: dict[str, Any], mode: str, precision: str, batch: int, seq_len: int,
             new_tokens: int = 0) -> Estimate:
    """Bytes a workload of config `c` needs for one step of `batch` x `seq_len`."""
    b = BYTES[precision]
    params = param_count(c)
    tokens = batch * seq_len
    layer = _per_token_layer(c) * tokens * b
    scores = batch * c["num_attention_heads"] * seq_len * seq_len * 4  # one layer's, fp32 softmax
    vocab = c["vocab_size"]
    if mode == "train":  # every layer's activations kept for backward; logits, their fp32 copy and gradient
        act = c["num_hidden_layers"] * layer + scores + tokens * vocab * (b + 8)
    else:  # one layer at a time; the last position's logits only
        act = layer + scores + batch * vocab * 4
    if mode == "decode":  # transformers' dynamic cache holds the expanded keys and values of every layer
        dq = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        act += (c["num_hidden_layers"] * batch * (seq_len + new_tokens) * c["num_attention_heads"]
                * (dq + c["v_head_dim"]) * b)
    return Estimate(weights=params * b, state=params * b if mode == "train" else 0, activations=int(act),
                    batch=batch, seq_len=seq_len)


def available_bytes(device, limit: int | None = None) -> int | None:
    """What the workload may use: the host's available RAM (psutil) for a CPU; for a CUDA GPU its free
    memory, at most `limit` (--gpu-memory-limit). None if it cannot be read."""
    if getattr(device, "type", str(device)) == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info(device)
        return min(free, limit) if limit else free
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - no reading: no refusal
        return None


def check_fits(est: Estimate, available: int | None, preset: str, mode: str, precision: str, device: str) -> None:
    """UsageError (one line) when the estimate is more than the device has."""
    if available is None or est.total <= available:
        return
    parts = [f"{est.weights / GiB:.1f} weights"]
    if est.state:
        parts.append(f"{est.state / GiB:.1f} gradients")
    parts.append(f"{est.activations / GiB:.1f} activations at batch {est.batch} x {est.seq_len}")
    where = "RAM available on this CPU host" if device == "cpu" else f"usable on {device}"
    raise UsageError(f"--preset {preset} ({mode}, {precision}) needs about {est.total / GiB:.1f} GiB "
                     f"({' + '.join(parts)}) but only {available / GiB:.1f} GiB is {where}: choose a smaller "
                     "--preset or fewer layers (--set num_hidden_layers=N)")
