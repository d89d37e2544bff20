"""What a captured decode build holds, and how it is let go: the one side stream per CUDA device that
every warm-up and capture runs on, and the bounded cache of an engine's builds (static KV cache, buffers,
CUDA graphs) by batch and prompt length (defect 8: memory at one batch grew with every re-capture).
Used by model.DecodeEngine; torch is imported here only for the stream."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable

import torch

# One side stream per CUDA device for every warm-up and capture of every engine. cuBLAS keeps a workspace
# (32 MiB on Hopper) per (handle, stream) for the life of the process: a new torch.cuda.Stream per build kept
# 32 MiB per re-capture, up to the 32 streams of torch's pool (measured on the H200, small preset: 0.98 ->
# 1.95 GiB allocated at the same batch; benchmarks/gpu_decode_graphs.py). torch.cuda.graph's own default
# capture stream is one per process, made on whichever device was current first: per device here.
_SIDE_STREAMS: dict[int, Any] = {}
_SIDE_LOCK = threading.Lock()


def side_stream(device) -> "torch.cuda.Stream":
    """The one side stream of a CUDA device that engines warm up and capture on."""
    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    with _SIDE_LOCK:
        if index not in _SIDE_STREAMS:
            _SIDE_STREAMS[index] = torch.cuda.Stream(torch.device("cuda", index))
        return _SIDE_STREAMS[index]


class BuildCache:
    """A decode engine's builds - static KV cache, buffers, CUDA graphs - by build key, at most `keep`
    of them, the least recently run evicted first. Evicting resets the build's graphs (their private memory
    pools go back to torch's allocator) and drops its tensors, so a batch no longer run holds nothing.
    keep=1 (the engine's default): a move to another batch frees the last one's build before the new one
    is made (a workload near its memory cap must not hold the caches of batches it is not running)."""

    def __init__(self, keep: int = 1) -> None:
        self.keep = max(1, int(keep))
        self._items: OrderedDict[tuple, tuple[dict[str, Any], Any]] = OrderedDict()  # key -> (build, its state)
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: tuple) -> bool:
        return key in self._items

    def get(self, key: tuple) -> tuple[dict[str, Any], Any] | None:
        """(the build, the state it was put with), or None; a hit counts as the most recent use."""
        held = self._items.get(key)
        if held is not None:
            self._items.move_to_end(key)
        return held

    def put(self, key: tuple, entry: dict[str, Any], state: Any = None) -> None:
        self._items[key] = (entry, state)
        self._items.move_to_end(key)
        while len(self._items) > self.keep:
            self._evict(next(iter(self._items)))

    def make_room(self) -> None:
        """Evict until one more build fits (before building it: the old memory is free first)."""
        while len(self._items) >= self.keep:
            self._evict(next(iter(self._items)))

    def drop_where(self, stale: Callable[[tuple], bool]) -> None:
        for key in [k for k in self._items if stale(k)]:
            self._evict(key)

    def clear(self) -> None:
        for key in list(self._items):
            self._evict(key)

    def _evict(self, key: tuple) -> None:
        free(self._items.pop(key)[0])
        self.evictions += 1


def free(entry: dict[str, Any]) -> None:
    """Drop one build: its graphs reset (the private pool released), every tensor let go."""
    for name, value in entry.items():
        if name.startswith("g_") and value is not None:
            value.reset()
    entry.clear()
