"""`gpuwatch backfill`: a migration of recorded sessions. It fills the schema-v4 lookahead columns
(`ahead_batch`, `ahead_seq_len`, `ahead_steps`) of `gpuwatch stress` sessions recorded before them, through
the same code the live workload runs.

The stress workload's schedule is pure (gpuwatch/workload/schedule.py): given the command the session
was started with (meta.json's argv) and what happened in it (each step that ran, each OOM the schedule
recovered from, each control that was applied - the history `stress --resume` replays), it is in the
state the live run was in after each step. At each step row the backfill asks that schedule what
`Workload._plan_columns` would have asked it live (`predict/ahead.columns`: the largest step planned
within 4 s at the pace of the last step ends). Nothing is read from the recording's future.

It checks itself: the replayed schedule's plan for the next step must equal the `next_batch` /
`next_seq_len` the live run recorded (schema v2 and later; in v1 sessions, the step that ran next) - the
agreement is said per session, and a session below 99 % is left unchanged. Sessions not started by
`gpuwatch stress`, data-parallel sessions and sessions that already have the columns are skipped.

    gpuwatch backfill recordings/*/ recordings/h200-*/*/            # rewrites steps.parquet
    gpuwatch backfill --check recordings/...                        # only prints the agreement
    gpuwatch backfill --compare recordings/heldout-*/*/        # live columns vs the replay
    gpuwatch backfill --refill recordings/...                       # again, where the rule changed

The lookahead ends where the run did (`--steps`, `--duration` from the session's start: `run_end`), as the
live workload's does since the rule came in (call 29's held-out sessions recorded it without).

A recorded command line is parsed by the CLI's own parser, which sits above this module: the caller
hands it in (`parse`: argv without the program -> the parsed flags; `gpuwatch.cli.parser.parse_recorded`).
"""

from __future__ import annotations

import json
from argparse import Namespace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import polars as pl

from gpuwatch.predict import ahead as A
from gpuwatch.recording import schema
from gpuwatch.recording.recorded import fill_plans
from gpuwatch.resume import workload_history
from gpuwatch.workload.config import WorkloadConfig
from gpuwatch.workload.presets import defaults
from gpuwatch.workload.schedule import Schedule

__all__ = ["COLS", "MIN_AGREEMENT", "NEXT", "Parse", "backfill", "gpu_of", "run", "run_end", "schedule_of"]

Parse = Callable[[list[str]], Namespace]  # a recorded command line without the program -> its parsed flags

MIN_AGREEMENT = 0.99
COLS = ("ahead_batch", "ahead_seq_len", "ahead_steps")
NEXT = ("next_batch", "next_seq_len", "next_precision")  # emptied on a run's last step (its end: nothing planned)


def schedule_of(argv: list[str], rec: dict, parse: Parse) -> Schedule:
    """The schedule the live run built (Workload.__init__): from its `gpuwatch stress` command line, or
    (sessions the benchmark scripts recorded) from meta's record of the workload - whose batch is the
    schedule's after construction (a ramp's start, a quarter of the batch asked for: the start is all a
    ramp's levels depend on). The check against the recorded plans says whether it was right."""
    kind = rec.get("schedule") or "steady"
    b, s = defaults(rec["preset"])
    if "stress" in argv[1:2]:
        args = parse(argv[1:])
        return Schedule(kind, args.batch or b, args.seq_len or s, args.max_batch, long_seq=WorkloadConfig.long_seq)
    batch = int(rec.get("batch") or b)
    return Schedule(kind, 4 * batch if kind == "ramp" else batch, int(rec.get("seq_len") or s), None,
                    long_seq=WorkloadConfig.long_seq)


def gpu_of(rec: dict):
    """The GPU a meta record's workload ran on (as recorded.recorded_caps reads it)."""
    dev = str(rec.get("device") or "")
    return rec.get("gpu_index", int(dev.split(":")[1]) if dev.startswith("cuda:") else 0 if dev == "cuda" else None)


