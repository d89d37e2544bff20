"""What `GuardedLoop` costs a training step (CPU; the GPU figure comes from benchmarks/guard_library.py).

    python3 benchmarks/bench_library.py [--steps 400] [--rounds 3] [--out FILE.json]

Three arms over the same batches, interleaved round by round: a plain loop (forward, backward and
optimizer step of a small LM, variable sequence lengths), `GuardedLoop` on a machine without a GPU (the
session records samples and steps; the guard says once it cannot act), and `GuardedLoop` with a real
H200 recording replayed as the live telemetry of GPU 0, so the risk model scores at 5 Hz on its own
thread and the guard decides before every step (re-scoring the plan whenever it grew). Reported: the
time gpuwatch spends inside `step()` beyond the user's work (p50/p99, `GuardedLoop.step_overhead_s`),
and the wall time per step against the plain loop.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from gpuwatch.integrations import GuardedLoop  # noqa: E402


def make(seed=0, vocab=512, dim=128):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Embedding(vocab, dim), torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(),
                            torch.nn.Linear(4 * dim, dim), torch.nn.Linear(dim, vocab))
    return m, torch.optim.SGD(m.parameters(), lr=0.01), vocab


def loss_of(model, vocab):
    def f(ids):
        logits = model(ids[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))
    return f


def plain(batches):
    model, opt, vocab = make()
    f = loss_of(model, vocab)
    t0 = time.perf_counter()
    for ids in batches:
        loss = f(ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss.detach())  # the guarded loop reads the loss too
    return (time.perf_counter() - t0) / len(batches), []


def guarded(batches, tmp: Path, replay: str | None):
    model, opt, vocab = make()
    f = loss_of(model, vocab)
    kw = {"source": replay, "gpu_index": 0} if replay else {}
    with GuardedLoop(model, opt, record_dir=tmp, **kw) as g:
        time.sleep(1.0)  # the sampler's first ticks and the scorer's first round
        t0 = time.perf_counter()
        for ids in batches:
            g.step(ids, f)
        dt = (time.perf_counter() - t0) / len(batches)
        over = list(g.step_overhead_s)
    return dt, over


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--replay", default=str(ROOT / "recordings/sample-h200-ramp-train"))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 512, (8, int(torch.randint(32, 129, (1,), generator=gen))), generator=gen)
               for _ in range(a.steps)]
    import tempfile

    res: dict[str, dict[str, list]] = {k: {"step_s": [], "overhead_s": []} for k in ("plain", "no_gpu", "replayed_h200")}
    with tempfile.TemporaryDirectory() as td:
        for r in range(a.rounds):
            for name in res:
                if name == "plain":
                    dt, over = plain(batches)
                else:
                    dt, over = guarded(batches, Path(td) / f"{name}-{r}", a.replay if name == "replayed_h200" else None)
                res[name]["step_s"].append(dt)
                res[name]["overhead_s"] += over
    base = statistics.median(res["plain"]["step_s"])
    out = {"steps": a.steps, "rounds": a.rounds, "plain_step_ms": round(base * 1e3, 3)}
    for name in ("no_gpu", "replayed_h200"):
        o = sorted(res[name]["overhead_s"])
        step = statistics.median(res[name]["step_s"])
        out[name] = {"step_ms": round(step * 1e3, 3), "wall_delta_ms_per_step": round((step - base) * 1e3, 3),
                     "overhead_ms_p50": round(o[len(o) // 2] * 1e3, 3), "overhead_ms_p99": round(o[int(len(o) * 0.99)] * 1e3, 3),
                     "overhead_ms_mean": round(statistics.mean(o) * 1e3, 3)}
    print(json.dumps(out, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
