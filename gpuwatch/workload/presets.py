"""Model presets (DeepseekV3Config fields) and the choices the CLI offers. No torch import here."""

from __future__ import annotations

from typing import Any

SCHEDULES = ("steady", "soak", "sweep", "ramp", "long")

_COMMON: dict[str, Any] = {
    "hidden_act": "silu", "rope_theta": 10000.0, "attention_bias": False, "attention_dropout": 0.0,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "use_cache": False, "initializer_range": 0.02,
    "rope_interleave": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
}

PRESETS: dict[str, dict[str, Any]] = {
    # a few M params: CPU and CI
    "tiny": dict(
        vocab_size=4096, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
        kv_lora_rank=64, q_lora_rank=None, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        max_position_embeddings=4096, routed_scaling_factor=1.0, norm_topk_prob=False,
        _batch=4, _seq_len=64,
    ),
    # ~0.5 B params
    "small": dict(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
        num_hidden_layers=8, first_k_dense_replace=1, num_attention_heads=16, num_key_value_heads=16,
        n_routed_experts=32, num_experts_per_tok=4, n_shared_experts=2, n_group=1, topk_group=1,
        kv_lora_rank=256, q_lora_rank=None, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
        max_position_embeddings=16384, routed_scaling_factor=1.0, norm_topk_prob=False,
        _batch=8, _seq_len=512,
    ),
    # DeepSeek-V2-Lite's shape: ~15.7 B params, ~29 GiB in bf16
    "v2-lite": dict(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, first_k_dense_replace=1, num_attention_heads=16, num_key_value_heads=16,
        n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, n_group=1, topk_group=1,
        kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        max_position_embeddings=32768, routed_scaling_factor=1.0, norm_topk_prob=False,
        _batch=32, _seq_len=512,
    ),
    # DeepSeek-V3 widths (MLA with q LoRA, 256 experts top-8, group routing), 1 dense + 2 MoE layers
    "v3-slice": dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=128, num_key_value_heads=128,
        n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4,
        kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        max_position_embeddings=32768, routed_scaling_factor=2.5, norm_topk_prob=True,
        _batch=16, _seq_len=512,
    ),
}

# Fraction of device memory the weights may take for a preset to count as fitting (leaves room for
# activations, KV cache, gradients of a train step with plain SGD).
FIT_FRACTION = 0.30


