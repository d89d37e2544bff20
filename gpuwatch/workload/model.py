"""Building the DeepSeek model from a config (random weights, no download) and running one step of
each mode. torch and transformers are imported here only."""

from __future__ import annotations

import inspect
import time
from typing import Any

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(spec: str = "auto") -> torch.device:
    from gpuwatch.errors import UsageError

    if spec == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(spec)
    except RuntimeError:
        raise UsageError(f"bad --device {spec!r}: use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {spec}: no CUDA GPU is available to torch here")
        if (dev.index or 0) >= torch.cuda.device_count():
            raise UsageError(f"--device {spec}: only {torch.cuda.device_count()} GPU(s)")
        if dev.index is None:
            dev = torch.device("cuda:0")
    return dev


def apply_precision(model: torch.nn.Module, precision: str) -> None:
    """Cast the weights (fp32/tf32 keep fp32 weights; tf32 lets matmuls use TF32 tensor cores)."""
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.allow_tf32 = precision == "tf32"
    model.to(DTYPES[precision])


def build_model(fields: dict[str, Any], device: torch.device, precision: str, seed: int = 0):
    """DeepseekV3ForCausalLM with random weights, built directly on `device` in the target dtype."""
    torch.manual_seed(seed)
    config = DeepseekV3Config(**fields)
    t0 = time.perf_counter()
    old = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[precision])
    try:
        with torch.device(device):
            model = DeepseekV3ForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    apply_precision(model, precision)
    model.eval()
    return model, time.perf_counter() - t0


def random_ids(vocab: int, batch: int, seq: int, device: torch.device, gen: torch.Generator | None = None):
    return torch.randint(0, vocab, (batch, seq), device=device, generator=gen)


class LossScaler:
    """Dynamic loss scaling for fp16 training (halve on overflow and skip the step; double after
    `growth_interval` good steps). Works on fp16 weights, which torch's GradScaler refuses to unscale."""

    def __init__(self, scale: float = 2.0**14, growth_interval: int = 200) -> None:
        self.scale, self.growth_interval, self._good = scale, growth_interval, 0

    def unscale_and_check(self, params: list[torch.nn.Parameter]) -> bool:
        grads = [p.grad for p in params if p.grad is not None]
        finite = all(bool(torch.isfinite(g).all()) for g in grads)
        if not finite:
            self.scale /= 2
            self._good = 0
            return False
        torch._foreach_mul_(grads, 1.0 / self.scale)
        self._good += 1
        if self._good % self.growth_interval == 0:
            self.scale *= 2
        return True


def step_prefill(model, ids):
    with torch.inference_mode():
        out = model(input_ids=ids, logits_to_keep=1, use_cache=False)
        return None, out.logits.float().abs().max().item()


def _cache_kw(model) -> str:
    """transformers renamed `past_key_values` to `cache` (5.2x); accept both."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def step_decode(model, ids, new_tokens: int):
    """Prefill the prompt with a KV cache, then generate `new_tokens` tokens greedily."""
    kw = _cache_kw(model)
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        for _ in range(new_tokens):
            past = getattr(out, "cache", None) or out.past_key_values
            nxt = out.logits[:, -1:].argmax(-1)
            out = model(input_ids=nxt, use_cache=True, **{kw: past})
        return None, out.logits.float().abs().max().item()


def step_train(model, ids, optimizer, scaler: LossScaler | None):
    """Forward + backward + SGD step. Returns (loss, max |logit|); a non-finite loss skips the update."""
    model.train()
    try:
        out = model(input_ids=ids, labels=ids, use_cache=False)
        loss = out.loss
        max_logit = out.logits.detach().float().abs().max().item()
        del out
        value = loss.item()
        if not torch.isfinite(loss):
            return value, max_logit
        (loss * scaler.scale if scaler else loss).backward()
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if scaler is None or scaler.unscale_and_check(params):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return value, max_logit
    finally:
        model.eval()


def memory(device: torch.device) -> dict[str, int | None]:
    if device.type != "cuda":
        return {"torch_allocated_bytes": None, "torch_reserved_bytes": None, "torch_peak_bytes": None}
    return {"torch_allocated_bytes": torch.cuda.memory_allocated(device),
            "torch_reserved_bytes": torch.cuda.memory_reserved(device),
            "torch_peak_bytes": torch.cuda.max_memory_allocated(device)}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()
