"""Parameter and FLOP counts from a DeepseekV3Config's fields (plain dict; no torch).

Convention (as in the PaLM/Megatron MFU papers): a multiply-add is 2 FLOPs; a forward pass costs
2 x (matmul parameters used per token) per token plus attention's score and value products; a train
step costs 3 x forward (backward = 2 x forward). Embedding look-ups, norms, softmax and routing top-k
are not counted. MFU = achieved FLOP/s / the device's dense peak at that precision.
"""

from __future__ import annotations

from typing import Any

# Dense peak TFLOP/s (no sparsity) by precision, from the vendors' datasheets. The form factors differ
# (the PCIe and NVL cards run lower clocks and power): their names are matched first, the longest key that
# is in the device's name wins, so an "NVIDIA H200 NVL" is judged against its own peak, not the SXM's.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H200 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H100": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H100 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H100 PCIE": {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.1, "fp16": 362.1, "tf32": 183.0, "fp32": 91.6},
}


def peak_tflops(device_name: str | None, precision: str) -> float | None:
    """The dense peak of the GPU named `device_name` (torch's or NVML's name) at `precision`; None if unknown."""
    name = (device_name or "").upper()
    keys = sorted((k for k in PEAK_TFLOPS if k in name), key=len, reverse=True)
    return PEAK_TFLOPS[keys[0]].get(precision) if keys else None


def _attn_params(c: dict[str, Any]) -> int:
    h, heads = c["hidden_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    q = h * heads * qk if not c.get("q_lora_rank") else h * c["q_lora_rank"] + c["q_lora_rank"] * heads * qk
    kv_a = h * (c["kv_lora_rank"] + c["qk_rope_head_dim"])
    kv_b = c["kv_lora_rank"] * heads * (c["qk_nope_head_dim"] + c["v_head_dim"])
    o = heads * c["v_head_dim"] * h
    return q + kv_a + kv_b + o


def _layer_counts(c: dict[str, Any]) -> tuple[int, int]:
    dense = min(c.get("first_k_dense_replace", 0), c["num_hidden_layers"])
    return dense, c["num_hidden_layers"] - dense


def param_count(c: dict[str, Any]) -> int:
    """All matmul + embedding parameters (norm weights and biases left out: <0.01 %)."""
    h = c["hidden_size"]
    dense, moe = _layer_counts(c)
    mlp = 3 * h * c["intermediate_size"]
    expert = 3 * h * c["moe_intermediate_size"]
    moe_layer = c["n_routed_experts"] * expert + c["n_shared_experts"] * expert + h * c["n_routed_experts"]
    layers = c["num_hidden_layers"] * _attn_params(c) + dense * mlp + moe * moe_layer
    return layers + 2 * c["vocab_size"] * h  # embed_tokens + lm_head (untied)


def active_matmul_params(c: dict[str, Any]) -> int:
    """Matmul parameters one token passes through (top-k routed + shared experts, lm_head)."""
    h = c["hidden_size"]
    dense, moe = _layer_counts(c)
    expert = 3 * h * c["moe_intermediate_size"]
    moe_layer = (c["num_experts_per_tok"] + c["n_shared_experts"]) * expert + h * c["n_routed_experts"]
    return (c["num_hidden_layers"] * _attn_params(c) + dense * 3 * h * c["intermediate_size"]
            + moe * moe_layer + c["vocab_size"] * h)


def attention_flops_per_token(c: dict[str, Any], context: float) -> float:
    """Q.K^T and P.V for one token attending to `context` positions, all layers."""
    heads = c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    return c["num_hidden_layers"] * 2 * heads * (qk + c["v_head_dim"]) * context


def forward_flops(c: dict[str, Any], tokens: int, context: float, logit_tokens: int) -> float:
    """One forward pass over `tokens` tokens with mean attention span `context`, computing the
    vocabulary logits (lm_head) for `logit_tokens` of them."""
    body = active_matmul_params(c) - c["vocab_size"] * c["hidden_size"]
    return (tokens * (2 * body + attention_flops_per_token(c, context))
            + logit_tokens * 2 * c["vocab_size"] * c["hidden_size"])


def step_flops(c: dict[str, Any], mode: str, batch: int, seq_len: int, new_tokens: int = 0) -> float:
    """FLOPs of one workload step.
    prefill: `batch` x `seq_len` causal tokens (mean span (s+1)/2), logits for the last token only;
    train: the same with logits for every token, x3 (forward + backward);
    decode: a prefill of the prompt, then `new_tokens` single-token steps each attending to the cache."""
    tokens, context = batch * seq_len, (seq_len + 1) / 2
    if mode == "train":
        return 3 * forward_flops(c, tokens, context, tokens)
    total = forward_flops(c, tokens, context, batch)
    if mode == "decode":
        for i in range(new_tokens):
            total += forward_flops(c, batch, seq_len + i + 1, batch)
    return total
