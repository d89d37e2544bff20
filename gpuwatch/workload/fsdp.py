"""Sharded data parallelism for `stress --dp fsdp` (issue 19): torch's FSDP, so a model whose weights,
gradients and optimizer state do not fit one GPU beside its activations (v3-slice) trains over N ranks,
each holding 1/N of them.

FSDP2's `fully_shard` (torch.distributed.fsdp, public since torch 2.6: the GPU machine's 2.11 and CI's
2.13 both have it) where torch has it, else FSDP1's `FullyShardedDataParallel`; either way one unit per
decoder layer (its weights are gathered just before its forward and freed after) and the root around the
embeddings and the head. Which one ran is recorded (`engine` in the workload's meta and its
`workload_start` event).

What differs from DDP in gpuwatch's step: no comm hook (FSDP's all-gathers and reduce-scatters run inside
forward and backward), so `comm_time_s`/`comm_bytes` stay null; gradient accumulation without sync is
`set_requires_gradient_sync(False)` (FSDP2) or `no_sync()` (FSDP1); the optimizer is built over the
sharded parameters; a precision change is not applied (the shards would have to be rebuilt at the same
step on every rank: refused with an event, and the guard is told it cannot do it).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        return None
    return fully_shard


def engine_name() -> str:
    """What `shard` will use in this torch."""
    return "fully_shard (FSDP2)" if _fully_shard() is not None else "FullyShardedDataParallel (FSDP1)"


def decoder_layers(model) -> list[torch.nn.Module]:
    """The decoder layers of a transformers causal LM (`model.model.layers`)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers (model.model.layers) to shard")
    return list(layers)


def shard(model, device: torch.device) -> tuple[Any, str]:
    """Shard `model` in place over the default process group, one FSDP unit per decoder layer plus the root.
    Returns (the module to call, the engine's name)."""
    fully_shard = _fully_shard()
    layers = decoder_layers(model)
    if fully_shard is not None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if hasattr(model, "set_reduce_scatter_unused_params"):  # an expert no token reached on one rank only
            model.set_reduce_scatter_unused_params(True)
        return model, engine_name()
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({type(layers[0])}), use_orig_params=True,
                   device_id=device if device.type == "cuda" else None)
    return wrapped, engine_name()


def param_bytes(module) -> tuple[int, int]:
    """(bytes of parameters this rank holds, bytes of the whole model's parameters)."""
    here = full = 0
    for p in module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        here += local.numel() * local.element_size()
        full += p.numel() * p.element_size()
    return here, full


@contextlib.contextmanager
def no_sync(module, engine: str, sync: bool):
    """Accumulate gradients without their reduce-scatter (every micro-batch but the last)."""
    if sync:
        yield
        return
    if "FSDP2" in engine:
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
    else:
        with module.no_sync():
            yield