def run_end(argv: list[str], meta: dict, events: pl.DataFrame, parse: Parse
            ) -> tuple[int | None, list[tuple[float, float]]]:
    """(max steps, deadlines) of a `gpuwatch stress` run. Deadlines are (when it was set, the deadline),
    both epoch s: each `deadline` event's ends_at where the run recorded them (one per run of a resumed
    session: a row takes the latest set before it), else `--duration` counted from the session's start
    (its `session_start` event, else meta's start), as the live run set `Workload.ends_at` right after the
    session started. (None, []) where unknown: benchmark scripts' sessions, and resumed sessions' flags
    (meta's argv is the first run's) unless they recorded their deadlines."""
    if "stress" not in argv[1:2]:
        return None, []
    args = parse(argv[1:])
    resumed = bool(meta.get("resumed"))
    ev = events.filter(pl.col("kind") == "deadline") if events.height else events
    if ev.height:
        return (None if resumed else args.steps), sorted(
            (t.timestamp(), float(json.loads(d)["ends_at"])) for t, d in zip(ev["ts"], ev["detail"]))
    if resumed or args.duration is None:
        return (None if resumed else args.steps), []
    st = events.filter(pl.col("kind") == "session_start")["ts"] if events.height else None
    if st is not None and st.len():
        t0 = st[0].timestamp()
    elif meta.get("start"):
        t0 = datetime.fromisoformat(meta["start"]).timestamp()
    else:
        return args.steps, []
    return args.steps, [(t0, t0 + float(args.duration))]


def _deadline_at(deadlines: list[tuple[float, float]], t: float) -> float | None:
    """The deadline in force at `t`: the latest one set at or before it."""
    got = None
    for set_at, end in deadlines:
        if set_at <= t:
            got = end
    return got


def backfill(steps: pl.DataFrame, events: pl.DataFrame, sched: Schedule, gpu, seq_random: bool = False,
             max_steps: int | None = None, deadlines: list[tuple[float, float]] | None = None
             ) -> tuple[pl.DataFrame, dict]:
    """The steps of one workload with the ahead columns filled, and the check's figures (`seq_random`:
    --fragment drew each step's length at random below the schedule's, so only batches compare where
    the step that ran next stands for the plan). The history is `stress --resume`'s (resume.workload_history:
    one ("done",) per step row in time order, the OOMs and controls between them), replayed one entry
    at a time so that the schedule is, after each step, where the live run's was. `max_steps` and
    `deadlines` end the lookahead where the run ended (`run_end`), as `Workload._plan_columns` does."""
    same = pl.col("gpu").is_null() if gpu is None else pl.col("gpu") == gpu
    st = steps.filter(same).sort("ts", maintain_order=True)
    plans = iter(st.select("ts", "next_batch", "next_seq_len").rows())
    history = workload_history({"gpu_index": gpu}, steps, events, [])["history"]
    cols: list[dict] = []
    last: list[bool] = []  # the run's last step (at or past its deadline, or the max_steps-th): nothing planned
    ends: list[float] = []
    agree = compared = 0
    for op in history:
        sched.replay([op])
        if op[0] != "done":
            continue
        ts, nb, ns = next(plans)
        ends = (ends + [ts.timestamp()])[-(A.PACE_STEPS + 1):]
        end = _deadline_at(deadlines or [], ends[-1])
        cols.append(A.columns(sched, ends, end - ends[-1] if end is not None else None,
                              max_steps - len(cols) - 1 if max_steps else None))
        last.append((end is not None and ends[-1] >= end) or bool(max_steps and len(cols) >= max_steps))
        p = sched.plan()
        if nb is not None and p is not None:
            compared += 1
            agree += p[0] == nb and (seq_random or p[1] == ns)
    filled = st.with_columns(*(pl.Series(c, [x[c] for x in cols], dtype=schema.STEPS[c]) for c in COLS))
    if any(last):  # the run's last step plans no next one (Workload._plan_columns)
        filled = filled.with_columns(*(pl.when(pl.Series(last)).then(None).otherwise(pl.col(c)).alias(c) for c in NEXT))
    return filled, {"steps": st.height, "compared": compared, "agree": agree}


