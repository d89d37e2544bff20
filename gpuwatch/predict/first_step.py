"""How well the shape library (predict/prior.py) says a session's first step: each recorded session's first
attempted step - the window just before it, cut and scored as replay and live scoring do - against what
happened (it ran, or it ran out of memory). `gpuwatch train` judges the training sessions leave one session
out for the card; `gpuwatch eval --first-step` prints these and the held-out sessions (`report`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from gpuwatch.predict.features import features
from gpuwatch.predict.peak import INFERENCE
from gpuwatch.predict.prior import FIRST_STEP_OVERHEAD, ShapeLibrary, from_parts, identity, read_parts


def first_attempts(path: Path) -> list[dict[str, Any]]:
    """Per GPU whose workload is a known model in an inference mode: every attempt at its first step - the
    first, and each retry the recovery planned after a first step ran out of memory (no step row yet: the
    shape library still speaks for it, at the plan the `oom_recovered` event recorded) - each with the
    moment just before it (the last sample before it; for a retry, the last after its recovery, else the
    recovery itself) and whether it ran or ran out of memory. `attempt`: 1 for the first; a recovery that
    planned no retry (it stopped the run) adds none."""
    import polars as pl

    from gpuwatch.recording.recorded import event_detail, recovered_plan
    from gpuwatch.recording.source import ReplaySource

    src = ReplaySource(path)
    out = []
    for m in src.gpus:
        wl = m.workload
        if wl is None or identity(wl) is None or wl.get("mode") not in INFERENCE:
            continue
        st = src.steps_df.filter(pl.col("gpu") == m.index)
        ev = src.events_df.filter(pl.col("gpu") == m.index)
        first_us = int(st["ts"].dt.epoch("us")[0]) if st.height else None
        ran_us = first_us - int(float(st["step_time_s"][0] or 0.0) * 1e6) if first_us is not None else None
        rows = ev.filter(pl.col("kind").is_in(["oom", "oom_recovered"]))
        marks = [(int(t), k, d) for t, k, d in zip(rows["ts"].dt.epoch("us").to_list(), rows["kind"].to_list(),
                                                   rows["detail"].to_list()) if first_us is None or t < first_us]
        ooms = [t for t, k, _d in marks if k == "oom"]
        ts = src.times(m.index)
        # (the attempt's end: its OOM or the moment its step began; its outcome; the recovery it follows)
        spans: list[tuple[int | None, str, int | None]] = [(ooms[0], "OOM", None) if ooms else (ran_us, "ran", None)]
        for i, t_oom in enumerate(ooms):
            nxt = ooms[i + 1] if i + 1 < len(ooms) else None
            rec = [t for t, k, d in marks if k == "oom_recovered" and t >= t_oom and (nxt is None or t < nxt)
                   and recovered_plan(event_detail({"detail": d})) is not None]  # a retry was planned
            if rec:
                spans.append((nxt, "OOM", rec[0]) if nxt is not None else (ran_us, "ran", rec[0]))
        for n, (t, outcome, after) in enumerate(spans, start=1):
            if t is None or ts is None or not ts.size:
                continue
            before = ts[(ts < t) & (ts >= (after if after is not None else ts[0]))]
            # (a retry starts within milliseconds of its recovery, a prefill's: judged at the recovery at the latest)
            end_us = int(before[-1]) if before.size else after
            if end_us is not None:
                out.append({"src": src, "gpu": m.index, "end_us": end_us, "attempt": n, "outcome": outcome,
                            "workload": wl, "cap": m.mem_limit_bytes})
    return out


def judge(attempt: dict[str, Any], library: ShapeLibrary, alarm_p: float) -> dict[str, Any] | None:
    """The library's word on one first attempt (`first_attempts`): the window's peak_cross_p, as replay
    and live scoring compute it, and the room the usable limit leaves above the weights / the activations."""
    w = attempt["src"].window_at(attempt["gpu"], attempt["end_us"])
    if w.steps.height or not w.first_plan:
        return None
    p = features(w, None, library)["peak_cross_p"]
    wl, plan = attempt["workload"], w.first_plan
    fc = library.first_step(identity(wl), wl["mode"], plan.get("precision") or wl.get("precision"), plan["batch"],
                            plan["seq_len"], attempt["cap"])
    kept = library.kept_at(identity(wl), wl["mode"], plan.get("precision") or wl.get("precision"), plan["batch"],
                           plan["seq_len"])  # a decode's cache and pool, made once at their size
    act = (fc.mean - fc.base - kept) / FIRST_STEP_OVERHEAD if fc is not None else 0.0  # the activations at the plan
    room = (fc.limit - fc.base - kept) / act if fc is not None and act > 0 else None
    return {"session": Path(attempt["src"].reader.path).name, "gpu": attempt["gpu"], "mode": wl["mode"],
            "attempt": attempt.get("attempt", 1),
            "shape": f"{plan['batch']}x{plan['seq_len']}", "room_over_act": room,
            "p": None if p != p else float(p), "alarm": bool(p == p and p >= alarm_p), "outcome": attempt["outcome"]}


def leave_one_out(paths: list[Path], alarm_p: float, parts: dict[Path, list] | None = None) -> list[dict[str, Any]]:
    """Every first attempt of these sessions judged by the library of all the others. `parts`: the
    sessions' steps as `prior.read_parts` read them, if the caller has them already."""
    parts = read_parts(paths) if parts is None else parts
    rows = []
    for s in paths:
        try:
            attempts = first_attempts(Path(s))
        except Exception:  # noqa: BLE001 - unreadable here is unreadable for training too (said there)
            continue
        if attempts:
            lib = from_parts(v for p, v in parts.items() if p != Path(s))
            rows += [r for r in (judge(a, lib, alarm_p) for a in attempts) if r]
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, int]:
    ooms = [r for r in rows if r["outcome"] == "OOM"]
    ran = [r for r in rows if r["outcome"] == "ran"]
    return {"first_steps": len(rows), "oom": len(ooms), "oom_warned": sum(r["alarm"] for r in ooms),
            "ran": len(ran), "ran_alarmed": sum(r["alarm"] for r in ran), "no_estimate": sum(r["p"] is None for r in rows)}


