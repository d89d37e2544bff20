"""Does the guard keep a session's first step from running out of memory? (GPU; `bash benchmarks/gpu.sh firststep`)

Re-runs, side by side on the one GPU and with `--guard on`, recorded first steps of the held-out sets at
their exact caps (recordings/heldout-h200-2026-12-02/nearcap-5.json, -6.json): three that ran out of memory
on their first step under `--guard observe` (set 5), one that the shape library warned of and that then
ran (set 5's v2-lite b40: what the guard's refusal costs there) and one the library missed (set 6's small
prefill b224). Writes OUT/first_step_guard.json: per run, the OOMs, the guard's actions before the first
step, the first step's batch, and the session folder.

    python3 benchmarks/first_step_guard.py --out DIR [--seconds 40]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HELD = ROOT / "recordings" / "heldout-h200-2026-12-02"
RUNS = {  # name: (set file, scenario) - the recorded command, its cap and all, with --guard on
    "decode-b48": ("nearcap-5.json", "nc5-small-decode-b48"),
    "prefill-b192": ("nearcap-5.json", "nc5-small-prefill-b192"),
    "prefill-b96-seq1024": ("nearcap-5.json", "nc5-small-prefill-b96-seq1024"),
    "v2lite-prefill-b40": ("nearcap-5.json", "nc5-v2lite-prefill-b40"),
    "prefill-b224": ("nearcap-6.json", "nc6-small-prefill-b224"),
}


def command(set_file: str, scenario: str, seconds: float) -> list[str]:
    rec = json.loads((HELD / set_file).read_text())[scenario]["command"].split()
    assert rec[:2] == ["gpuwatch", "stress"], rec
    args, skip = [], False
    for i, a in enumerate(rec[2:]):
        if skip:
            skip = False
            continue
        if a in ("--guard", "--duration"):
            skip = True
            continue
        args.append(a)
    return [sys.executable, "-m", "gpuwatch", "stress", *args, "--guard", "on", "--duration", f"{seconds:g}s", "--progress", "0"]


def summarize(session: Path) -> dict:
    import polars as pl

    st = pl.read_parquet(session / "steps.parquet")
    ev = pl.read_parquet(session / "events.parquet").sort("ts")
    first_ts = st["ts"].min() if st.height else None
    before = ev.filter(pl.col("ts") <= first_ts) if first_ts is not None else ev
    return {"steps": st.height, "ooms": int((ev["kind"] == "oom").sum()),
            "first_step_batch": int(st["batch"][0]) if st.height else None,
            "first_step_micro_batches": int(st["micro_batches"][0] or 1) if st.height and "micro_batches" in st.columns else None,
            "guard_actions_before_first_step": [m for k, m in zip(before["kind"], before["message"]) if k == "guard_action"],
            "alarms_before_first_step": int((before["kind"] == "risk_alarm").sum()),
            "oom_messages": [m for k, m in zip(ev["kind"], ev["message"]) if k == "oom"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seconds", type=float, default=40.0)
    a = ap.parse_args()
    result: dict = {}

    def one(name: str, set_file: str, scenario: str) -> None:
        d = a.out / "sessions" / name
        d.mkdir(parents=True, exist_ok=True)
        cmd = command(set_file, scenario, a.seconds) + ["-o", str(d)]
        with open(a.out / f"{name}.log", "w") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=a.seconds + 180).returncode
        found = sorted(p for p in d.iterdir() if (p / "meta.json").exists())
        result[name] = {"command": " ".join(["gpuwatch", "stress", *cmd[4:-2]]), "rc": rc,
                        **(summarize(found[-1]) if found else {"error": "no session"})}

    threads = [threading.Thread(target=one, args=(n, f, s)) for n, (f, s) in RUNS.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (a.out / "first_step_guard.json").write_text(json.dumps(result, indent=1))
    for n, r in result.items():
        print(n, {k: r.get(k) for k in ("rc", "ooms", "steps", "first_step_batch", "alarms_before_first_step")},
              r.get("guard_actions_before_first_step"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