def config_fields(preset: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """DeepseekV3Config keyword arguments for `preset` with `overrides` applied."""
    fields = {**_COMMON, **{k: v for k, v in PRESETS[preset].items() if not k.startswith("_")}}
    fields.update(overrides or {})
    return fields


def defaults(preset: str) -> tuple[int, int]:
    """(batch, seq_len) a preset starts with."""
    p = PRESETS[preset]
    return p["_batch"], p["_seq_len"]


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`["num_hidden_layers=4", "q_lora_rank=None"]` -> typed dict (int, float, bool, None, str).
    Raises only UsageError; `validate_overrides` then checks keys and types against the config."""
    import math

    from gpuwatch.errors import UsageError

    out: dict[str, Any] = {}
    for item in items:
        item = str(item)
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier() or not key.isascii():
            shown = repr(item) if len(repr(item)) <= 60 else repr(item)[:57] + "...'"
            raise UsageError(f"bad --set {shown}: use KEY=VALUE, e.g. num_hidden_layers=4")
        raw = raw.strip()
        low = raw.lower()
        if low in ("none", "null"):
            out[key] = None
        elif low in ("true", "false"):
            out[key] = low == "true"
        else:
            try:
                out[key] = int(raw) if raw.isascii() else raw
            except ValueError:
                try:
                    f = float(raw) if raw.isascii() else raw
                    out[key] = f if isinstance(f, float) and math.isfinite(f) else raw
                except ValueError:
                    out[key] = raw
    return out


# DeepseekV3Config fields that take None although their default is a number (None switches them off)
_OPTIONAL = {"q_lora_rank", "pad_token_id", "bos_token_id", "eos_token_id", "head_dim", "rope_scaling",
             "rope_parameters", "max_window_layers"}
_INT_MAX = 2**31 - 1


def validate_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """Check `--set` overrides against transformers' DeepseekV3Config: each key must be one of its
    fields and each value fit the field's default type (a whole number for an int field, a number for
    a float field, true/false for a flag, None only where the field may be None). Returns the
    overrides with ints given to float fields made floats; raises UsageError naming the key."""
    import math

    from gpuwatch.errors import UsageError

    if not overrides:
        return {}
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config()
    fields = {k: v for k, v in cfg.to_dict().items() if not k.startswith("_")}
    # legacy keyword arguments the config folds into a dict field (rope_theta -> rope_parameters)
    for k, v in (fields.get("rope_parameters") or {}).items():
        if k != "rope_type":
            fields.setdefault(k, v)
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        shown = "None" if value is None else str(value)
        shown = shown if shown.isprintable() else repr(shown)
        where = f"--set {key}={shown[:40]}"
        if key not in fields and not (key in _OPTIONAL and hasattr(cfg, key)):
            near = sorted(k for k in fields if k.split("_")[0] == str(key).split("_")[0])[:3]
            hint = f" (did you mean {', '.join(near)}?)" if near else " (see DeepseekV3Config)"
            raise UsageError(f"{where}: {key} is not a DeepseekV3Config field{hint}")
        default = fields.get(key, getattr(cfg, key, None))
        if value is None:
            if default is None or key in _OPTIONAL:
                out[key] = None
                continue
            raise UsageError(f"{where}: {key} cannot be None")
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise UsageError(f"{where}: {key} must be true or false")
        elif isinstance(default, int) or (default is None and key in _OPTIONAL and key != "rope_scaling"
                                          and key != "rope_parameters"):
            if isinstance(value, bool) or not isinstance(value, int):
                raise UsageError(f"{where}: {key} must be a whole number")
            if abs(value) > _INT_MAX:
                raise UsageError(f"{where}: {key} is out of range")
            if value < 0 and (default is None or default >= 0):
                raise UsageError(f"{where}: {key} must not be negative")
        elif isinstance(default, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise UsageError(f"{where}: {key} must be a number")
            value = float(value)
            if not math.isfinite(value):
                raise UsageError(f"{where}: {key} must be a finite number")
        elif isinstance(default, str):
            if not isinstance(value, str):
                raise UsageError(f"{where}: {key} must be text")
        elif isinstance(default, (dict, list, tuple)):
            raise UsageError(f"{where}: {key} is a structured field and cannot be set with --set (only None)")
        elif default is not None and not isinstance(value, type(default)):
            raise UsageError(f"{where}: {key} must be {type(default).__name__}")
        out[key] = value
    return out


def choose_preset(device_mem_bytes: int | None, overrides: dict[str, Any] | None = None) -> str:
    """The largest preset whose bf16 weights fit in FIT_FRACTION of the device (tiny on a CPU)."""
    from gpuwatch.workload.flops import param_count

    if not device_mem_bytes:
        return "tiny"
    best = "tiny"
    for name in PRESETS:
        if param_count(config_fields(name, overrides)) * 2 <= FIT_FRACTION * device_mem_bytes:
            if param_count(config_fields(name, overrides)) > param_count(config_fields(best, overrides)):
                best = name
    return best


# The experts run as grouped GEMMs (torch._grouped_mm, transformers' "grouped_mm"), which need every
# row stride to be a multiple of 16 bytes: 8 elements at bf16/fp16 (the guard may lower an fp32 run's
# precision mid-run, so 8 whatever it starts at). `hidden_size=7` failed there after ~10 s of building.
ALIGN = 8
_AT_LEAST_1 = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "n_routed_experts", "num_experts_per_tok", "n_group",
               "topk_group", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
               "max_position_embeddings")


def check_config(fields: dict[str, Any], overrides: dict[str, Any] | None = None, preset: str = "") -> None:
    """The DeepseekV3 model's own constraints on a whole config (a preset with its `--set` overrides),
    checked before anything is built: positive sizes, the grouped GEMM's alignment, experts and groups
    that the router can choose from, dense layers within the layers. Raises UsageError, one line, naming
    the field as the user gave it (`--set k=v`) or as the preset has it."""
    from gpuwatch.errors import UsageError

    ov = overrides or {}

    def name(k: str) -> str:
        return f"--set {k}={ov[k]}" if k in ov else f"{k}={fields.get(k)} ({preset or 'preset'})"

    def fail(keys: tuple[str, ...], why: str) -> None:
        given = [k for k in keys if k in ov] or list(keys[:1])
        raise UsageError(f"{', '.join(name(k) for k in given)}: {why}")

    def num(k: str) -> int:
        v = fields.get(k)
        if isinstance(v, bool) or not isinstance(v, int):
            fail((k,), f"{k} must be a whole number")
        return v

    for k in _AT_LEAST_1:
        if num(k) < (2 if k == "vocab_size" else 1):
            fail((k,), f"{k} must be at least {2 if k == 'vocab_size' else 1}")
    if fields.get("q_lora_rank") is not None and num("q_lora_rank") < 1:
        fail(("q_lora_rank",), "q_lora_rank must be at least 1 (or None: no query LoRA)")
    for k in ("n_shared_experts", "first_k_dense_replace"):
        if num(k) < 0:
            fail((k,), f"{k} must not be negative")
    for k in ("hidden_size", "moe_intermediate_size"):
        if fields[k] % ALIGN:
            fail((k,), f"{k} must be a multiple of {ALIGN} (the experts' grouped GEMM needs 16-byte strides)")
    if fields["qk_rope_head_dim"] % 2:
        fail(("qk_rope_head_dim",), "qk_rope_head_dim must be even (rotary pairs)")
    heads, kv = fields["num_attention_heads"], fields["num_key_value_heads"]
    if kv != heads:
        fail(("num_key_value_heads", "num_attention_heads"), f"num_key_value_heads ({kv}) must equal "
             f"num_attention_heads ({heads}): DeepSeek's latent attention expands its keys per head")
    layers, dense = fields["num_hidden_layers"], fields["first_k_dense_replace"]
    if dense > layers:
        fail(("first_k_dense_replace", "num_hidden_layers"),
             f"first_k_dense_replace ({dense}) must be at most num_hidden_layers ({layers})")
    e, k, g, tg = (fields[x] for x in ("n_routed_experts", "num_experts_per_tok", "n_group", "topk_group"))
    if k > e:
        fail(("num_experts_per_tok", "n_routed_experts"),
             f"num_experts_per_tok ({k}) must be at most n_routed_experts ({e})")
    if e % g:
        fail(("n_group", "n_routed_experts"), f"n_routed_experts ({e}) must be a multiple of n_group ({g})")
    if e // g < 2:  # the router scores a group by its two best experts
        fail(("n_group", "n_routed_experts"), f"{e} experts in {g} groups: the router needs at least 2 experts per "
             "group (it scores a group by its best two)")
    if tg > g:
        fail(("topk_group", "n_group"), f"topk_group ({tg}) must be at most n_group ({g})")
    if k > tg * (e // g):
        fail(("num_experts_per_tok", "topk_group", "n_group"), f"num_experts_per_tok ({k}) must be at most the "
             f"experts of the topk_group ({tg}) groups chosen ({tg * (e // g)})")
    for f in ("rms_norm_eps", "routed_scaling_factor"):
        v = fields.get(f)
        if isinstance(v, (int, float)) and not v > 0:
            fail((f,), f"{f} must be > 0")
    from transformers.activations import ACT2FN

    act = fields.get("hidden_act")
    if act not in ACT2FN:
        fail(("hidden_act",), f"hidden_act {act!r} is not an activation transformers knows (e.g. silu, gelu)")
    from transformers import DeepseekV3Config

    try:  # what the config itself checks (rope parameters, ...)
        DeepseekV3Config(**fields)
    except Exception as e:  # noqa: BLE001 - any refusal of the config is the user's input
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise UsageError(f"bad model config ({preset or 'preset'}{' with --set' if ov else ''}): {first}") from None
