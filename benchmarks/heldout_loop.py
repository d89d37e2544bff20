"""One held-out library-loop scenario (benchmarks/heldout_gen.py draws them): a user's PyTorch training loop
in `GuardedLoop(guard="off")` - recorded and scored, never acted on - under a memory cap, for SECONDS.

    python3 benchmarks/heldout_loop.py --kind KIND --batch B --seq-min S0 --seq-max S1 --target F --seed N
        --seconds T --out DIR [--keys K] [--stages K] [--slot-gib G] [--name NAME] [--dry-run]

The model is benchmarks/guard_library.py's random-weight Llama (AdamW, bf16 autocast; a 1-layer toy with
--dry-run on the CPU). Its step peak is calibrated as a line in the step's tokens under the slot cap (two
probe steps), and the cap set so that the largest shape's predicted peak is at F of it. Kinds:
- `curriculum`: sequence length in K stages from S0 to S1 (geometric, by time); F > 1: the last stages fail;
- `randlen`: each batch's length uniform in [S0, S1];
- `cache`: lengths from K keys (Zipf-weighted, so new ones come ever more rarely); each new key keeps a
  device tensor in a cache (a user's memoised features), sized so that all K fill 1.2-2 x the headroom;
- `graphpool`: the same keys, each new one captures a CUDA graph whose private memory pool stays (a user's
  per-shape graphs); needs CUDA.
An OOM that `GuardedLoop` cannot retry (at its micro-batch floor) stops the loop; the user restarts it: the
cache and pools cleared, a new session, the curriculum where it was. OUT/loop.json says what ran.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]

import torch  # noqa: E402

from support.library_scenarios import amp, build_model, calibrate, free, lm_loss, set_cap  # noqa: E402

FIRST_STAGE_ROOM = 1.3  # a curriculum's cap: at least this x its first stage's calibrated peak

GiB = 2**30


class Growth:
    """The memory a user's code keeps beside the step: a cache entry or a CUDA graph pool per new key."""

    def __init__(self, kind: str, entry_bytes: int, device: torch.device) -> None:
        self.kind, self.entry_bytes, self.device = kind, entry_bytes, device
        self.kept: dict[int, object] = {}

    def touch(self, key: int) -> None:
        if self.kind not in ("cache", "graphpool") or key in self.kept:
            if self.kind == "graphpool" and key in self.kept:
                self.kept[key][0].replay()
            return
        n = max(1, self.entry_bytes // 2)  # bf16 elements
        if self.kind == "cache" or self.device.type != "cuda":
            self.kept[key] = torch.empty(n, dtype=torch.bfloat16, device=self.device).fill_(key % 7)
            return
        x = torch.ones(n // 2, dtype=torch.bfloat16, device=self.device)  # the static input: half the entry
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            (x * 2 + 1).sin_()  # warm-up on a side stream, as capture wants
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, capture_error_mode="thread_local"):  # its own private pool: the output stays in it
            # (thread_local: the session's other threads may touch CUDA meanwhile)
            y = (x * 2 + 1).sin_()
        self.kept[key] = (g, x, y)

    def clear(self) -> None:
        self.kept.clear()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def lengths(a, t0: float, r: random.Random):
    """The next batch's sequence length (and its growth key)."""
    keys = sorted({int(a.seq_min + (a.seq_max - a.seq_min) * k / max(1, a.keys - 1)) for k in range(a.keys)})
    weights = [1 / (k + 1) for k in range(len(keys))]
    r.shuffle(keys)
    while True:
        if a.kind == "curriculum":
            stage = min(a.stages - 1, int((time.time() - t0) / a.seconds * a.stages))
            yield int(a.seq_min * (a.seq_max / a.seq_min) ** (stage / max(1, a.stages - 1))), None
        elif a.kind == "randlen":
            yield r.randint(a.seq_min, a.seq_max), None
        else:
            k = r.choices(range(len(keys)), weights=weights)[0]
            yield keys[k], k


def run_episode(a, model, opt, cfg, device, cap, growth, gen, t_end: float, k: int) -> dict:
    from gpuwatch.integrations import GuardedLoop

    pending: list = []

    def batches():
        while time.time() < t_end:
            s, key = next(gen)
            pending.append(key)
            yield torch.randint(0, cfg.vocab_size, (a.batch, s))

    def loss_fn(mb):
        key = current[0]
        if key is not None:
            growth.touch(key)
        with amp(device):
            return lm_loss(model)(mb)

    current = [None]
    g = GuardedLoop(model, opt, record_dir=a.out, name=f"{a.name}-e{k}", guard="off", memory_limit=cap,
                    precision="bf16", allow_bf16=False, label=f"heldout loop {a.kind}",
                    sampler="thread" if device.type != "cuda" else "process")
    with g:
        for i, ids in enumerate(g.wrap(batches())):
            current[0] = pending[i]
            g.step(ids.to(device), loss_fn)
    return {"episode": k, "steps": g.steps, "ooms": g.ooms, "stopped": g.stopped, "kept": len(growth.kept),
            "session": str(g.session_dir)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=("curriculum", "randlen", "cache", "graphpool"), required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--seq-min", type=int, required=True)
    ap.add_argument("--seq-max", type=int, required=True)
    ap.add_argument("--target", type=float, required=True, help="the largest shape's predicted peak / the cap")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keys", type=int, default=16)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--slot-gib", type=float, default=14, help="the calibration's cap, the most the cap may be")
    ap.add_argument("--name", default="heldout-loop")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    r = random.Random(a.seed)
    device = torch.device("cpu" if a.dry_run or not torch.cuda.is_available() else "cuda")
    slot = int(a.slot_gib * GiB)
    set_cap(device, slot)
    model, cfg = build_model(a.dry_run, device)
    cal = calibrate(model, device, cfg.vocab_size, a.dry_run)
    top = cal["fixed"] + cal["per_token"] * a.batch * a.seq_max
    cap = min(slot, int(top / a.target)) if device.type == "cuda" else None
    if cap and a.kind == "curriculum":  # the target is the last stage's: the first must fit, or no step ever runs
        first = cal["fixed"] + cal["per_token"] * a.batch * a.seq_min  # (blind set 2903: a 3.35 GB cap under a first
        cap = min(slot, max(cap, int(FIRST_STAGE_ROOM * first)))  # step that never ran, 24 OOMs nothing could see)
    fill = r.uniform(1.2, 2.0)
    entry = int(max(0, (cap or 0) - top) * fill / max(1, a.keys)) if cap else 2**20
    free(device)  # the calibration's cached blocks (reserved under the slot) must not count against the lower cap
    set_cap(device, cap)
    growth = Growth(a.kind, entry, device)
    info = {"kind": a.kind, "cap_bytes": cap, "fixed_bytes": cal["fixed"], "per_token_bytes": cal["per_token"],
            "top_peak_bytes": top, "entry_bytes": entry, "fill": round(fill, 3), "episodes": []}
    t0 = time.time()
    gen = lengths(a, t0, r)
    k = 0
    while time.time() < t0 + a.seconds - 5 and k < 8:  # restarts: at most 8 sessions
        k += 1
        info["episodes"].append(run_episode(a, model, cal["opt"], cfg, device, cap, growth, gen, t0 + a.seconds, k))
        growth.clear()  # the user restarts: the cache and the pools go
        (a.out / "loop.json").write_text(json.dumps(info, indent=1))
    (a.out / "loop.json").write_text(json.dumps(info, indent=1))
    print(json.dumps({k: v for k, v in info.items() if k != "episodes"}), len(info["episodes"]), "episodes",
          sum(e["ooms"] for e in info["episodes"]), "OOMs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
