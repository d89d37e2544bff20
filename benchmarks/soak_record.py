"""Soak test of headless recording: does `gpuwatch record` leak memory or file descriptors, or lose ticks?

Runs `python -m gpuwatch record -o DIR --duration D [--source SESSION]` as a subprocess, samples the RSS
and the number of open files of its whole process tree (the recorder process and the sampler child)
every `--every` seconds with psutil, and at the end prints the least-squares slope of each per hour,
the ticks recorded against the ticks expected (read back from the session: first to last tick, none
missing, none twice), and writes everything to a JSON file.

    .venv/bin/python benchmarks/soak_record.py                       # 1 h, NVML (or no GPU)
    .venv/bin/python benchmarks/soak_record.py --duration 3m --source recordings/sample-h200-ramp-train
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpuwatch.recording.reader import open_recording  # noqa: E402
from gpuwatch.units import parse_duration  # noqa: E402


def tree(pid: int) -> list[psutil.Process]:
    try:
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def measure(pid: int) -> dict:
    rss = files = fds = 0
    procs = tree(pid)
    for p in procs:
        try:
            with p.oneshot():
                rss += p.memory_info().rss
                files += len(p.open_files())
                fds += p.num_fds() if hasattr(p, "num_fds") else 0
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return {"rss_bytes": rss, "open_files": files, "fds": fds, "procs": len(procs)}


def slope_per_hour(ts: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys over ts (seconds), per hour."""
    n = len(ts)
    if n < 2:
        return None
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    if var == 0:
        return None
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var * 3600


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", default="1h", help="how long to record (default 1h)")
    ap.add_argument("--every", type=float, default=10.0, help="seconds between measurements (default 10)")
    ap.add_argument("--interval", default="100ms", help="sampling interval passed to gpuwatch record")
    ap.add_argument("--source", default=None, help="replay a session as the GPU (no GPU needed)")
    ap.add_argument("-o", "--output", default=None, help="session folder root (default: a temp folder)")
    ap.add_argument("--json", default="soak_record.json", help="where to write the results")
    ap.add_argument("--skip-first", type=float, default=30.0,
                    help="seconds of warm-up left out of the slopes (imports, first allocations)")
    return ap.parse_args()


def _watch(proc: subprocess.Popen, t0: float, every: float) -> tuple[list[dict], str, str]:
    """Measure the recorder's process tree every `every` s until it exits: the measurements, its output."""
    samples = []
    try:
        while proc.poll() is None:
            m = measure(proc.pid)
            if m["procs"]:
                m["t_s"] = round(time.monotonic() - t0, 2)
                samples.append(m)
                print(f"t={m['t_s']:7.1f}s rss={m['rss_bytes'] / 2**20:8.1f} MiB open_files={m['open_files']:3d} "
                      f"fds={m['fds']:3d} procs={m['procs']}", file=sys.stderr)
            deadline = time.monotonic() + every
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
        stdout, stderr = proc.communicate(timeout=60)
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    return samples, stdout, stderr


def _ticks(session: Path, duration: float, interval: float) -> dict:
    """What the recorded session holds: ticks recorded, expected, missing, duplicated; its state."""
    rec = open_recording(session)
    ticks = sorted(set(rec.samples["tick"].to_list()))
    n_rows_per_tick = max(1, len(rec.gpus))
    first, last = (ticks[0], ticks[-1]) if ticks else (0, -1)
    span_s = ((rec.samples["ts"].max() - rec.samples["ts"].min()).total_seconds() if ticks else 0.0)
    return {
        "recorded": len(ticks),
        "expected_by_duration": round(duration / interval),
        "expected_first_to_last": last - first + 1,
        "missing_between_first_and_last": (last - first + 1) - len(ticks),
        "duplicated_rows": rec.samples.height - len(ticks) * n_rows_per_tick,
        "span_s": round(span_s, 2),
        "complete": rec.complete,
        "incomplete_reason": rec.incomplete_reason,
        "warnings": rec.warnings[:5],
        "recorder_errors": [m for k, m in zip(rec.events["kind"], rec.events["message"]) if "error" in k],
    }


