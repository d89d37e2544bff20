"""Held-out scenarios for the risk model (issue 29, item 2): drawn from a seed, recorded blind, scored once.

    python3 benchmarks/heldout_gen.py plan --seed S -n N [--seconds T] [--dry-run]          # the plan, JSON
    python3 benchmarks/heldout_gen.py run --seed S -n N --seconds T --out DIR [--dry-run]    # record them

The protocol: this file was written and committed before any rule or feature of issue 29 changed (the
commit is in docs/BENCHMARKS.md, "Held-out protocol"); the sets are drawn from seeds no rule was tuned on and
recorded after the rule change is committed (benchmarks/gpu_heldout.sh on the H200), then scored with
`python3 -m gpuwatch eval --set DIR --per-session` as the headline. Nothing here reads a recording, a model
or a rule: a scenario is a function of (seed, index) alone.

Two families, every run unguarded (`--guard off`: the model scores, nothing acts; the library loop with
`guard="off"`), each under its own `--gpu-memory-limit` (torch's per-process cap: side by side on one GPU
each session's figures are its process's own):
- `stress`: gpuwatch's own workload - presets small / v2-lite / v3-slice (tiny on the CPU), modes train /
  prefill / decode, schedules steady / soak / ramp, random sequence lengths (`--fragment`), leaks of a few
  MiB a step, fp16, decode with long generations with and without CUDA graphs;
- `loop`: a user's PyTorch loop in `GuardedLoop` (benchmarks/heldout_loop.py: a random-weight Llama), with a
  sequence curriculum, random lengths, a cache that grows with each new shape, or a CUDA-graph pool per shape.
Each scenario runs a few calibration steps under a generous cap first (the `slot`, what the card must hold
for it), then runs for SECONDS under a cap at which its measured start peak sits at the drawn `target`
share: 0.90-0.97 for a healthy near-limit run, 0.35-0.75 for one that grows (ramps, leaks, curricula,
caches), which crosses it. Scenarios run in waves whose slots add up to at most --budget-gib.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
GiB = 2**30
CALIB_STEPS = 4

# (preset, mode): the calibration cap (GiB) - what the scenario may hold on the card. Generous on purpose:
# the run's own cap is set from what calibration measured, always below it.
SLOT_GIB = {("small", "train"): 16, ("small", "prefill"): 12, ("small", "decode"): 10,
            ("v2-lite", "prefill"): 48, ("v2-lite", "decode"): 46, ("v2-lite", "train"): 96,
            ("v3-slice", "prefill"): 66, ("tiny", "train"): 1, ("tiny", "prefill"): 1, ("tiny", "decode"): 1}
# (preset, mode): the most tokens a start shape may hold in its slot (train/prefill: batch x seq; decode:
# batch x (prompt + generation)), from the shapes the recorded sets ran under caps (recordings/README.md)
MAX_TOKENS = {("small", "train"): 12_000, ("small", "prefill"): 96_000, ("small", "decode"): 64_000,
              ("v2-lite", "prefill"): 30_000, ("v2-lite", "decode"): 20_000, ("v2-lite", "train"): 5_000,
              ("v3-slice", "prefill"): 5_000, ("tiny", "train"): 512, ("tiny", "prefill"): 512, ("tiny", "decode"): 512}
LOOP_SLOT_GIB = 24  # heldout_loop.py's model (~0.2 B parameters, AdamW, ~0.65 MB a token) at its largest shapes
LOOP_MAX_TOKENS = 12_288  # batch x the longest length: its peak (~10 GB) over a target of 0.45 still fits the slot


@dataclass
class Scenario:
    name: str
    family: str  # stress | loop
    args: list[str]  # after `gpuwatch stress` or `python3 benchmarks/heldout_loop.py`
    calib_args: list[str]  # the calibration's (stress: the start shape, steady); [] = the loop calibrates itself
    target: float  # the start peak / the cap
    slot_gib: float
    growth: str  # what should reach the cap: none | ramp | leak | curriculum | randlen | cache | graphpool | decode-ramp
    notes: dict = field(default_factory=dict)


def _pick(r: random.Random, options):
    return options[r.randrange(len(options))]


def _stress(r: random.Random, i: int, dry: bool) -> Scenario:
    preset = "tiny" if dry else r.choices(["small", "v2-lite", "v3-slice"], weights=[6, 3, 1])[0]
    modes = ["prefill"] if preset == "v3-slice" else ["train", "prefill", "decode"]
    mode = _pick(r, modes)
    if preset == "v2-lite" and mode == "train" and r.random() < 0.5:
        mode = _pick(r, ["prefill", "decode"])  # v2-lite train needs the card nearly alone: rarer
    growth = r.choices(["none", "ramp", "leak", "randlen"], weights=[3, 4, 2, 2])[0]
    if mode == "decode" and growth in ("randlen",):
        growth = "decode-ramp"
    batch = {"small": r.randint(4, 48), "v2-lite": r.randint(4, 24), "v3-slice": r.randint(2, 8), "tiny": r.randint(2, 6)}[preset]
    if mode != "train":
        batch *= r.choice([1, 2, 4])
    seq = _pick(r, [128, 256, 384, 512, 768, 1024]) if mode != "decode" else _pick(r, [128, 256, 512])
    if dry:
        seq = _pick(r, [16, 32, 48])
    nt = (_pick(r, [8, 16]) if dry else _pick(r, [128, 256, 512, 1024])) if mode == "decode" else 0
    if growth not in ("ramp", "decode-ramp"):  # the start shape must fit its slot (a ramp starts at a quarter)
        batch = max(1, min(batch, MAX_TOKENS[(preset, mode)] // (seq + nt)))
    args = ["--preset", preset, "--mode", mode, "--batch", str(batch), "--seq-len", str(seq)]
    extra: list[str] = []
    if mode == "decode":
        extra += ["--new-tokens", str(nt), "--graphs", _pick(r, ["auto", "on", "off"])]
    if mode == "train" and r.random() < 0.3:
        extra += ["--precision", "fp16"]
    schedule = "steady" if growth == "none" and r.random() < 0.6 else ("soak" if growth == "none" else "steady")
    start_batch = batch
    notes: dict = {}
    if growth in ("ramp", "decode-ramp"):
        schedule = "ramp"
        start_batch = max(1, batch // 4)  # workload/schedule.py: a ramp starts at a quarter of --batch
    elif growth == "leak":  # MiB a step, set at calibration so that the headroom fills in ~fill_s seconds
        notes["fill_s"] = round(r.uniform(15, 90), 1)
    elif growth == "randlen":
        extra += ["--fragment"]
    args += ["--schedule", schedule] + extra
    if schedule == "soak":
        start_batch = max(1, round(1.1 * batch))  # the soak's overload steps (workload/schedule.py)
    calib = ["--preset", preset, "--mode", mode, "--batch", str(start_batch), "--seq-len", str(seq)] + _calib_extra(extra)
    target = round(r.uniform(0.90, 0.97), 3) if growth == "none" else round(r.uniform(0.35, 0.75), 3)
    if growth == "randlen":  # random lengths: calibrated at --seq-len, the longest they draw; near the limit
        target = round(r.uniform(0.80, 0.95), 3)
    name = f"ho-{i:02d}-{preset}-{mode}-{growth}-b{batch}-s{seq}"
    return Scenario(name, "stress", args, calib, target, SLOT_GIB[(preset, mode)], growth, notes)


def _calib_extra(extra: list[str]) -> list[str]:
    """The flags calibration keeps: precision, generation length and graphs (not the faults)."""
    out, it = [], iter(extra)
    for a in it:
        if a in ("--precision", "--new-tokens", "--graphs"):
            out += [a, next(it)]
        elif a == "--leak-mib":
            next(it)
    return out


def _loop(r: random.Random, i: int, dry: bool) -> Scenario:
    growth = _pick(r, ["curriculum", "randlen", "cache", "graphpool"])
    if dry and growth == "graphpool":
        growth = "cache"  # CUDA graphs need a GPU; the CPU dry run runs the cache instead
    batch = r.randint(2, 4) if dry else r.randint(4, 24)
    s_hi = _pick(r, [32, 48, 64]) if dry else _pick(r, [512, 768, 1024, 1536, 2048])
    s_lo = max(8, s_hi // _pick(r, [2, 4, 8]))
    if not dry:
        batch = max(1, min(batch, LOOP_MAX_TOKENS // s_hi))
    if growth == "curriculum":
        target = round(r.uniform(1.05, 1.6), 3)  # the last stage's predicted peak over the cap: it fails there
    elif growth == "randlen":
        target = round(r.uniform(0.88, 1.1), 3)  # the longest draw near or past the cap
    else:
        target = round(r.uniform(0.45, 0.75), 3)  # the first step's peak: the cache / pool grows into the cap
    seed = r.randrange(2**31)
    args = ["--kind", growth, "--batch", str(batch), "--seq-min", str(s_lo), "--seq-max", str(s_hi),
            "--target", str(target), "--seed", str(seed)]
    if growth in ("cache", "graphpool"):
        args += ["--keys", str(r.randint(6, 40))]
    if growth == "curriculum":
        args += ["--stages", str(r.randint(3, 6))]
    name = f"ho-{i:02d}-loop-{growth}-b{batch}-s{s_lo}-{s_hi}"
    return Scenario(name, "loop", args, [], target, 1 if dry else LOOP_SLOT_GIB, growth)


def draw(seed: int, n: int, dry: bool = False) -> list[Scenario]:
    """N scenarios from `seed`: each one a function of (seed, its index) alone, ~1/3 library loops."""
    out = []
    for i in range(n):
        r = random.Random(f"gpuwatch-heldout/{seed}/{i}")
        out.append(_loop(r, i, dry) if r.random() < 0.34 else _stress(r, i, dry))
    return out


def waves(scenarios: list[Scenario], budget_gib: float) -> list[list[Scenario]]:
    """Scenarios packed into waves whose slots add up to at most `budget_gib` (first fit, largest first)."""
    out: list[list[Scenario]] = []
    for s in sorted(scenarios, key=lambda x: -x.slot_gib):
        for w in out:
            if sum(x.slot_gib for x in w) + s.slot_gib <= budget_gib:
                w.append(s)
                break
        else:
            out.append([s])
    return out


# -- recording them ------------------------------------------------------------------------------------------
def _run(cmd: list[str], log: Path, timeout: float) -> int:
    with open(log, "ab") as fh:
        fh.write((" ".join(cmd) + "\n").encode())
        fh.flush()
        try:
            return subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return 124


def _sessions_in(d: Path) -> list[Path]:
    return sorted((p for p in d.iterdir() if p.is_dir() and (p / "meta.json").exists()), key=lambda p: p.stat().st_mtime) if d.exists() else []


def _column(session: Path, name: str) -> list:
    import polars as pl

    f = session / "steps.parquet"
    return [v for v in pl.read_parquet(f, columns=[name])[name].to_list() if v] if f.exists() else []


def _peak(session: Path) -> int | None:
    t = _column(session, "torch_peak_bytes")
    return max(t) if t else None


def _step_time(session: Path) -> float | None:
    t = sorted(_column(session, "step_time_s"))
    return t[len(t) // 2] if t else None


def _device_args(dry: bool) -> list[str]:
    return ["--device", "cpu", "--sampler", "thread"] if dry else []


def record_stress(s: Scenario, out: Path, seconds: int, dry: bool, r: dict) -> None:
    """Calibrate at the start shape under the slot cap, then run unguarded under the cap the target draws."""
    py = [sys.executable, "-m", "gpuwatch", "stress"]
    log = out / "logs" / f"{s.name}.log"
    cdir = out / "calib" / s.name
    cdir.mkdir(parents=True, exist_ok=True)
    cal_cap = [] if dry else ["--gpu-memory-limit", f"{s.slot_gib}GiB"]
    r["calib_rc"] = _run(py + s.calib_args + cal_cap + _device_args(dry) + [
        "--steps", str(CALIB_STEPS), "--no-model", "--guard", "off", "--progress", "0", "-o", str(cdir)], log, 240)
    found = _sessions_in(cdir)
    peak = _peak(found[-1]) if found else None
    if dry and found and not peak:
        peak = GiB  # a CPU step has no torch memory figures: the dry run runs uncapped anyway
    r["calib_peak_bytes"] = peak
    if not peak:
        r["error"] = "calibration recorded no step"
        return
    cap = min(int(peak / s.target), int(s.slot_gib * GiB))
    r["cap_bytes"] = cap
    cap_args = [] if dry else ["--gpu-memory-limit", str(cap)]
    if "fill_s" in s.notes:  # the leak: what fills the headroom in fill_s at the calibrated step time
        step_s = _step_time(found[-1]) or 0.5
        mib = max(1, int((cap - peak) / 2**20 / max(1.0, s.notes["fill_s"] / step_s)))
        r["leak_mib"] = mib
        cap_args += ["--leak-mib", str(mib)]
    sdir = out / "runs" / s.name
    sdir.mkdir(parents=True, exist_ok=True)
    tail = ["--guard", "off", "--duration", f"{seconds}s", "--progress", "30s"]
    r["command"] = " ".join(["gpuwatch", "stress"] + s.args + cap_args + _device_args(dry) + tail)
    t0 = time.time()
    r["rc"] = _run(py + s.args + cap_args + _device_args(dry) + tail + ["-o", str(sdir)], log, seconds + 180)
    r["wall_s"] = round(time.time() - t0, 1)
    _collect(s, sdir, out, r)


def record_loop(s: Scenario, out: Path, seconds: int, dry: bool, r: dict) -> None:
    """benchmarks/heldout_loop.py calibrates itself (two probe steps) and sets its own cap from the target."""
    log = out / "logs" / f"{s.name}.log"
    sdir = out / "runs" / s.name
    sdir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(HERE / "heldout_loop.py")] + s.args + ["--seconds", str(seconds), "--name", s.name,
                                                                     "--slot-gib", str(s.slot_gib), "--out", str(sdir)]
    if dry:
        cmd.append("--dry-run")
    r["command"] = " ".join(["python3", "benchmarks/heldout_loop.py"] + cmd[2:])
    t0 = time.time()
    r["rc"] = _run(cmd, log, seconds + 240)
    r["wall_s"] = round(time.time() - t0, 1)
    _collect(s, sdir, out, r)


def _collect(s: Scenario, sdir: Path, out: Path, r: dict) -> None:
    found = _sessions_in(sdir)
    r["sessions"] = []
    for k, p in enumerate(found):  # a library loop may restart after an OOM at its floor: one session each
        dest = out / "sessions" / (s.name if len(found) == 1 else f"{s.name}-e{k + 1}")
        shutil.move(str(p), dest)
        r["sessions"].append(dest.name)
    summary = sdir / "loop.json"
    if summary.exists():
        r["loop"] = json.loads(summary.read_text())


def _guarded(s: Scenario, out: Path, seconds: int, dry: bool, r: dict) -> None:
    """One scenario; whatever goes wrong is said in its row, and the other scenarios go on."""
    try:
        (record_loop if s.family == "loop" else record_stress)(s, out, seconds, dry, r)
    except Exception as e:  # noqa: BLE001 - one scenario's failure is its row's, not the set's
        r["error"] = f"{type(e).__name__}: {e}"


def _smi_log(path: Path, stop: threading.Event) -> None:
    if not shutil.which("nvidia-smi"):
        return
    with open(path, "w") as fh:
        p = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,memory.used,memory.total,utilization.gpu,power.draw",
                              "--format=csv", "-l", "5"], stdout=fh, stderr=subprocess.STDOUT)
        stop.wait()
        p.terminate()


WAVE_RESERVE_S = 150  # a wave's time besides its runs: calibration (model build + 4 steps), the run's build, exit


def fitting(n_waves: int, left_s: float, seconds: int, reserve_s: float) -> int:
    """How many waves the time left can hold, each at least min(30, seconds) s of run beside its reserve."""
    need = min(30, seconds)
    return max((n for n in range(n_waves + 1) if n == 0 or left_s / n - reserve_s >= need), default=0)


def record(scenarios: list[Scenario], out: Path, seconds: int, budget_gib: float, dry: bool,
           deadline_s: float = 1e9) -> dict:
    """Each wave's scenarios side by side, one wave after another, as many waves as `deadline_s` holds at
    WAVE_RESERVE_S + min(30, seconds) s each - those with the most scenarios first - their time shared equally
    (the seconds asked at most); a wave with no time left is not run (said per scenario). Before session 45 the
    time was split over every wave and a wave whose share fell short was dropped: blind set 2909 on an H100 (two
    waves, 320 s) ran its one-scenario wave for 169 s and dropped the four-scenario one."""
    for d in ("logs", "sessions", "runs", "calib"):
        (out / d).mkdir(parents=True, exist_ok=True)
    result: dict = {}
    stop = threading.Event()
    threading.Thread(target=_smi_log, args=(out / "nvidia-smi.csv", stop), daemon=True).start()
    t_end = time.time() + deadline_s
    reserve = 0 if dry else WAVE_RESERVE_S
    ws = sorted(waves(scenarios, budget_gib), key=len, reverse=True)  # stable: slot order within a count
    n_run = fitting(len(ws), deadline_s, seconds, reserve)
    for k, wave in enumerate(ws):
        left = (t_end - time.time()) / max(1, n_run - k) - reserve if k < n_run else 0.0
        secs = int(min(seconds, left))
        print(f"wave {k + 1}: {', '.join(s.name for s in wave)} ({sum(s.slot_gib for s in wave):.0f} GiB, {secs} s) "
              f"{time.strftime('%T')}", flush=True)
        if secs < min(30, seconds):
            for s in wave:
                result[s.name] = {**asdict(s), "wave": k + 1, "error": "not run: no time left in the call"}
            (out / "heldout.json").write_text(json.dumps(result, indent=1))
            continue
        threads = []
        for s in wave:
            r = result[s.name] = {**asdict(s), "wave": k + 1, "seconds": secs}
            t = threading.Thread(target=_guarded, args=(s, out, secs, dry, r))
            t.start()
            threads.append(t)
            time.sleep(0 if dry else 2)
        for t in threads:
            t.join()
        (out / "heldout.json").write_text(json.dumps(result, indent=1))
    stop.set()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("plan", "run"))
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("-n", type=int, default=12)
    ap.add_argument("--seconds", type=int, default=120, help="each scenario's run after its calibration")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--budget-gib", type=float, default=132.0, help="what the slots of one wave may add up to")
    ap.add_argument("--deadline-s", type=float, default=1e9, help="wall time for the whole set (later waves run shorter)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny preset and a tiny loop model, no caps")
    a = ap.parse_args()
    sc = draw(a.seed, a.n, a.dry_run)
    if a.what == "plan":
        plan = {"seed": a.seed, "waves": [[s.name for s in w] for w in waves(sc, a.budget_gib)],
                "scenarios": [asdict(s) for s in sc]}
        print(json.dumps(plan, indent=1))
        return 0
    if a.out is None:
        ap.error("run needs --out")
    res = record(sc, a.out, a.seconds, a.budget_gib, a.dry_run, a.deadline_s)
    for name, r in res.items():
        cap = r.get("cap_bytes") or (r.get("loop") or {}).get("cap_bytes") or 0  # a loop sets its own cap
        print(f"{name}: rc={r.get('rc')} cap={cap / GiB:.2f} GiB "
              f"sessions={len(r.get('sessions', []))} {r.get('error', '')}", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
