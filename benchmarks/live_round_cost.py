"""The live scorer's CPU per round, on a CPU: a `GuardedLoop` over a small model with a recorded H200
session replayed as the live GPU 0 (so the risk model scores at 5 Hz on its own thread, as in a user's
loop), for `--seconds`; prints the rounds' CPU p50 and mean (`LiveScorer.cost_us`). Run it on two trees
(`PYTHONPATH=TREE python3 benchmarks/live_round_cost.py`) to compare them; the figure is the dev
machine's, not the H200 host's (that one is `bash benchmarks/gpu.sh risk`).

    python3 benchmarks/live_round_cost.py [--seconds 25] [--session recordings/h200-nearcap-2026-12-01/nc-v2lite-prefill-b48]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=25.0)
    ap.add_argument("--session", default=str(ROOT / "recordings" / "h200-nearcap-2026-12-01" / "nc-v2lite-prefill-b48"))
    a = ap.parse_args()
    import torch

    import gpuwatch
    from gpuwatch.integrations import GuardedLoop

    torch.manual_seed(0)
    vocab = 256
    model = torch.nn.Sequential(torch.nn.Embedding(vocab, 64), torch.nn.Linear(64, vocab))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss(ids):
        return torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())

    batches = [torch.randint(0, vocab, (8, 64)) for _ in range(5000)]
    with tempfile.TemporaryDirectory() as d:
        with GuardedLoop(model, opt, record_dir=d, source=a.session, gpu_index=0, sampler="thread") as g:
            t0 = time.time()
            for b in g.wrap(batches):
                g.step(b, loss)
                time.sleep(0.01)
                if time.time() - t0 > a.seconds:
                    break
            cost = list(g.session.scorer.cost_us)
    print(json.dumps({"tree": str(Path(gpuwatch.__file__).resolve().parents[1]), "rounds": len(cost),
                      "round_cpu_us_p50": statistics.median(cost) if cost else None,
                      "round_cpu_us_mean": round(statistics.mean(cost)) if cost else None}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
