"""The contract's mechanics, written once for every workload that runs torch steps - gpuwatch's DeepSeek
workload (workload/runner.py) and `GuardedLoop` around a user's loop (integrations/loop.py), which the
Hugging Face and Lightning callbacks drive: what counts as an OOM, the fields of the `oom` and
`oom_recovered` events, the allocator's figures of a steps row, switching activation checkpointing, and
the precision a framework's autocast is running. Before this module each workload had its own, and they
disagreed (the loop missed the CPU allocator's "can't allocate memory"; its events lacked `phase`, the
workload's lacked `step` and `micro_batches`). torch only; transformers is never imported here.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from gpuwatch.contract import Precision


def is_oom(exc: BaseException) -> bool:
    """A CUDA OOM, or the CPU allocator's equivalent ("DefaultCPUAllocator: can't allocate memory")."""
    text = str(exc).lower()
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text or "can't allocate memory" in text


ERROR_CHARS = 1000  # CUDA's OOM message is one line of ~600: what it tried to allocate, what the cap allows, what
# is reserved and unallocated - the figures that tell a fragmentation failure from a full cap; kept whole


def first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:ERROR_CHARS] if str(exc) else type(exc).__name__


def memory(device: torch.device) -> dict[str, int | None]:
    """The allocator's figures of a steps row (None off CUDA). `torch_inactive_split_bytes`: of the cached
    (reserved, unallocated) memory, what lies in free blocks split off segments still partly in use - reusable
    only by an allocation that fits such a block, so the part of the cache a fragmentation failure cannot use
    (reserved - allocated - this is in whole free segments, which any allocation up to their size can take, and
    in blocks freed whose stream's work is still pending)."""
    if device.type != "cuda":
        return {"torch_allocated_bytes": None, "torch_reserved_bytes": None, "torch_peak_bytes": None,
                "torch_inactive_split_bytes": None}
    st = torch.cuda.memory_stats(device)  # once: memory_allocated() and the others each flatten it again
    return {"torch_allocated_bytes": st.get("allocated_bytes.all.current", 0),
            "torch_reserved_bytes": st.get("reserved_bytes.all.current", 0),
            "torch_peak_bytes": st.get("allocated_bytes.all.peak", 0),
            "torch_inactive_split_bytes": st.get("inactive_split_bytes.all.current", 0)}


BLOCKS_EVERY_S = 0.5  # the allocator's blocks are read at most this often per device...
BLOCKS_COST_SHARE = 0.02  # ...and at most this share of the time (a snapshot walks every block: history makes it slow)
_NEXT_BLOCKS: dict[int, float] = {}  # device index -> when its blocks may be read next (time.monotonic)
NO_BLOCKS = {"torch_largest_free_bytes": None, "torch_largest_segment_bytes": None}
BLOCKS_EXPANDABLE_S = 600.0  # with expandable segments the next read waits this long (calls s47: every guarded run
# switched to them at its first cache release, and went on reading snapshots at up to BLOCKS_COST_SHARE of its time)


def largest_blocks(segments: list[dict[str, Any]], device_index: int) -> tuple[int, int] | None:
    """(the largest free block, the largest segment) in bytes among `device_index`'s large-pool segments of the
    default pool, from an allocator snapshot's `segments`. Small-pool segments (2 MiB) serve no large block; a
    CUDA graph's private pool serves only its graph. None with expandable segments: the allocator grows a
    range by mapping pages at its end, so a block larger than any free one needs no new segment and the two
    figures do not say what they say of fixed segments."""
    free = big = 0
    for seg in segments:
        if seg.get("device", device_index) != device_index or seg.get("segment_type", "large") != "large":
            continue
        pool = seg.get("segment_pool_id")
        if pool and tuple(pool) != (0, 0):
            continue
        if seg.get("is_expandable"):
            return None
        big = max(big, int(seg.get("total_size", 0)))
        for b in seg.get("blocks", ()):
            if b.get("state") == "inactive":
                free = max(free, int(b.get("size", 0)))
    return free, big


def blocks(device: torch.device) -> dict[str, int | None]:
    """The allocator's largest free block and largest segment after the step (schema v7), or None for both:
    off CUDA, where the last read on this device was under BLOCKS_EVERY_S ago (or cost more than
    BLOCKS_COST_SHARE of the time since), or where the snapshot fails. A block larger than the largest free
    one must come from a new segment - the cap's room, or what the allocator can release - which is how a
    cache with room in total still fails an allocation (fragmentation, issue 29)."""
    if device.type != "cuda":
        return dict(NO_BLOCKS)
    now = time.monotonic()
    try:  # resolved before the rate check: "cuda" without an index was checked under -1 and written under 0, so
        idx = device.index if device.index is not None else torch.cuda.current_device()  # read every step
    except Exception:  # noqa: BLE001 - a figure of a steps row never stops the step (review of dfcbd24)
        return dict(NO_BLOCKS)
    if now < _NEXT_BLOCKS.get(idx, 0.0):
        return dict(NO_BLOCKS)
    t0 = time.perf_counter()
    try:
        got = largest_blocks(_segments(), idx)
    except Exception:  # noqa: BLE001 - a figure of a steps row never stops the step
        _NEXT_BLOCKS[idx] = now + 60.0
        return dict(NO_BLOCKS)
    # expandable segments (None; the guard's release turns them on, for good): the figures say nothing, and a
    # snapshot still walks every block - not paid for again for minutes
    _NEXT_BLOCKS[idx] = now + (BLOCKS_EXPANDABLE_S if got is None else
                               max(BLOCKS_EVERY_S, (time.perf_counter() - t0) / BLOCKS_COST_SHARE))
    if got is None:
        return dict(NO_BLOCKS)
    return {"torch_largest_free_bytes": got[0], "torch_largest_segment_bytes": got[1]}


