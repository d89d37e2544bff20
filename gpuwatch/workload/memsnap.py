"""CUDA allocator snapshots at alarm time: the operator sees what holds the memory before the crash.

`torch.cuda.memory._snapshot()` lists every segment and block of the caching allocator; pickled, it is
what PyTorch's memory_viz (https://pytorch.org/memory_viz) opens. Without allocation history enabled
(which costs every allocation a stack capture) the blocks carry no stack traces, so "growing" means:
active blocks that were not there after the first step of the run (the baseline), largest first.
"""

from __future__ import annotations

import pickle
import time
from pathlib import Path
from typing import Any

import torch

from gpuwatch.atomic import write_file


def active_blocks(snap: dict[str, Any]) -> dict[int, int]:
    """address -> size of every allocated block."""
    out = {}
    for seg in snap.get("segments", []):
        addr = seg.get("address", 0)
        for b in seg.get("blocks", []):
            if b.get("state") == "active_allocated":
                out[addr] = b.get("size", 0)
            addr += b.get("size", 0)
    return out


def baseline(device: torch.device) -> dict[int, int]:
    return active_blocks(torch.cuda.memory._snapshot(device))


def save_memory_snapshot(device: torch.device, directory: Path | str | None,
                         base: dict[int, int] | None) -> dict[str, Any]:
    """Snapshot the allocator; pickle it into `directory` (if given); name the largest blocks that
    appeared since `base`. Returns the event's detail."""
    t0 = time.perf_counter()
    snap = torch.cuda.memory._snapshot(device)
    blocks = active_blocks(snap)
    new = sorted(((a, s) for a, s in blocks.items() if not base or a not in base), key=lambda x: -x[1])
    path = None
    if directory is not None:
        path = Path(directory) / f"memory-snapshot-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.pickle"
        # atomic (a crash right after the alarm leaves no half snapshot); no fsync: this runs before the
        # workload's next step, and a killed process still loses nothing the kernel has
        write_file(path, pickle.dumps(snap), fsync=False)
    return {"file": path.name if path else None, "active_blocks": len(blocks),
            "active_bytes": sum(blocks.values()), "new_blocks": len(new), "new_bytes": sum(s for _, s in new),
            "largest_growing": [{"address": hex(a), "size": s} for a, s in new[:8]],
            "seconds": round(time.perf_counter() - t0, 4)}


def snapshot_event(bus, device: torch.device, request: tuple[str, Path | str | None], base: dict[int, int] | None,
                   gpu: int | None, label: str) -> None:
    """Take a requested snapshot (reason, directory) before a step and say so as a `memory_snapshot`
    event naming the largest growing blocks; a failed snapshot is a warning and never stops the run."""
    reason, directory = request
    try:
        info = save_memory_snapshot(device, directory, base)
    except Exception as e:  # noqa: BLE001 - a failed snapshot must not stop the run
        bus.emit("memory_snapshot", f"memory snapshot failed: {e}", "warning", gpu=gpu)
        return
    top = ", ".join(f"{b['size'] / 2**20:.0f} MiB" for b in info["largest_growing"][:3]) or "none"
    bus.emit("memory_snapshot", f"{label} ({reason}); largest growing: {top}", "warning", gpu=gpu, **info)
