"""Does the decode engine's memory stay flat while the batch moves? (defect 8)

The workload's CUDA-graph decode (`--graphs auto`) re-captures its graphs and rebuilds its static KV cache
whenever the batch changes. A small-preset decode ramp under 4 GiB went from 1.10 to 2.03 GiB allocated at
the same batch in 90 s after 24 captures. This script runs the small preset's decode on one GPU, visiting
batches 32, 64, 128, 64 (then 32 again, ...) for about a minute, two steps a visit (the engine falls
back to eager when the shape changes every step); at every visit of the first batch it prints
torch.cuda.memory_allocated / memory_reserved. Exit 0 when allocated at that batch grew by at most
--tolerance (5 %) from its first visit to its last, 1 when it grew more, 2 when it could not measure
(no CUDA GPU, or the engine is not running CUDA graphs).

  python benchmarks/gpu_decode_graphs.py                       # ~60 s on an H200
  python benchmarks/gpu_decode_graphs.py --limit-gib 4         # under a 4 GiB cap (OOMs recovered as the runner does)
  python benchmarks/gpu_decode_graphs.py --workload --limit-gib 4 --seconds 90   # the stress workload's own
                                                                # decode ramp (runner + schedule), allocated per batch
  python benchmarks/gpu_decode_graphs.py --trace               # + where the memory still live was allocated

Measured on the H200 (torch 2.11, transformers 5.17), 60 s: before the fix allocated at batch 32 went
0.98 -> 1.95 GiB (+99 %; 32 MiB a capture, cuBLAS's workspace of each new warm-up stream, until torch's
pool of 32 streams wrapped); the workload's ramp under 4 GiB 0.96 -> 1.93 GiB at batch 2. After: 0.949
GiB at the first visit, 0.981-0.982 at every later one (+3.4 %: the default stream's cuBLAS workspace,
made once by the first prefill too large to capture), the ramp 0.925 -> 0.957 GiB.

Needs torch (CUDA) and transformers only; gpuwatch is imported from this checkout.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

GiB = 2**30


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batches", default="32,64,128,64", help="one cycle of batches (the first is watched)")
    ap.add_argument("--seconds", type=float, default=60.0, help="run for about this long (whole cycles)")
    ap.add_argument("--prompt", type=int, default=128, help="prompt length")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--steps-per-visit", type=int, default=2)
    ap.add_argument("--keep", type=int, default=1, help="builds the engine holds (1: the batch running only)")
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--limit-gib", type=float, default=None, help="cap this process's GPU memory (OOMs recovered)")
    ap.add_argument("--workload", action="store_true", help="run the stress workload's decode ramp instead")
    ap.add_argument("--trace", action="store_true", help="record allocations; print the live ones by call site")
    return ap.parse_args(argv)


def _mem(dev):
    torch.cuda.synchronize(dev)
    gc.collect()
    return torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)


def _sites(top: int = 12) -> list[tuple[int, str]]:
    """Live (allocated) blocks by the innermost gpuwatch/transformers frame that allocated them."""
    snap = torch.cuda.memory._snapshot()
    by: dict[str, int] = defaultdict(int)
    for seg in snap.get("segments", []):
        for b in seg.get("blocks", []):
            if b.get("state") != "active_allocated":
                continue
            frames = b.get("frames") or ((b.get("history") or [{}])[-1].get("frames") or [])
            site = next((f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in frames
                         if "gpuwatch" in f["filename"] or "transformers" in f["filename"]), "?")
            by[site] += int(b.get("size", 0))
    return sorted(((v, k) for k, v in by.items()), reverse=True)[:top]


def _print_sites(label, sites):
    print(f"  live memory by call site ({label}):")
    for v, k in sites:
        print(f"    {v / 2**20:9.1f} MiB  {k}")


def _engine_loop(a, dev) -> list[tuple[int, int]]:
    from gpuwatch.workload import model as M
    from gpuwatch.workload.presets import config_fields

    fields = config_fields(a.preset)
    model, secs = M.build_model(fields, dev, "bf16")
    print(f"{a.preset}: built in {secs:.1f} s; {torch.cuda.memory_allocated(dev) / GiB:.3f} GiB of weights")
    batches = [int(x) for x in a.batches.split(",")]
    said = []
    eng = M.DecodeEngine(model, batches[0], a.prompt, a.new_tokens, dev, keep=a.keep,
                         on_event=lambda kind, msg, **d: said.append(msg) if d.get("fallback") else None)
    gen = torch.Generator(device=dev).manual_seed(0)
    visits: list[tuple[int, int]] = []
    ooms = 0
    end = time.monotonic() + a.seconds
    while time.monotonic() < end or len(visits) < 2:
        for b in batches:
            ids = M.random_ids(fields["vocab_size"], b, a.prompt, dev, gen)
            for _ in range(a.steps_per_visit):
                try:
                    eng.step(ids)
                    failed = None
                except Exception as e:  # noqa: BLE001 - an OOM under --limit-gib: recover as the runner does
                    if not M.is_oom(e):
                        raise
                    failed = str(e).splitlines()[0][:120]
                if failed:  # outside the handler (its traceback pins the step's tensors)
                    ooms += 1
                    eng.release()
                    gc.collect()
                    torch.cuda.empty_cache()
            del ids
            if b == batches[0]:
                al, re = _mem(dev)
                visits.append((al, re))
                print(f"visit {len(visits):3d}: batch {b:4d}  allocated {al / GiB:.3f} GiB  reserved {re / GiB:.3f} GiB  "
                      f"captures {eng.captures}  held {eng.held_builds}  mode {eng.mode}  ooms {ooms}", flush=True)
                if a.trace and len(visits) == 1:
                    _print_sites("first visit", _sites())
    for m in said:
        print(f"  engine: {m}")
    if eng.mode != "graphs" and not a.limit_gib:
        print(f"the engine runs {eng.mode}, not CUDA graphs: nothing measured")
        sys.exit(2)
    return visits


def _workload_ramp(a, dev) -> list[tuple[int, int]]:
    """The stress workload itself: decode, ramp schedule, under --limit-gib; allocated after each step,
    grouped by batch. Returns the visits of the batch seen most often."""
    from gpuwatch.telemetry.bus import Bus
    from gpuwatch.workload.runner import Faults, Workload, WorkloadConfig

    bus = Bus()
    lim = int(a.limit_gib * GiB) if a.limit_gib else None
    w = Workload(bus, WorkloadConfig(preset=a.preset, mode="decode", schedule="ramp", precision="bf16",
                                     device=str(dev), decode_tokens=a.new_tokens, seq_len=a.prompt, integrity_every=0,
                                     faults=Faults(memory_limit_bytes=lim)))
    w.start()
    time.sleep(a.seconds)
    w.stop()
    rows = bus.steps.latest(100000)
    by: dict[int, list[int]] = defaultdict(list)
    last = None
    for r in rows:
        if r["batch"] != last:  # one visit = the first step after the batch changed... keep the visit's last step
            by[r["batch"]].append(r["torch_allocated_bytes"])
        else:
            by[r["batch"]][-1] = r["torch_allocated_bytes"]
        last = r["batch"]
    caps = [e for e in bus.events.latest(10000) if e.kind == "compile"]
    ooms = [e for e in bus.events.latest(10000) if e.kind == "oom"]
    print(f"{len(rows)} steps, {len(caps)} compile events, {len(ooms)} OOMs")
    for b in sorted(by):
        print(f"  batch {b:4d}: {len(by[b]):3d} visits, allocated " + " ".join(f"{x / GiB:.2f}" for x in by[b][:12])
              + (" ..." if len(by[b]) > 12 else "") + (f" {by[b][-1] / GiB:.2f} GiB" if len(by[b]) > 12 else " GiB"))
    watched = max(by, key=lambda b: len(by[b])) if by else None
    if watched is None or len(by[watched]) < 2:
        print("no batch was visited twice: nothing measured")
        sys.exit(2)
    print(f"watching batch {watched}")
    return [(x, 0) for x in by[watched]]


def main(argv=None) -> int:
    a = _args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 2
    dev = torch.device("cuda:0")
    if a.trace:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    if a.limit_gib and not a.workload:
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, a.limit_gib * GiB / total), dev)
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
    visits = _workload_ramp(a, dev) if a.workload else _engine_loop(a, dev)
    if a.trace:
        _print_sites("at the end", _sites())
    first, last = visits[0][0], visits[-1][0]
    peak = max(v[0] for v in visits)
    growth = (last - first) / first
    print(f"allocated at the watched batch: first {first / GiB:.3f} GiB, last {last / GiB:.3f} GiB, max {peak / GiB:.3f} "
          f"GiB over {len(visits)} visits: {growth * 100:+.1f} % (tolerance {a.tolerance * 100:.0f} %)")
    if growth > a.tolerance:
        print("FAIL: memory grows at the same batch")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
