"""What DDP's gradient all-reduce costs in a step, measured by a comm hook around torch's own
`allreduce_hook` (the one DDP runs by default: divide by the world size, all-reduce each bucket).

Per bucket the hook counts the bytes it hands to the all-reduce and marks two moments: when the bucket is
launched (DDP calls the hook as soon as the bucket's last gradient is ready) and when its all-reduce has
completed (the future's callback; on CUDA a CUDA event recorded on the stream that callback runs on, which
torch synchronizes with the NCCL kernel). `comm_time_s` is the union of those intervals in the step: the
time at least one all-reduce was in flight. It overlaps backward's compute (that is DDP's point), so it is
not "time lost to communication": compute + comm exceeds the step time by what overlapped.
`comm_bytes` is the gradient payload one rank all-reduces per step (a ring moves 2(n-1)/n of it per rank).
"""

from __future__ import annotations

import time

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks


class CommMeter:
    def __init__(self, device: torch.device, world: int) -> None:
        self.cuda = device.type == "cuda"
        self.world = world
        self.spans: list[list] = []
        self.bytes = 0
        self.ref = None

    def reset(self) -> None:
        """At the start of a step (before its forward)."""
        self.spans, self.bytes = [], 0
        self.ref = self._mark()

    def _mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def hook(self, process_group, bucket):
        buf = bucket.buffer()
        self.bytes += buf.numel() * buf.element_size()
        span = [self._mark(), None]
        self.spans.append(span)

        def done(fut):
            span[1] = self._mark()
            return fut.value()

        return default_hooks.allreduce_hook(process_group, bucket).then(done)

    def _offset(self, mark) -> float:
        if self.cuda:
            return self.ref.elapsed_time(mark) / 1000.0
        return mark - self.ref

    def result(self) -> tuple[float | None, int | None]:
        """(seconds with an all-reduce in flight, bytes all-reduced) since `reset()`; call after the step
        synchronized. (None, None) before any step."""
        if self.ref is None:
            return None, None
        if self.cuda:
            torch.cuda.synchronize()
        spans = sorted((self._offset(a), self._offset(b)) for a, b in self.spans if b is not None)
        total, end = 0.0, float("-inf")
        for a, b in spans:
            if b <= end:
                continue
            total += b - max(a, end)
            end = b
        return total, self.bytes
