"""What a batch is, for the guard around a user's loop: a tensor, or a Mapping / tuple / list of tensors
whose first dimension is the batch (the sequence length the second of the first 2-D tensor); cut into
micro-batches the way `tensor_split` cuts; a framework's per-device batch that keeps the effective batch.
Used by `GuardedLoop` and the Hugging Face and Lightning callbacks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

Batch = Any  # a tensor, or a Mapping / tuple / list of tensors whose first dimension is the batch


def first_tensor(batch: Batch, min_dim: int = 0) -> torch.Tensor | None:
    """The first tensor with at least `min_dim` dimensions, depth first through dicts, lists and tuples."""
    if isinstance(batch, torch.Tensor):
        return batch if batch.dim() >= min_dim else None
    vals = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for v in vals:
        t = first_tensor(v, min_dim)
        if t is not None:
            return t
    return None


def batch_size_of(batch: Batch) -> int:
    """The first dimension of the first tensor that has one (a 0-d tensor beside the batch is a setting)."""
    t = first_tensor(batch, min_dim=1)
    if t is None:
        raise TypeError("a batch must hold a tensor whose first dimension is the batch")
    return int(t.shape[0])


def seq_len_of(batch: Batch) -> int:
    """The second dimension of the first tensor that has one (token ids), else 1."""
    t = first_tensor(batch, min_dim=2)
    return (int(t.shape[1]) if t is not None else 0) or 1


def split(batch: Batch, k: int) -> list[Batch]:
    """`batch` as `k` micro-batches along the first dimension (sizes differ by at most one)."""
    if k <= 1:
        return [batch]
    n = batch_size_of(batch)

    def cut(b, i):
        if isinstance(b, torch.Tensor):
            return b.tensor_split(k)[i] if b.dim() and b.shape[0] == n else b
        if isinstance(b, Mapping):
            d = {key: cut(v, i) for key, v in b.items()}
            if type(b) is dict:
                return d
            try:
                return type(b)(d)
            except TypeError:  # a mapping type that is not built from a dict (defaultdict)
                return d
        if isinstance(b, (list, tuple)):
            # a structure holding the batch's tensors (a TensorDataset's [ids], an (inputs, targets) tuple) is cut
            # element by element; a sequence of the batch's n rows (strings, per-row dicts or tensors) by its rows
            batched = any(isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == n for v in b)
            nested = any(isinstance(v, (Mapping, list, tuple)) for v in b)
            if batched or (nested and len(b) != n) or (isinstance(b, tuple) and len(b) != n):
                parts = [cut(v, i) for v in b]
                return parts if isinstance(b, list) else _same_tuple(b, parts)
            if len(b) == n:
                rows = [b[j] for j in ranges(n, k)[i]]
                return rows if isinstance(b, list) else tuple(rows)
        return b
    return [cut(batch, i) for i in range(k)]


def _same_tuple(b: tuple, parts: list) -> tuple:
    """`parts` as a tuple of `b`'s type (a named tuple takes its fields by position)."""
    if type(b) is tuple:
        return tuple(parts)
    try:
        return type(b)(*parts)
    except TypeError:
        return tuple(parts)


def shares(batch: Batch, k: int) -> list[tuple[Batch, float]]:
    """`batch` as `k` micro-batches, each with its share of the batch's rows: a micro-batch's mean loss times
    its share, summed over the micro-batches, is the batch's mean loss, and so are the gradients (what
    `GuardedLoop.step` and the frameworks' in-step split backpropagate)."""
    n = batch_size_of(batch)
    return [(part, batch_size_of(part) / n) for part in split(batch, k)]


def chunks(n: int, micro: int | None) -> int:
    """How many micro-batches of at most `micro` rows a batch of `n` rows runs as (1 without a ceiling)."""
    return max(1, -(-int(n) // int(micro))) if micro else 1


def ranges(n: int, k: int) -> list[range]:
    """The index ranges tensor_split(k) uses: the first n % k parts one longer."""
    q, r = divmod(n, k)
    out, start = [], 0
    for i in range(k):
        size = q + (1 if i < r else 0)
        out.append(range(start, start + size))
        start += size
    return out


def per_device_batch(effective: int, cap: int) -> int:
    """The largest divisor of `effective` that is at most `cap` (at least 1): a framework's per-device
    batch that, with `effective // it` accumulation steps, keeps the effective batch exactly."""
    cap = max(1, min(int(cap), int(effective)))
    for b in range(cap, 0, -1):
        if effective % b == 0:
            return b
    return 1
