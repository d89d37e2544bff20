"""A collective bandwidth check like nccl-tests (all_reduce_perf, all_gather_perf, reduce_scatter_perf):
every op over sizes doubling from 8 B to a maximum (1 GiB by default), float32, 5 warm-up and 20 timed
iterations per size (fewer above 64 MiB), the time the slowest rank took.

Figures as nccl-tests defines them (its doc/PERFORMANCE.md): `size` is the whole buffer (all-reduce: the
buffer; all-gather: the gathered output; reduce-scatter: the input), algbw = size / time, and the bus
bandwidth busbw = algbw x 2(n-1)/n for all-reduce and algbw x (n-1)/n for all-gather and reduce-scatter,
the figure comparable with the hardware's link bandwidth whatever the number of ranks.

The peak compared with is the interconnect's specified bandwidth per direction: busbw counts the bytes
each rank sends (and receives) over its links, so nccl-tests' busbw approaches the unidirectional figure.
An H200 (or H100 SXM) has NVLink 4: 18 links x 50 GB/s = 900 GB/s bidirectional, 450 GB/s each way; 450
is the figure used. Other devices have no known peak (the check then reports no percentage) unless given.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

OPS = ("all_reduce", "all_gather", "reduce_scatter")
NVLINK4 = (450.0, "NVLink 4 (H100/H200 SXM): 900 GB/s bidirectional = 450 GB/s per direction; busbw is per direction")
MIN_BYTES = 8


def bus_factor(op: str, n: int) -> float:
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def sizes(max_bytes: int, min_bytes: int = MIN_BYTES) -> list[int]:
    out, s = [], min_bytes
    while s <= max_bytes:
        out.append(s)
        s *= 2
    return out


def specified_peak(device: torch.device) -> tuple[float | None, str]:
    """(GB/s per direction, where the figure comes from) of this device's interconnect, if known."""
    if device.type != "cuda":
        return None, "no specified peak: gloo on the CPU"
    name = torch.cuda.get_device_name(device)
    if "H200" in name or ("H100" in name and "PCIe" not in name and "NVL" not in name):
        return NVLINK4
    return None, f"no specified peak known for {name}"


def _one(op: str, size: int, n: int, device: torch.device, group=None):
    """The tensors of one op at `size` bytes, and a callable running it once; None if size does not split."""
    count = size // 4
    if op != "all_reduce" and (count % n or count < n):
        return None
    if op == "all_reduce":
        buf = torch.ones(count, dtype=torch.float32, device=device)
        return lambda: dist.all_reduce(buf, group=group)
    part = torch.ones(count // n, dtype=torch.float32, device=device)
    full = torch.empty(count, dtype=torch.float32, device=device)
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(full, part, group=group)
    return lambda: dist.reduce_scatter_tensor(part, full, group=group)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(op: str, size: int, n: int, device: torch.device, ctrl=None, warmup: int = 5, iters: int = 20):
    """One row: the slowest rank's mean time per op, algbw and busbw (GB/s); None if size does not split."""
    run = _one(op, size, n, device)
    if run is None:
        return None
    if size > 64 * 2**20:
        warmup, iters = min(warmup, 2), min(iters, 10)
    for _ in range(warmup):
        run()
    _sync(device)
    dist.barrier(group=ctrl)
    t0 = time.perf_counter()
    for _ in range(iters):
        run()
    _sync(device)
    t = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctrl)
    secs = float(t.item())
    algbw = size / secs / 1e9
    return {"bytes": size, "time_us": secs * 1e6, "algbw_gbps": algbw, "busbw_gbps": algbw * bus_factor(op, n)}


def run_check(device: torch.device, max_bytes: int, ctrl=None, ops=OPS, iters: int = 20) -> dict[str, list]:
    """Every op over every size, on every rank together. {op: [row, ...]}; an op the backend lacks
    (gloo has no reduce-scatter in some torch versions) gets one row {"error": ...} instead."""
    with warnings.catch_warnings():  # torch 2.13 renamed reduce_scatter_tensor; 2.11 (the GPU machine) has only it
        warnings.simplefilter("ignore", FutureWarning)
        return _run_check(device, max_bytes, ctrl, ops, iters)


def _run_check(device, max_bytes: int, ctrl, ops, iters: int) -> dict[str, list]:
    n = dist.get_world_size()
    out: dict[str, list] = {}
    for op in ops:
        rows: list[dict[str, Any]] = []
        try:
            for size in sizes(max_bytes):
                row = measure(op, size, n, device, ctrl, iters=iters)
                if row is not None:
                    rows.append(row)
        except (RuntimeError, NotImplementedError) as e:
            rows = [{"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}]
            dist.barrier(group=ctrl)
        out[op] = rows
    return out


def summary(op: str, rows: list[dict[str, Any]], peak: float | None) -> tuple[str, dict[str, Any]]:
    """The event's message and the figures it names (the largest size's busbw against the peak)."""
    ok = [r for r in rows if "error" not in r]
    if not ok:
        return f"{op}: not measured ({rows[0]['error'] if rows else 'no size fits'})", {}
    last = ok[-1]
    best = max(ok, key=lambda r: r["busbw_gbps"])
    pct = f" = {100 * last['busbw_gbps'] / peak:.0f}% of {peak:g} GB/s" if peak else ""
    return (f"{op}: busbw {last['busbw_gbps']:.3g} GB/s at {_size(last['bytes'])}{pct} (best {best['busbw_gbps']:.3g} "
            f"at {_size(best['bytes'])})"), {"busbw_at_max_gbps": last["busbw_gbps"], "max_bytes": last["bytes"],
                                             "best_busbw_gbps": best["busbw_gbps"],
                                             "fraction_of_peak": last["busbw_gbps"] / peak if peak else None}


def _size(b: int) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= k:
            return f"{b / k:g} {unit}"
    return f"{b} B"


def record_check(ctx, bus, max_bytes: int, peak_gbps: float | None = None, gpu: int | None = None) -> dict:
    """Run the check on every rank; rank 0 records one `collective` event per op (its rows in the detail)."""
    peak, basis = specified_peak(ctx.device)
    if peak_gbps:
        peak, basis = peak_gbps, "given with --peak-gbps"
    t0 = time.perf_counter()
    result = run_check(ctx.device, max_bytes, ctx.ctrl)
    if ctx.leader:
        for op, rows in result.items():
            msg, figures = summary(op, rows, peak)
            bus.emit("collective", msg, gpu=gpu, op=op, world_size=ctx.world, backend=ctx.backend, peak_gbps=peak,
                     peak_basis=basis, rows=rows, seconds=time.perf_counter() - t0, **figures)
    return result