def _show(title: str, rows: list[dict[str, Any]], say) -> None:
    say(f"== {title}")
    for r in rows:
        room = "-" if r["room_over_act"] is None else f"{r['room_over_act']:.2f}"
        p = "-" if r["p"] is None else f"{r['p']:.2f}"
        say(f"  {r['session'][:40]:40s}{'' if r.get('attempt', 1) == 1 else ' #' + str(r['attempt']):3s} {r['mode']:7s} {r['shape']:>10s} room/act {room:>6s}  p {p:>5s}  "
            f"{'ALARM' if r['alarm'] else '     '}  {r['outcome']}")
    say(f"   {summary(rows)}")


def report(training: list[Path], heldout: list[Path], model: Path, say=print) -> dict[str, Any]:
    """`gpuwatch eval --first-step`: every first step of the training sessions judged leave one session out,
    then those of the held-out sessions with the library of every training session (the shipped model's),
    each alarm at p >= the estimator's operating point in `model`'s manifest; the lines go to `say`, the
    figures are returned."""
    from gpuwatch.predict.model import read_manifest
    from gpuwatch.predict.prior import FIRST_STEP_REL, build

    with np.errstate(all="ignore"):
        t_e = float((read_manifest(model).get("operating_point") or {}).get("estimator") or 0.5)
        out: dict[str, Any] = {"estimator_operating_point": t_e, "overhead": FIRST_STEP_OVERHEAD, "rel": FIRST_STEP_REL}
        rows = leave_one_out(training, t_e)
        _show("training sessions, leave one session out", rows, say)
        out["training"] = {"rows": rows, "summary": summary(rows)}
        lib = build(training)
        held = [r for s in sorted(Path(p) for p in heldout) for r in (judge(a, lib, t_e) for a in first_attempts(s)) if r]
        _show("held-out sessions, the library of every training session", held, say)
        out["heldout"] = {"rows": held, "summary": summary(held)}
    return out
