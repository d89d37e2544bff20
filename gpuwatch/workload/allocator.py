"""The allocator remedies the guard applies when the batch is not what fails: fragmentation (memory
reserved by the caching allocator but not allocated: a step needs one large block and no free piece
is large enough) is met by releasing the cache and, once, switching the allocator to expandable
segments (one virtual range per stream that grows in place, so freed pieces merge; vLLM turned them
on by default after fragmentation OOMs). Light: torch only (no transformers), so the library loop
imports it without the DeepSeek workload.
"""

from __future__ import annotations

import gc

import torch


def release_cache(device: torch.device, expandable: bool = False) -> list[str]:
    """The fragmentation remedy: give the caching allocator's unused blocks back to the driver and, where
    the running torch allows it at run time, make new segments expandable (one virtual range that grows,
    so freed pieces merge). Returns what was done. Nothing to do off CUDA."""
    done: list[str] = []
    if device.type != "cuda":
        return done
    gc.collect()
    torch.cuda.empty_cache()
    done.append("cache released")
    if expandable:
        ok = set_expandable_segments()
        done.append("allocator switched to expandable segments" if ok is True else f"expandable segments: {ok}")
    return done


def set_expandable_segments(on: bool = True) -> bool | str:
    """Switch the CUDA caching allocator to expandable segments at run time (`on=False`: back to fixed
    segments, as a process that runs several measurements in turn needs between them). Newer torch
    builds take it as `torch._C._accelerator_setAllocatorSettings`; torch 2.1-2.13 as
    `torch.cuda.memory._set_allocator_settings` (private, stable since 2.1; deprecated after). Segments
    made after the call use it. True, or why not."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or getattr(
        torch.cuda.memory, "_set_allocator_settings", None)
    if setter is None:
        return f"not offered by torch {torch.__version__}"
    try:
        setter(f"expandable_segments:{on}")
    except Exception as e:  # noqa: BLE001 - a build without it (ROCm, old driver) says so
        return f"refused: {str(e).splitlines()[0][:120]}"
    return True
