"""A session's first step: what the shape library (predict/prior.py) says of it, against what happened.

For every recorded session and GPU whose workload is a known model in an inference mode, the window just
before its first attempted step (the last sample before it) is cut as replay cuts it and scored with a
library; printed: the first attempt's shape, the library's activation estimate and the room the usable limit
leaves above the weights (room / activation), P(the first step peaks over the usable limit) - the window's
`peak_cross_p` - and whether the step ran or ran out of memory. Training sessions are scored with a library
built from every other training session (leave one session out: no session speaks for itself); held-out
sessions with the library of all training sessions (the shipped model's).

    python3 benchmarks/first_step_eval.py [--json OUT] [--heldout 'recordings/heldout-h200-*/*/']

The alarm counts at p >= the shipped model's estimator operating point (its manifest).
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from pathlib import Path

import numpy as np
import polars as pl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpuwatch.predict import prior as P  # noqa: E402
from gpuwatch.predict.dataset import default_sessions  # noqa: E402
from gpuwatch.predict.features import features  # noqa: E402
from gpuwatch.predict.model import read_manifest  # noqa: E402
from gpuwatch.predict.peak import _activation_at, usable_limit  # noqa: E402
from gpuwatch.recording.source import ReplaySource  # noqa: E402

GiB = 2**30


def first_attempts(path: Path) -> list[dict]:
    """Per GPU with an inference workload of a known model: the first attempted step's time, shape and
    outcome (an OOM event before any step row, else the first row)."""
    src = ReplaySource(path)
    out = []
    for m in src.gpus:
        wl = m.workload
        if wl is None or P.identity(wl) is None or wl.get("mode") not in P.INFERENCE:
            continue
        st = src.steps_df.filter(pl.col("gpu") == m.index)
        ev = src.events_df.filter((pl.col("gpu") == m.index) & (pl.col("kind") == "oom"))
        first_us = int(st["ts"].dt.epoch("us")[0]) if st.height else None
        oom = ev.filter(pl.col("ts").dt.epoch("us") < first_us) if first_us is not None else ev
        if oom.height:
            t = int(oom["ts"].dt.epoch("us")[0])
            outcome = "OOM"
        elif first_us is not None:
            t, outcome = first_us - int(float(st["step_time_s"][0] or 0) * 1e6), "ran"  # the step began then
        else:
            continue
        ts = src._ts.get(m.index)
        if ts is None:
            continue
        before = ts[ts < t]
        if not before.size:
            continue
        out.append({"src": src, "gpu": m.index, "end_us": int(before[-1]), "outcome": outcome, "workload": wl,
                    "cap": m.mem_limit_bytes})
    return out


def judge(a: dict, lib: P.ShapeLibrary, t_e: float) -> dict | None:
    w = a["src"].window_at(a["gpu"], a["end_us"])
    if w.steps.height or not w.first_plan:
        return None
    f = features(w, None, lib)
    p = f["peak_cross_p"]
    wl, plan = a["workload"], w.first_plan
    e = lib.entries.get(P._key(P.identity(wl), wl["mode"], str(plan.get("precision") or wl.get("precision"))))
    room = act = None
    if e is not None and a["cap"]:
        act, _, _ = _activation_at(e.uk, e.med, e.ut, e.resid, float(plan["batch"]) * float(plan["seq_len"]),
                                   float(plan["seq_len"]))
        room = (usable_limit(a["cap"]) - e.weights) / act if act > 0 else None
    return {"session": Path(a["src"].reader.path).name, "gpu": a["gpu"], "mode": wl["mode"],
            "shape": f"{plan['batch']}x{plan['seq_len']}", "cap_gib": a["cap"] / GiB if a["cap"] else None,
            "act_gib": None if act is None else act / GiB, "room_over_act": room,
            "p": None if p != p else float(p), "alarm": bool(p == p and p >= t_e), "outcome": a["outcome"]}


def summary(rows: list[dict]) -> dict:
    ooms = [r for r in rows if r["outcome"] == "OOM"]
    ran = [r for r in rows if r["outcome"] == "ran"]
    return {"first_steps": len(rows), "oom": len(ooms), "oom_warned": sum(r["alarm"] for r in ooms),
            "ran": len(ran), "ran_alarmed": sum(r["alarm"] for r in ran),
            "no_estimate": sum(r["p"] is None for r in rows)}


def show(title: str, rows: list[dict]) -> None:
    print(f"== {title}")
    for r in rows:
        room = "-" if r["room_over_act"] is None else f"{r['room_over_act']:.2f}"
        p = "-" if r["p"] is None else f"{r['p']:.2f}"
        print(f"  {r['session'][:40]:40s} {r['mode']:7s} {r['shape']:>10s} room/act {room:>6s}  p {p:>5s}  "
              f"{'ALARM' if r['alarm'] else '     '}  {r['outcome']}")
    print("  ", summary(rows))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--heldout", default=str(ROOT / "recordings" / "heldout-h200-*" / "*") + "/")
    a = ap.parse_args()
    t_e = float((read_manifest(ROOT / "models" / "risk.joblib").get("operating_point") or {}).get("estimator") or 0.5)
    train = default_sessions(ROOT)
    out = {"estimator_operating_point": t_e, "overhead": P.FIRST_STEP_OVERHEAD, "rel": P.FIRST_STEP_REL}
    rows = []
    for s in train:
        for att in first_attempts(s):
            r = judge(att, P.build(p for p in train if p != s), t_e)
            if r:
                rows.append(r)
    show("training sessions, leave one session out", rows)
    out["training"] = {"rows": rows, "summary": summary(rows)}
    lib = P.build(train)
    held = []
    for s in sorted(Path(p) for p in glob.glob(a.heldout) if (Path(p) / "meta.json").exists()):
        for att in first_attempts(s):
            r = judge(att, lib, t_e)
            if r:
                held.append(r)
    show("held-out sessions, the library of every training session", held)
    out["heldout"] = {"rows": held, "summary": summary(held)}
    if a.json:
        a.json.write_text(json.dumps(out, indent=1, default=float))
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