def _slopes(result: dict, samples: list[dict], skip_first: float, duration: float) -> list[dict]:
    """The slopes use the steady part: after the warm-up, before the shutdown (the last measurement may
    catch the process tree exiting), and only while the whole tree (recorder + sampler child) is up."""
    full = max((s["procs"] for s in samples), default=0)
    steady = [s for s in samples if skip_first <= s["t_s"] <= duration - 1 and s["procs"] == full] or samples
    ts = [s["t_s"] for s in steady]
    result["slopes_per_hour"] = {
        "rss_bytes": slope_per_hour(ts, [s["rss_bytes"] for s in steady]),
        "open_files": slope_per_hour(ts, [s["open_files"] for s in steady]),
        "fds": slope_per_hour(ts, [s["fds"] for s in steady]),
    }
    result["rss_mib"] = {"first": round(steady[0]["rss_bytes"] / 2**20, 1) if steady else None,
                         "last": round(steady[-1]["rss_bytes"] / 2**20, 1) if steady else None,
                         "max": round(max(s["rss_bytes"] for s in samples) / 2**20, 1) if samples else None}
    return steady


def _report(result: dict, args, wall: float, samples: list[dict], steady: list[dict]) -> None:
    sl = result["slopes_per_hour"]
    print(f"\nsoak: {wall:.0f} s, exit {result['exit_code']}, {len(samples)} measurements ({len(steady)} after "
          f"{args.skip_first:g} s warm-up)")
    if sl["rss_bytes"] is not None:
        print(f"RSS slope: {sl['rss_bytes'] / 2**20:+.2f} MiB/h  (first {result['rss_mib']['first']} MiB, "
              f"last {result['rss_mib']['last']} MiB, max {result['rss_mib']['max']} MiB)")
        print(f"open files slope: {sl['open_files']:+.2f} /h   fds slope: {sl['fds']:+.2f} /h")
    if result.get("ticks"):
        t = result["ticks"]
        print(f"ticks: {t['recorded']} recorded, {t['expected_first_to_last']} expected first to last "
              f"({t['missing_between_first_and_last']} missing, {t['duplicated_rows']} duplicated rows), "
              f"{t['expected_by_duration']} expected by duration; complete={t['complete']}")
    else:
        print("no session was recorded")
    print(f"results: {args.json}")


def main() -> int:
    args = _args()
    duration = parse_duration(args.duration)
    interval = parse_duration(args.interval)
    out = Path(args.output or tempfile.mkdtemp(prefix="gpuwatch-soak-"))
    cmd = [sys.executable, "-m", "gpuwatch", "record", "-o", str(out), "--duration", f"{duration:g}s",
           "--interval", args.interval]
    if args.source:
        cmd += ["--source", args.source]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    print("running:", " ".join(cmd), file=sys.stderr)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    samples, stdout, stderr = _watch(proc, t0, args.every)
    wall = time.monotonic() - t0

    sessions = sorted(p for p in out.iterdir() if p.is_dir())
    result: dict = {"cmd": cmd, "duration_s": duration, "wall_s": round(wall, 1), "exit_code": proc.returncode,
                    "stdout_tail": stdout.strip().splitlines()[-3:], "stderr_tail": stderr.strip().splitlines()[-5:],
                    "host": platform.node(), "python": platform.python_version(), "session": None}
    if sessions:
        result["session"] = str(sessions[-1])
        result["ticks"] = _ticks(sessions[-1], duration, interval)
    steady = _slopes(result, samples, args.skip_first, duration)
    result["measurements"] = samples
    Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
    _report(result, args, wall, samples, steady)
    ok = proc.returncode == 0 and result.get("ticks") and result["ticks"]["missing_between_first_and_last"] == 0 \
        and result["ticks"]["duplicated_rows"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
