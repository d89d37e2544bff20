"""How long `gpuwatch train` takes, on how many cores and in how much memory, for the shipped sessions and for
copies of them replicated N times (each copy a session folder of its own name: a fleet of that many runs).

    python3 benchmarks/bench_train.py --copies 1,10,40 [--jobs 2] [--stride 5] [--no-eval] [--] [more train flags]

Each run is `gpuwatch train` in a process of its own (the model into a temporary folder); its process tree
(the workers too) is polled every 0.2 s for the resident memory of all of it together. Prints one JSON object
per run: copies, sessions, windows (from the card's manifest), wall_s, cpu_s (the tree's user + system time),
cores_used (cpu_s / wall_s), peak_rss_mib (the tree's, summed), peak_main_rss_mib, peak_pss_mib and
peak_uss_mib, poll_cpu_s, the model's sha256.

Summed RSS counts every page shared between the processes (the libraries' code, the interpreter) once per
process, so it overstates what the tree takes. PSS (proportional set size: each shared page divided among the
processes that map it) sums to the tree's real footprint; USS (the pages only that process maps) is what
ending it would free. Both come from psutil's memory_full_info (Linux: /proc/PID/smaps_rollup, ~0.7 ms CPU a
process for a 60 MiB one, more for a larger one), polled every 0.5 s or less often - never more than ~5 % of
this process's time in the polls; their peaks are the largest sums seen at one poll, so a peak between polls
can be missed (as for RSS). Where the system gives no PSS (macOS; no /proc) or USS, the field is null.
poll_cpu_s is this process's own CPU during the run (the polling; not in cpu_s, which is the tree's).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def replicate(sessions: list[Path], copies: int, dest: Path) -> Path:
    """`copies` of every session under dest/, named <session>-c<k> (files hard-linked where the file system
    allows, else copied): the shipped set is copy 0."""
    for k in range(copies):
        for s in sessions:
            d = dest / f"c{k:03d}" / f"{s.name}-c{k}"
            d.mkdir(parents=True)
            for f in s.iterdir():
                if f.is_file():
                    try:
                        os.link(f, d / f.name)
                    except OSError:
                        shutil.copy2(f, d / f.name)
    return dest


def run(argv: list[str], poll_s: float = 0.2, full_poll_s: float = 0.5) -> dict:
    import resource

    import psutil

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    self_before = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    # the output to a file, not a pipe: nothing reads a pipe until the run ends, and `train` prints a line per
    # session - past the pipe's 64 KiB (~700 sessions) the child blocked on its write (session 38's 1,000-session
    # run on the H200 host "did not finish" in 170 s)
    log = tempfile.TemporaryFile("w+")
    p = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
    main = psutil.Process(p.pid)
    peak = peak_main = 0
    peak_full = {"pss": 0, "uss": 0}
    have = {"pss": True, "uss": True}  # False once the system has shown it gives none
    next_full = t0
    while p.poll() is None:
        try:
            procs = [main] + main.children(recursive=True)
            rss = 0
            for q in procs:
                try:
                    rss += q.memory_info().rss
                except psutil.Error:
                    pass
            peak = max(peak, rss)
            peak_main = max(peak_main, main.memory_info().rss)
            now = time.perf_counter()
            if (have["pss"] or have["uss"]) and now >= next_full:
                sums = _full(procs, have)
                for k, v in sums.items():
                    peak_full[k] = max(peak_full[k], v)
                # the next one no sooner than full_poll_s, nor than 20x this one's cost (<= ~5 % of the time)
                next_full = now + max(full_poll_s, 20 * (time.perf_counter() - now))
        except psutil.Error:
            pass
        time.sleep(poll_s)
    log.seek(0)
    out = log.read()
    log.close()
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the tree's: every process waited for rolls up
    self_after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    poll_cpu = (self_after.ru_utime - self_before.ru_utime) + (self_after.ru_stime - self_before.ru_stime)
    if p.returncode:
        raise SystemExit(f"train failed ({p.returncode}):\n{out[-3000:]}")
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "cores_used": round(cpu / wall, 2), "peak_rss_mib": round(peak / 2**20),
            "peak_main_rss_mib": round(peak_main / 2**20),
            **{f"peak_{k}_mib": round(peak_full[k] / 2**20) if have[k] and peak_full[k] else None for k in ("pss", "uss")},
            "poll_cpu_s": round(poll_cpu, 2), "tail": out.strip().splitlines()[-1][:200]}


def _full(procs: list, have: dict[str, bool]) -> dict[str, int]:
    """The PSS and USS of `procs` summed (bytes), of those `have` still marks available; a kind the system does
    not give (psutil: no such field, not implemented, or not allowed for the run's own processes) is marked
    unavailable in `have` and left out from then on. A process that ended meanwhile counts 0."""
    import psutil

    sums = {k: 0 for k, ok in have.items() if ok}
    for q in procs:
        try:
            fi = q.memory_full_info()
        except (NotImplementedError, AttributeError, psutil.AccessDenied):
            have.update(pss=False, uss=False)
            return {}
        except psutil.Error:  # ended between the listing and now
            continue
        for k in list(sums):
            v = getattr(fi, k, None)
            if v is None:
                have[k] = False
                del sums[k]
            else:
                sums[k] += v
    return sums


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--copies", default="1,10,40")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--stride", type=int, default=5)
    ap.add_argument("--no-eval", action="store_true")
    ap.add_argument("extra", nargs="*", help="more `gpuwatch train` flags (after --)")
    a = ap.parse_args()
    from gpuwatch.predict.dataset import default_sessions

    shipped = default_sessions(ROOT)
    for copies in [int(x) for x in a.copies.split(",")]:
        with tempfile.TemporaryDirectory(prefix="gpuwatch-bench-train-") as d:
            fleet = [str(p) for p in shipped] if copies == 1 else [str(replicate(shipped, copies, Path(d) / "fleet"))]
            model = Path(d) / "out" / "risk.joblib"
            argv = [sys.executable, "-m", "gpuwatch", "train", *fleet, "--stride", str(a.stride), "--jobs",
                    str(a.jobs), "-o", str(model), *(["--no-eval"] if a.no_eval else []), *a.extra]
            r = run(argv)
            man = json.loads(model.with_suffix(".manifest.json").read_text())
            data = man["data"]
            print(json.dumps({"copies": copies, "sessions": data["sessions"], "windows": data["windows"],
                              "derived_windows": data["derived_windows"], "jobs": a.jobs, "stride": a.stride,
                              "eval": not a.no_eval, "cpus": os.cpu_count(), **r,
                              "sha256": hashlib.sha256(model.read_bytes()).hexdigest()[:16]}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
