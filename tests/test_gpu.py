"""On a real NVIDIA GPU only (skipped in CI): NVML for real, and the workload's OOM recovery on CUDA.
The same paths produced docs/BENCHMARKS.md on the H200 (benchmarks/gpu.sh)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_nvml_reads_every_fast_field_on_a_real_gpu():
    from gpuwatch.telemetry import nvml
    from gpuwatch.telemetry.nvml import NvmlBackend

    b = NvmlBackend()
    row = b.read_fast(0)
    for col in ("gpu_util_pct", "gpu_mem_used_bytes", "gpu_mem_total_bytes", "gpu_temp_c", "gpu_power_w",
                "gpu_sm_clock_mhz", "gpu_clocks_event_reasons"):
        assert row.get(col) is not None, col
    # the PCIe counters are read every PCIE_EVERY slow reads (2): a rate from the second reading on
    for _ in range(nvml.PCIE_EVERY):
        b.read_slow(0)
    slow = b.read_slow(0)
    assert "gpu_pcie_tx_bytes_per_s" in slow
    b.close()


def test_a_real_cuda_oom_is_recovered_to_the_pre_step_allocation():
    import torch

    from gpuwatch.telemetry.bus import Bus
    from gpuwatch.workload.runner import Faults, Workload, WorkloadConfig

    bus = Bus()
    w = Workload(bus, WorkloadConfig(preset="small", mode="train", precision="bf16", batch=2, seq_len=256,
                                     device="cuda:0", gpu_index=0, integrity_every=0,
                                     faults=Faults(memory_limit_bytes=8 * 2**30)))
    w.build()
    w.run_step(2, 256, "steady")
    before = torch.cuda.memory_allocated()
    w.run_step(512, 2048, "inject")
    assert w.ooms == 1 and w.recovered == 1
    assert torch.cuda.memory_allocated() <= before
    w.run_step(2, 256, "steady")
    assert bus.steps.latest(1)[0]["batch"] == 2


def test_the_steps_row_says_what_of_the_cache_lies_in_split_blocks():
    """A segment kept by one live tensor, its other blocks freed: their bytes are inactive split blocks
    (schema v6 `torch_inactive_split_bytes`), within what is cached and not allocated."""
    import torch

    from gpuwatch.workload import mechanics as X

    dev = torch.device("cuda:0")
    torch.cuda.empty_cache()
    parts = [torch.empty(4 * 2**20, dtype=torch.uint8, device=dev) for _ in range(4)]  # one 20 MiB segment's blocks
    before = X.memory(dev)["torch_inactive_split_bytes"]  # the segment's free 4 MiB tail already counts
    keep = parts[1]
    del parts
    m = X.memory(dev)
    cached = m["torch_reserved_bytes"] - m["torch_allocated_bytes"]
    assert m["torch_inactive_split_bytes"] - before >= 12 * 2**20  # the three freed blocks
    assert m["torch_inactive_split_bytes"] <= cached
    del keep


def test_the_steps_row_says_the_largest_free_block_and_segment():
    """Schema v7: the same 20 MiB segment with its second block kept: the free blocks are 4 MiB before it and
    12 MiB after it (the tail merged with the two freed), so the largest free block is at least 12 MiB, the
    largest segment at least 20 MiB; a second read within BLOCKS_EVERY_S gives none. The snapshot's cost is
    printed (it bounds how often a step may read it)."""
    import time

    import torch

    from gpuwatch.workload import mechanics as X

    dev = torch.device("cuda:0")
    torch.cuda.empty_cache()
    parts = [torch.empty(4 * 2**20, dtype=torch.uint8, device=dev) for _ in range(4)]
    keep = parts[1]
    del parts
    X._NEXT_BLOCKS.clear()  # noqa: SLF001 - a read now, whatever ran before
    t0 = time.perf_counter()
    row = X.step_memory(dev)
    print(f"blocks read in {1e3 * (time.perf_counter() - t0):.2f} ms")
    assert row["torch_largest_free_bytes"] >= 12 * 2**20, row
    assert row["torch_largest_segment_bytes"] >= 20 * 2**20, row
    assert row["torch_largest_free_bytes"] <= row["torch_reserved_bytes"] - row["torch_allocated_bytes"]
    assert X.blocks(dev) == X.NO_BLOCKS  # read again within BLOCKS_EVERY_S: not read
    del keep
