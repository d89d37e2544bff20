"""Record healthy running near the memory limit, several capped workloads side by side on one GPU.

Each scenario is calibrated first (a few steps under a generous cap: its real per-step peak of torch
allocated memory), then run for the rest of the time under a `--gpu-memory-limit` set so that this
peak sits at the scenario's target fraction of the cap (90-97 %), with `--guard observe` (the model
scores every window and says what it would do; nothing acts). `--gpu-memory-limit` is torch's
per-process cap, so the workloads do not limit each other; the physical card must hold all the caps
at once, which `--budget-gib` checks before anything starts. A background `nvidia-smi` log shows
what the card held.

    python3 benchmarks/nearcap.py --seconds 520 --out /tmp/nearcap [--set 1..6] [--only NAME ...]

Writes one session folder per scenario under OUT/sessions/NAME, its log as OUT/logs/NAME.log, and
OUT/nearcap.json (each scenario: command, calibrated peak, cap, target, exit code).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

GiB = 2**30

# name: (stress arguments, target peak/cap, calibration cap GiB, calibration steps, expected cap GiB)
SCENARIOS: dict[str, tuple[list[str], float, float, int, float]] = {
    "nc-v3slice-prefill-b8": (["--preset", "v3-slice", "--mode", "prefill", "--batch", "8", "--seq-len", "512"], 0.94, 62, 4, 52),
    "nc-v2lite-prefill-b48": (["--preset", "v2-lite", "--mode", "prefill", "--batch", "48", "--seq-len", "512"], 0.93, 42, 4, 36),
    "nc-small-train-frag-b16": (["--preset", "small", "--mode", "train", "--batch", "16", "--fragment"], 0.93, 14, 12, 10),
    "nc-small-prefill-b256": (["--preset", "small", "--mode", "prefill", "--batch", "256"], 0.95, 12, 4, 9),
    "nc-small-decode-b32": (["--preset", "small", "--mode", "decode", "--batch", "32"], 0.94, 8, 3, 4),
    "nc-small-train-rampmax-b16": (["--preset", "small", "--mode", "train", "--schedule", "ramp", "--batch", "16", "--max-batch", "16"], 0.96, 14, 4, 9.5),
    "nc-small-train-soak-b12": (["--preset", "small", "--mode", "train", "--schedule", "soak", "--batch", "12"], 0.92, 12, 4, 8),
    # the same command as recordings/h200-oom-2026-11-30/ok-small-prefill-cap20, recorded alone there:
    # its per-step memory must match (shared GPU vs one workload)
    "sbs-small-prefill-cap20": (["--preset", "small", "--mode", "prefill", "--batch", "64", "--gpu-memory-limit", "20GiB"], 0.0, 0, 0, 4),
}
# The second set (call 2): what the first lacked - decode and fragmentation on v2-lite, fp16, a prefill
# ramp that stops below the edge; prefill/decode targets lowered after the first set's first-step OOMs
# (a fresh cap's first step needs more than the calibrated steady peak).
SCENARIOS_2: dict[str, tuple[list[str], float, float, int, float]] = {
    "nc2-v2lite-decode-b32": (["--preset", "v2-lite", "--mode", "decode", "--batch", "32"], 0.93, 40, 3, 35),
    "nc2-v2lite-prefill-frag-b24": (["--preset", "v2-lite", "--mode", "prefill", "--batch", "24", "--seq-len", "1024", "--fragment"], 0.92, 40, 8, 35),
    "nc2-small-train-fp16-b16": (["--preset", "small", "--mode", "train", "--precision", "fp16", "--batch", "16"], 0.94, 14, 4, 10),
    "nc2-small-prefill-b128": (["--preset", "small", "--mode", "prefill", "--batch", "128"], 0.91, 8, 4, 5),
    "nc2-small-decode-b64": (["--preset", "small", "--mode", "decode", "--batch", "64"], 0.91, 10, 3, 5),
    "nc2-small-train-frag-b12": (["--preset", "small", "--mode", "train", "--batch", "12", "--fragment"], 0.90, 12, 10, 8),
    "nc2-small-prefill-rampmax-b192": (["--preset", "small", "--mode", "prefill", "--schedule", "ramp", "--batch", "192", "--max-batch", "192"], 0.95, 10, 4, 7),
    "nc2-small-train-b20-seq256": (["--preset", "small", "--mode", "train", "--batch", "20", "--seq-len", "256"], 0.95, 10, 4, 6),
}
# The third set (call 24): ramps that climb into fragmentation. Set 2's prefill ramp ran out of memory 24
# times at ~75 % of its cap (reserved segments of the smaller batches filled it); one such session cannot
# both fit and test a rule, so these are ramps of other sizes, modes and presets, each calibrated at the
# steady peak of its top batch and capped so that this peak sits at 90-96 % of the cap: some will fail
# on the way up, some will not, and the held-out evaluation sees both.
SCENARIOS_3: dict[str, tuple[list[str], float, float, int, float]] = {
    "nc3-v2lite-prefill-rampmax-b64": (["--preset", "v2-lite", "--mode", "prefill", "--schedule", "ramp", "--batch", "64", "--max-batch", "64", "--seq-len", "512"], 0.95, 56, 4, 48),
    "nc3-small-train-rampmax-frag-b24": (["--preset", "small", "--mode", "train", "--schedule", "ramp", "--batch", "24", "--max-batch", "24", "--fragment"], 0.95, 18, 8, 13),
    "nc3-small-prefill-rampmax-b256": (["--preset", "small", "--mode", "prefill", "--schedule", "ramp", "--batch", "256", "--max-batch", "256"], 0.95, 14, 4, 10),
    "nc3-small-prefill-rampmax-b96-seq1024": (["--preset", "small", "--mode", "prefill", "--schedule", "ramp", "--batch", "96", "--max-batch", "96", "--seq-len", "1024"], 0.95, 14, 4, 10),
    "nc3-small-prefill-rampmax-b160-t90": (["--preset", "small", "--mode", "prefill", "--schedule", "ramp", "--batch", "160", "--max-batch", "160"], 0.90, 10, 4, 7),
    "nc3-small-train-rampmax-b24-seq256": (["--preset", "small", "--mode", "train", "--schedule", "ramp", "--batch", "24", "--max-batch", "24", "--seq-len", "256"], 0.95, 12, 4, 8),
    "nc3-small-decode-rampmax-b128": (["--preset", "small", "--mode", "decode", "--schedule", "ramp", "--batch", "128", "--max-batch", "128"], 0.95, 12, 3, 8),
    "nc3-small-train-fp16-rampmax-b20": (["--preset", "small", "--mode", "train", "--precision", "fp16", "--schedule", "ramp", "--batch", "20", "--max-batch", "20"], 0.94, 16, 4, 12),
}
# The fourth set (issue 20, lead time): ramps that climb past the edge of a fixed cap again and again (no
# --max-batch: after each OOM the ramp restarts at a quarter of its batch and climbs again), recorded with
# the schema-v4 lookahead columns written live - sessions the shipped model never trained on, for its
# lead time and false alarms on ramps (models/risk.md, "fresh sessions").
SCENARIOS_4: dict[str, tuple[list[str], float, float, int, float]] = {
    "nc4-v2lite-prefill-ramp-cap36": (["--preset", "v2-lite", "--mode", "prefill", "--schedule", "ramp", "--batch", "64", "--seq-len", "512", "--gpu-memory-limit", "36GiB"], 0.0, 0, 0, 36),
    "nc4-small-prefill-ramp-cap6": (["--preset", "small", "--mode", "prefill", "--schedule", "ramp", "--batch", "64", "--gpu-memory-limit", "6GiB"], 0.0, 0, 0, 6),
    "nc4-small-prefill-ramp-seq2048-cap8": (["--preset", "small", "--mode", "prefill", "--schedule", "ramp", "--batch", "16", "--seq-len", "2048", "--gpu-memory-limit", "8GiB"], 0.0, 0, 0, 8),
    "nc4-small-train-ramp-cap7": (["--preset", "small", "--mode", "train", "--schedule", "ramp", "--batch", "8", "--gpu-memory-limit", "7GiB"], 0.0, 0, 0, 7),
    "nc4-small-train-fp16-ramp-cap9": (["--preset", "small", "--mode", "train", "--precision", "fp16", "--schedule", "ramp", "--batch", "8", "--gpu-memory-limit", "9GiB"], 0.0, 0, 0, 9),
    "nc4-small-train-frag-ramp-cap10": (["--preset", "small", "--mode", "train", "--schedule", "ramp", "--batch", "8", "--fragment", "--gpu-memory-limit", "10GiB"], 0.0, 0, 0, 10),
    "nc4-small-decode-ramp-cap3": (["--preset", "small", "--mode", "decode", "--schedule", "ramp", "--batch", "256", "--gpu-memory-limit", "3GiB"], 0.0, 0, 0, 3),
    "nc4-small-prefill-sweep-cap5": (["--preset", "small", "--mode", "prefill", "--schedule", "sweep", "--max-batch", "256", "--gpu-memory-limit", "5GiB"], 0.0, 0, 0, 5),
}
# The fifth set (2026-12-02): healthy running near the limit again, shapes and combinations no training
# set holds, recorded with the run's-end rules live - held out (recordings/heldout-h200-2026-12-02/): the
# near-limit false alarms of the shipped model on sessions no rule or model was chosen on.
SCENARIOS_5: dict[str, tuple[list[str], float, float, int, float]] = {
    "nc5-v3slice-prefill-b6-seq640": (["--preset", "v3-slice", "--mode", "prefill", "--batch", "6", "--seq-len", "640"], 0.94, 60, 4, 52),
    "nc5-v2lite-prefill-b40": (["--preset", "v2-lite", "--mode", "prefill", "--batch", "40", "--seq-len", "512"], 0.95, 40, 4, 30),
    "nc5-small-train-frag-b20": (["--preset", "small", "--mode", "train", "--batch", "20", "--fragment"], 0.95, 16, 12, 11),
    "nc5-small-prefill-b96-seq1024": (["--preset", "small", "--mode", "prefill", "--batch", "96", "--seq-len", "1024"], 0.93, 10, 4, 7),
    "nc5-small-decode-b48": (["--preset", "small", "--mode", "decode", "--batch", "48"], 0.95, 6, 3, 3),
    "nc5-small-train-b14-seq384": (["--preset", "small", "--mode", "train", "--batch", "14", "--seq-len", "384"], 0.94, 10, 4, 7),
    "nc5-small-train-fp16-frag-b12": (["--preset", "small", "--mode", "train", "--precision", "fp16", "--batch", "12", "--fragment"], 0.93, 14, 10, 9),
    "nc5-small-prefill-b192": (["--preset", "small", "--mode", "prefill", "--batch", "192"], 0.96, 10, 4, 7),
}
# The sixth set (2026-12-02, after the shape library): first steps of inference under caps around the edge
# the library draws (room above the weights of 1.0-1.5 x the activations), shapes no set holds - held out,
# to test the first-step estimate blind (`gpuwatch eval --first-step`). Short runs: the first step is the point.
SCENARIOS_6: dict[str, tuple[list[str], float, float, int, float]] = {
    "nc6-v3slice-prefill-b10": (["--preset", "v3-slice", "--mode", "prefill", "--batch", "10", "--seq-len", "512"], 0.955, 62, 3, 54),
    "nc6-v2lite-prefill-b56": (["--preset", "v2-lite", "--mode", "prefill", "--batch", "56", "--seq-len", "512"], 0.93, 44, 3, 37),
    "nc6-small-prefill-b160": (["--preset", "small", "--mode", "prefill", "--batch", "160"], 0.88, 10, 3, 7),
    "nc6-small-prefill-b64-seq1024": (["--preset", "small", "--mode", "prefill", "--batch", "64", "--seq-len", "1024"], 0.82, 10, 3, 6),
    "nc6-small-decode-b40": (["--preset", "small", "--mode", "decode", "--batch", "40"], 0.85, 6, 3, 3.5),
    "nc6-small-decode-b56": (["--preset", "small", "--mode", "decode", "--batch", "56"], 0.80, 7, 3, 4),
    "nc6-small-prefill-b224": (["--preset", "small", "--mode", "prefill", "--batch", "224"], 0.78, 12, 3, 9.5),
    "nc6-small-prefill-b112": (["--preset", "small", "--mode", "prefill", "--batch", "112"], 0.92, 8, 3, 5),
}
CALIBRATE_ARGS = {
    "nc2-small-prefill-rampmax-b192": ["--preset", "small", "--mode", "prefill", "--batch", "192"],  # what calibration runs at: the steady peak of the shape the scenario reaches
    "nc-small-train-rampmax-b16": ["--preset", "small", "--mode", "train", "--batch", "16"],
    "nc-small-train-soak-b12": ["--preset", "small", "--mode", "train", "--batch", "13"],  # the soak's 110 % overload
    **{n: [a for i, a in enumerate(args) if not (a == "ramp" or (i + 1 < len(args) and args[i + 1] == "ramp")
                                              or a == "--max-batch" or (i and args[i - 1] == "--max-batch"))]
       for n, (args, *_rest) in SCENARIOS_3.items()},  # a set-3 ramp calibrates at its top batch, steady
}


def newest_session(d: Path) -> Path | None:
    found = sorted((p for p in d.iterdir() if p.is_dir() and (p / "meta.json").exists()), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def peak_of(session: Path) -> int | None:
    import pyarrow.parquet as pq

    f = session / "steps.parquet"
    if not f.exists():
        return None
    t = pq.read_table(f, columns=["torch_peak_bytes"]).column(0).to_pylist()
    t = [v for v in t if v]
    return max(t) if t else None


def run(cmd: list[str], log: Path, timeout: float) -> int:
    with open(log, "ab") as fh:
        fh.write((" ".join(cmd) + "\n").encode())
        fh.flush()
        try:
            return subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return 124


def scenario(name: str, out: Path, deadline: float, result: dict) -> None:
    args, target, calib_gib, calib_steps, _ = {**SCENARIOS, **SCENARIOS_2, **SCENARIOS_3, **SCENARIOS_4, **SCENARIOS_5, **SCENARIOS_6}[name]
    py = [sys.executable, "-m", "gpuwatch", "stress"]
    log = out / "logs" / f"{name}.log"
    r = result[name] = {"args": args, "target": target}
    cap_args: list[str] = []
    if target:
        cdir = out / "calib" / name
        cdir.mkdir(parents=True, exist_ok=True)
        cal = CALIBRATE_ARGS.get(name, args)
        rc = run(py + cal + ["--gpu-memory-limit", f"{calib_gib}GiB", "--steps", str(calib_steps), "--no-model",
                             "--guard", "off", "--progress", "0", "-o", str(cdir)], log, 150)
        s = newest_session(cdir)
        peak = peak_of(s) if s else None
        r.update(calib_rc=rc, calib_peak_bytes=peak)
        if not peak:
            r["error"] = "calibration recorded no step"
            return
        cap = int(peak / target)
        r["cap_bytes"] = cap
        cap_args = ["--gpu-memory-limit", str(cap)]
    secs = int(deadline - time.time())
    if secs < 60:
        r["error"] = f"only {secs} s left"
        return
    sdir = out / "runs" / name
    sdir.mkdir(parents=True, exist_ok=True)
    cmd = py + args + cap_args + ["--guard", "observe", "--duration", f"{secs}s", "--progress", "30s", "-o", str(sdir)]
    r["command"] = " ".join(["gpuwatch", "stress"] + args + cap_args + ["--guard", "observe", "--duration", f"{secs}s"])
    t0 = time.time()
    r["rc"] = run(cmd, log, secs + 120)
    r["wall_s"] = round(time.time() - t0, 1)
    s = newest_session(sdir)
    if s:
        dest = out / "sessions" / name
        shutil.move(str(s), dest)
        r["session"] = str(dest)


def smi_log(path: Path, stop: threading.Event) -> None:
    if not shutil.which("nvidia-smi"):
        return
    with open(path, "w") as fh:
        p = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,memory.used,memory.total,utilization.gpu,power.draw",
                              "--format=csv", "-l", "5"], stdout=fh, stderr=subprocess.STDOUT)
        stop.wait()
        p.terminate()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=520, help="wall time for everything")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--set", type=int, choices=(1, 2, 3, 4, 5, 6), default=1, help="which scenario table (default 1)")
    ap.add_argument("--budget-gib", type=float, default=134.0, help="what the caps may add up to on the card")
    a = ap.parse_args()
    table = {1: SCENARIOS, 2: SCENARIOS_2, 3: SCENARIOS_3, 4: SCENARIOS_4, 5: SCENARIOS_5, 6: SCENARIOS_6}[a.set]
    names = a.only or list(table)
    total = sum(table[n][4] for n in names)
    print(f"{len(names)} scenarios, expected caps {total:.0f} GiB of a {a.budget_gib:.0f} GiB budget", flush=True)
    if total > a.budget_gib:
        print("over budget", file=sys.stderr)
        return 2
    for d in ("logs", "sessions", "runs", "calib"):
        (a.out / d).mkdir(parents=True, exist_ok=True)
    deadline = time.time() + a.seconds
    result: dict = {}
    stop = threading.Event()
    threading.Thread(target=smi_log, args=(a.out / "nvidia-smi.csv", stop), daemon=True).start()
    threads = []
    for n in names:  # the largest first: its calibration has the card to itself for a moment
        t = threading.Thread(target=scenario, args=(n, a.out, deadline, result))
        t.start()
        threads.append(t)
        time.sleep(2)
    for t in threads:
        t.join()
    stop.set()
    (a.out / "nearcap.json").write_text(json.dumps(result, indent=1))
    for n in names:
        r = result.get(n, {})
        print(f"{n}: rc={r.get('rc')} cap={r.get('cap_bytes', 0) / GiB:.2f} GiB "
              f"peak={(r.get('calib_peak_bytes') or 0) / GiB:.2f} GiB {r.get('error', '')}", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
