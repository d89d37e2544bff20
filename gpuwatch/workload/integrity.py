"""The integrity check of `--integrity-every N`: the same input twice through the model must give the same
logits within the precision's tolerance (a GPU that computes wrongly under load says so here first)."""

from __future__ import annotations

import torch

from gpuwatch.workload.model import random_ids


def integrity(model, vocab: int, seq: int, device: torch.device, precision: str) -> tuple[float, float, bool]:
    """The same input twice: (largest difference of the logits, the precision's tolerance, whether the
    non-finite values fall in the same places - NaN twice is consistent; the `nonfinite` event says so)."""
    gen = torch.Generator(device=device).manual_seed(1234)
    ids = random_ids(vocab, 1, seq, device, gen)
    with torch.inference_mode():
        a = model(input_ids=ids, use_cache=False, logits_to_keep=8).logits.float()
        b = model(input_ids=ids, use_cache=False, logits_to_keep=8).logits.float()
    scale = max(1.0, a.nan_to_num(0, 0, 0).abs().max().item())
    tol = (1e-3 if precision in ("bf16", "fp16") else 1e-5) * scale
    return (a - b).nan_to_num(0, 0, 0).abs().max().item(), tol, bool((a.isfinite() == b.isfinite()).all())