def run(folder: Path, check: bool, compare: bool = False, refill: bool = False, *, parse: Parse) -> str:
    """Backfill one session folder (`check`: say the agreement, write nothing; `compare`: a session recorded
    with the columns, compared cell by cell with the replay; `refill`: rewrite columns it already has);
    the one line that says what was done is returned."""
    meta_p, steps_p, events_p = folder / "meta.json", folder / "steps.parquet", folder / "events.parquet"
    if not (meta_p.is_file() and steps_p.is_file()):
        return f"{folder}: skipped (no meta.json / steps.parquet)"
    meta = json.loads(meta_p.read_text())
    argv = [str(a) for a in meta.get("argv") or []]
    loads = (meta.get("config") or {}).get("workloads") or []
    if not loads or any(r.get("schedule") is None or r.get("preset") is None for r in loads):
        return f"{folder}: skipped (no workload schedule recorded)"
    steps = pl.read_parquet(steps_p)
    has = all(c in steps.columns for c in COLS) and steps["ahead_batch"].null_count() < steps.height
    if has and not (compare or refill):
        return f"{folder}: skipped (has the columns)"
    if "world_size" in steps.columns and (steps["world_size"].fill_null(1) > 1).any():
        return f"{folder}: skipped (data-parallel)"
    events = schema.conform(pl.read_parquet(events_p), "events") if events_p.is_file() else schema.empty("events")
    original = steps.columns
    v1 = "next_batch" not in original
    # v1 sessions recorded no plan: compare with what ran next instead (the recording layer's fill_plans)
    steps = fill_plans(schema.conform(steps, "steps"), events)
    parts, figs = [], {"steps": 0, "compared": 0, "agree": 0}
    max_steps, deadlines = run_end(argv, meta, events, parse)
    for rec in loads:
        part, f = backfill(steps, events, schedule_of(argv, rec, parse), gpu_of(rec),
                           v1 and bool((rec.get("faults") or {}).get("fragment")), max_steps, deadlines)
        parts.append(part)
        figs = {k: figs[k] + f[k] for k in figs}
    share = figs["agree"] / figs["compared"] if figs["compared"] else None
    line = (f"{folder}: {figs['steps']} steps, the replayed plan equals the recorded next step on "
            f"{figs['agree']}/{figs['compared']}" + (f" ({share:.1%})" if share is not None else ""))
    if has and not refill:  # recorded live: do the replayed lookahead columns equal what the workload wrote?
        replayed = pl.concat(parts).sort("ts", maintain_order=True)
        live = steps.sort("ts", maintain_order=True)
        same = sum(int(replayed[c].eq_missing(live[c]).sum()) for c in COLS + NEXT)  # null = null: nothing planned
        return line + f"; lookahead recorded live: the replay equals it in {same}/{len(COLS + NEXT) * live.height} cells"
    if check:
        return line
    if share is not None and share < MIN_AGREEMENT:
        return line + " - below 99 %: left unchanged"
    if share is None:
        return line + " - nothing to check against: left unchanged"
    merged = pl.concat(parts).sort("ts", maintain_order=True)
    if merged.height != steps.height:
        return line + f" - {steps.height - merged.height} step rows of no recorded workload: left unchanged"
    merged = merged.with_columns(*(merged[c].cast(steps.schema[c]) for c in NEXT if c in original))
    cols = [c for c in original if c not in COLS] + list(COLS)
    md = pl.read_parquet_metadata(steps_p)
    tmp = steps_p.with_suffix(".tmp")
    merged.select(cols).write_parquet(tmp, compression="zstd", compression_level=19, statistics=True, metadata=md)
    tmp.replace(steps_p)
    meta.setdefault("backfilled", []).append({
        "columns": list(COLS) + ([c for c in NEXT if c in original] if deadlines or max_steps else []),
        "run_end": {"deadlines": [d for _t, d in deadlines], "max_steps": max_steps}, "by": "gpuwatch backfill",
        "at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "plan_agreement": round(share, 4)})
    meta_p.write_text(json.dumps(meta, indent=2) + "\n")
    return line + " - filled"