def _segments() -> list[dict[str, Any]]:
    """The allocator's segments on every device, without the trace entries where this torch can leave them
    out (memory history, if the user turned it on, would make each read build them all)."""
    try:
        return torch.cuda.memory_snapshot(include_traces=False)
    except TypeError:  # a torch whose memory_snapshot has no include_traces
        return torch.cuda.memory_snapshot()


def step_memory(device: torch.device) -> dict[str, int | None]:
    """The allocator's figures of a steps row: `memory` every step, `blocks` as often as it may be read."""
    return {**memory(device), **blocks(device)}


def oom_detail(*, micro: int, seq: int, precision: str, error: str, effective_batch: int, allocated_before: int | None,
               step: int | None, checkpointing: bool = False, **extra: Any) -> dict[str, Any]:
    """The one set of fields an `oom` event carries (docs/SCHEMA.md), from any workload."""
    return {"batch": micro, "seq_len": seq, "precision": precision, "error": error, "effective_batch": effective_batch,
            "micro_batches": -(-int(effective_batch) // max(1, int(micro))), "allocated_before": allocated_before,
            "step": step, "checkpointing": bool(checkpointing), **extra}


def oom_message(micro: int, seq: int, precision: str) -> str:
    return f"CUDA OOM at batch {micro} x {seq} ({precision})"


def recovered_detail(*, decision: str, retried: bool, allocated_before: int | None, allocated_after: int | None,
                     next_batch: int | None, next_seq_len: int | None, next_precision: str | None,
                     retry_control: str | None = None, retry_value: Any = None, **extra: Any) -> dict[str, Any]:
    """The one set of fields an `oom_recovered` event carries: the decision and the plan after it (what a
    replay scores next, predict/features._plan_after_oom)."""
    return {"decision": decision, "who": "recovery", "retried": retried, "retry_control": retry_control,
            "retry_value": retry_value, "allocated_before": allocated_before, "allocated_after": allocated_after,
            "back_to_pre_step": (allocated_after is not None and allocated_before is not None
                                 and allocated_after <= allocated_before),
            "next_batch": next_batch, "next_seq_len": next_seq_len, "next_precision": next_precision, **extra}


def checkpointable(model: Any) -> Any:
    """The module whose own switch turns activation checkpointing on: the model itself where it is a
    transformers model, else the first of its submodules that is (a LightningModule or a wrapper holding
    one), else None."""
    if model is None:
        return None
    mods = model.modules() if isinstance(model, torch.nn.Module) else [model]
    for m in mods:
        switch = getattr(m, "activation_checkpointing_enable", None) or getattr(m, "gradient_checkpointing_enable", None)
        if callable(switch) and getattr(m, "supports_gradient_checkpointing", True):
            return m
    return None


def can_checkpoint(model: Any, hook: Callable[[bool], Any] | None = None) -> bool:
    """Activation checkpointing can be switched at run time: a transformers model's own switch, or a hook."""
    return hook is not None or checkpointable(model) is not None


def checkpointing_now(model: Any) -> bool:
    """Whether a transformers model (or the one inside `model`) has activation checkpointing on."""
    m = checkpointable(model)
    if m is None:
        return False
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # transformers 5 renamed it
        if hasattr(type(m), name):
            return bool(getattr(m, name))
    return False


def set_checkpointing(model: Any, on: bool, hook: Callable[[bool], Any] | None = None) -> None:
    """Switch activation checkpointing between two steps: `hook(on)` where given, else the transformers
    model's `gradient_checkpointing_enable` / `disable` (non-reentrant: the same gradients, inputs that do
    not require grad allowed; the KV cache is off in training anyway)."""
    if hook is not None:
        hook(bool(on))
        return
    m = checkpointable(model)
    if m is None:
        raise ValueError("this model has no activation-checkpointing switch; pass GuardedLoop(checkpointing=hook)")
    if hasattr(m, "activation_checkpointing_enable"):  # transformers >= 5 (the old names warn there)
        if on:
            m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            m.activation_checkpointing_disable()
    elif on:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        m.gradient_checkpointing_disable()


def autocast_precision(device_type: str, default: Precision) -> Precision:
    """The precision autocast is running on this device type now (the caller's `with torch.autocast(...)`
    around `GuardedLoop.step`), else `default`."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return default
        dt = torch.get_autocast_dtype(device_type)
    except (TypeError, RuntimeError, AttributeError):
        return default
    return "bf16" if dt == torch.bfloat16 else "fp16" if dt == torch.float16 else default
