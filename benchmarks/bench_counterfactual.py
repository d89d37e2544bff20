"""The counterfactual-cap copies of shipped sessions, written as session folders and read back (`derive`) against
held in memory (`derive_sources`), each cut into windows as training cuts them (stride 5, with the sample's
weights): CPU and wall seconds of one process, ROUNDS rounds interleaved.

    python3 benchmarks/bench_counterfactual.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpuwatch.predict import counterfactual as CF  # noqa: E402
from gpuwatch.predict.dataset import session_timelines  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    rec = ROOT / "recordings"
    paths = [p for p in sorted(rec.glob("sample-h200-*"))[:6] + sorted((rec / "h200-nearcap-2026-12-01").glob("nc-*"))[:6]
             if p.is_dir()]
    tmp = Path(tempfile.mkdtemp(prefix="gw-cf-"))

    def written() -> None:
        for p in paths:
            for r in CF.derive(p, tmp / p.name, "x"):
                session_timelines(r.path, stride=5, sample=True)
            shutil.rmtree(tmp / p.name, ignore_errors=True)

    def held() -> None:
        for p in paths:
            for _r, src in CF.derive_sources(p, "x"):
                session_timelines(src, stride=5, sample=True)
    try:
        for rnd in range(a.rounds):
            for name, fn in (("written", written), ("held", held)):
                c0, w0 = time.process_time(), time.perf_counter()
                fn()
                print(f"round {rnd} {name}: {time.process_time() - c0:.2f} CPU-s, {time.perf_counter() - w0:.2f} s "
                      f"({len(paths)} sessions)", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
