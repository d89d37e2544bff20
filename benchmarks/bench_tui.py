"""The TUI's own cost, in a real pseudo-terminal (issue 4's benchmarks).

  python benchmarks/bench_tui.py cost   [--seconds 30]   CPU %% of one core: `gpuwatch watch` at 160x50 and
                                                         80x24 vs `gpuwatch record` (same sampler+recorder,
                                                         no UI), run side by side; UI cost = the difference
  python benchmarks/bench_tui.py tokens [--seconds 40]   workload tokens/s with the dashboard open
                                                         (`gpuwatch live`) vs headless (`gpuwatch stress`),
                                                         ABBA-paired runs, same preset/batch
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import pty
import select
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class PtyProc:
    """A command in a pseudo-terminal of a given size; its screen output is read and dropped."""

    def __init__(self, argv: list[str], cols: int, rows: int) -> None:
        pid, fd = pty.fork()
        if pid == 0:
            os.environ.update(TERM="xterm-256color", COLUMNS=str(cols), LINES=str(rows))
            os.chdir(ROOT)
            os.execvp(argv[0], argv)
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        self.pid, self.fd = pid, fd

    def drain(self) -> bool:
        r, _, _ = select.select([self.fd], [], [], 0.05)
        if r:
            try:
                return bool(os.read(self.fd, 65536))
            except OSError:
                return False
        return True

    def wait(self) -> int:
        while self.drain():
            pass
        return os.waitpid(self.pid, 0)[1]


def tree_cpu(p: psutil.Process) -> float:
    total = 0.0
    for q in [p, *p.children(recursive=True)]:
        try:
            t = q.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def cost(seconds: float, warmup: float = 8.0, source: str | None = None) -> dict:
    d = seconds + warmup + 2
    out = tempfile.mkdtemp()
    gw = [sys.executable, "-m", "gpuwatch"]
    src = ["--source", source] if source else []  # no GPU here: a recording played as live
    procs = {
        "record (no UI)": subprocess.Popen([*gw, "record", *src, "--duration", f"{d}s", "-o", out], cwd=ROOT,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid,
        "watch 160x50": PtyProc([*gw, "watch", *src, "--duration", f"{d}s"], 160, 50),
        "watch 80x24": PtyProc([*gw, "watch", *src, "--duration", f"{d}s"], 80, 24),
    }
    ptys = [p for p in procs.values() if isinstance(p, PtyProc)]
    ps = {k: psutil.Process(v.pid if isinstance(v, PtyProc) else v) for k, v in procs.items()}
    t_end = time.monotonic() + warmup
    while time.monotonic() < t_end:
        for p in ptys:
            p.drain()
    c0 = {k: tree_cpu(p) for k, p in ps.items()}
    t0 = time.monotonic()
    while time.monotonic() < t0 + seconds:
        for p in ptys:
            p.drain()
    dt = time.monotonic() - t0
    cpu = {k: round(100 * (tree_cpu(p) - c0[k]) / dt, 2) for k, p in ps.items()}
    for p in ptys:
        p.wait()
    base = cpu["record (no UI)"]
    return {"measure": "cpu_pct_of_one_core", "seconds": round(dt, 1), "cpu_pct": cpu,
            "ui_only_pct": {k: round(v - base, 2) for k, v in cpu.items() if k != "record (no UI)"}}


def _median_tps(out: Path, skip_s: float = 10.0) -> float | None:
    from gpuwatch.recording.reader import open_recording

    sessions = sorted(p for p in out.iterdir() if p.is_dir())
    rec = open_recording(sessions[-1])
    if rec.steps.is_empty():
        return None
    t0 = rec.steps["ts"].min()
    steady = rec.steps.filter(rec.steps["ts"] > t0 + __import__("datetime").timedelta(seconds=skip_s))
    return float(statistics.median(steady["tokens_per_s"].to_list()))


def tokens(seconds: float, preset: str, batch: int, pairs: int) -> dict:
    gw = [sys.executable, "-m", "gpuwatch"]
    flags = ["--preset", preset, "--mode", "prefill", "--batch", str(batch), "--seq-len", "512",
             "--duration", f"{seconds}s", "--integrity-every", "1000000"]
    res: dict[str, list] = {"headless": [], "tui": []}
    for kind in (["headless", "tui", "tui", "headless"] * ((pairs + 1) // 2))[:2 * pairs]:
        out = Path(tempfile.mkdtemp())
        if kind == "tui":
            PtyProc([*gw, "live", *flags, "-o", str(out)], 160, 50).wait()
        else:
            subprocess.run([*gw, "stress", *flags, "-o", str(out)], cwd=ROOT, capture_output=True)
        res[kind].append(_median_tps(out))
    ratio = [t / h for t, h in zip(res["tui"], res["headless"]) if t and h]
    return {"measure": "tokens_per_s", "preset": preset, "batch": batch, "seconds": seconds, "runs": res,
            "tui_over_headless_each": ratio, "tui_over_headless_median": statistics.median(ratio) if ratio else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["cost", "tokens"])
    ap.add_argument("--seconds", type=float)
    ap.add_argument("--preset", default="v2-lite")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--source", help="cost: replay this session as live in both (machines without a GPU)")
    a = ap.parse_args()
    res = cost(a.seconds or 30, source=a.source) if a.what == "cost" else tokens(a.seconds or 40, a.preset, a.batch, a.pairs)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
