"""Where a guarded curriculum arm's step time goes, read from its recorded session (CPU, seconds): each optimizer
step's time by configuration (micro-batch x micro-batches) at a shape's first run, at a later visit and at a repeat
of the last step's shape, beside the static arm's mean step from the same call's JSON lines (the static arm records no
session; its steady rate is `tokens_per_s_after_first`). Session 49 read s47's Lightning pairs with it:

    python3 benchmarks/step_costs.py benchmarks/results/s47/b/lightning-sessions.tgz benchmarks/results/s47/b/lightning.jsonl

Arguments: a `*-sessions.tgz` (or a session folder) and, optionally, the call's JSON lines (the arms' results);
`--what-if FROM_STEP MAX_LEN` adds an estimate (`what_if`): session 49's "5.0 s of 37.8" is
`--what-if 50 1024` on s47b's session (4.7 of 36.3 on s47c's).
From session 49 on every arm's JSON line carries its own `step_log` (planner_curriculum.StepLog), static included,
which this script prints too: then the arms compare step by step, not through a mean."""

from __future__ import annotations

import json
import statistics
import sys
import tarfile
import tempfile
from pathlib import Path


def sessions(arg: str, tmp: Path) -> list[Path]:
    p = Path(arg)
    if p.is_file() and p.name.endswith(".tgz"):
        with tarfile.open(p) as t:
            t.extractall(tmp, filter="data")
        return sorted(x.parent for x in tmp.rglob("steps.parquet"))
    return sorted(x.parent for x in p.rglob("steps.parquet"))


def shape_kinds(shapes: list[tuple[int, int]]) -> list[str | None]:
    """Each step's kind from its (micro-batches, length) shape, in order: "first" (the shape's first run),
    "revisit" (seen before, after other shapes), "repeat" (the last step's shape); None for the first step (the
    warm-up). Also `planner_curriculum.StepLog.summary`'s."""
    out: list[str | None] = []
    seen: set[tuple[int, int]] = set()
    prev = None
    for shape in shapes:
        out.append(None if prev is None else "first" if shape not in seen else "repeat" if shape == prev else "revisit")
        seen.add(shape)
        prev = shape
    return out


def by_kind(rows: list[dict]) -> dict[tuple, dict[str, list[float]]]:
    """Per configuration (micro-batch, count), the steps' times by kind (`shape_kinds`)."""
    out: dict[tuple, dict[str, list[float]]] = {}
    ks = [int(r["micro_batches"] or 1) for r in rows]
    for r, k, kind in zip(rows, ks, shape_kinds([(k, int(r["seq_len"])) for r, k in zip(rows, ks)])):
        if kind is not None:
            out.setdefault((r["batch"] // k, k), {"first": [], "revisit": [], "repeat": []})[kind].append(r["step_time_s"])
    return out


def report_session(path: Path) -> dict:
    import polars as pl

    rows = pl.read_parquet(path / "steps.parquet").sort("step").to_dicts()
    tokens = sum(r["batch"] * r["seq_len"] for r in rows[1:])
    span = sum(r["step_time_s"] for r in rows[1:])
    print(f"{path.name}: {len(rows)} steps; after the first: {span:.2f} s of steps, {tokens / span:,.0f} tokens/s")
    print("  micro-batch x count | a shape's first run: n, p50 s, sum s | a later visit | a repeat")
    for (mb, k), d in sorted(by_kind(rows).items()):
        cells = [f"{len(v)}, {statistics.median(v):.3f}, {sum(v):.2f}" if v else "-"
                 for v in (d["first"], d["revisit"], d["repeat"])]
        print(f"  {mb} x {k} | " + " | ".join(cells))
    for k in sorted({int(r["micro_batches"] or 1) for r in rows[1:]}):
        at = [r for r in rows[1:] if int(r["micro_batches"] or 1) == k]
        print(f"  {k} micro-batch{'es' if k > 1 else ''} a step: "
              f"{sum(r['batch'] * r['seq_len'] for r in at) / sum(r['step_time_s'] for r in at):,.0f} tokens/s")
    if WHAT_IF_FROM is not None:
        what_if(rows, WHAT_IF_FROM, WHAT_IF_MAX_LEN)
    return {"tokens": tokens, "seconds": span}


WHAT_IF_FROM: int | None = None  # --what-if FROM MAX_LEN (main)
WHAT_IF_MAX_LEN = 0


def what_if(rows: list[dict], start: int, max_len: int) -> None:
    """An estimate, not a measurement: the steps from `start` on that ran split (more than one micro-batch) at a
    length <= `max_len`, priced at the whole batch's repeat time before `start` at the nearest length (the
    median of its repeats there) - what running them whole would have saved (session 49: the planner's 8 x 2
    steps after each epoch's wrap, against epoch 1's 16 x 1 repeats)."""
    whole: dict[int, list[float]] = {}
    for prev, r in zip(rows, rows[1:]):
        if r["step"] < start and int(r["micro_batches"] or 1) == 1 and r["seq_len"] == prev["seq_len"]:
            whole.setdefault(int(r["seq_len"]), []).append(r["step_time_s"])
    split = [r for r in rows if r["step"] >= start and int(r["micro_batches"] or 1) > 1 and r["seq_len"] <= max_len]
    if not whole or not split:
        print(f"  what if: nothing to price (whole-batch repeats before step {start}: {len(whole)} lengths)")
        return
    ran = sum(r["step_time_s"] for r in split)
    alt = sum(statistics.median(whole[min(whole, key=lambda x: abs(x - r["seq_len"]))]) for r in split)
    total = sum(r["step_time_s"] for r in rows[1:])
    print(f"  what if (an estimate): the {len(split)} split steps from step {start} at <= {max_len} tokens ran "
          f"{ran:.2f} s; whole, at the nearest length's repeat time, {alt:.2f} s: {ran - alt:.2f} s of {total:.2f} s saved")


def report_lines(path: Path) -> None:
    for line in path.read_text().splitlines():
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        rate = r.get("tokens_per_s_after_first")
        print(f"{r['arm']}: {r.get('steps_done')} steps, wall {r.get('wall_s')} s, {r.get('tokens_per_s')} tokens/s, "
              f"after the first {rate}")
        summ = r.get("step_summary") or {}
        for kind, (n, p50, total) in (summ.get("by_kind") or {}).items():
            print(f"  {kind}: {n} steps, p50 {p50} ms, {total} ms in all")
        if summ:
            print("  allocator: " + ", ".join(f"{k} {summ.get(k)}" for k in ("cuda_mallocs", "cuda_frees", "alloc_retries",
                                                                            "cuda_mallocs_at_first_runs", "cuda_frees_at_first_runs")))


def main(argv: list[str]) -> int:
    global WHAT_IF_FROM, WHAT_IF_MAX_LEN
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    if "--what-if" in argv:
        i = argv.index("--what-if")
        try:
            WHAT_IF_FROM, WHAT_IF_MAX_LEN = int(argv[i + 1]), int(argv[i + 2])
        except (IndexError, ValueError):
            print("step_costs: --what-if needs FROM_STEP MAX_LEN (two integers)", file=sys.stderr)
            return 2
        argv = argv[:i] + argv[i + 3:]
    from polars.exceptions import PolarsError

    try:
        with tempfile.TemporaryDirectory() as tmp:
            found = sessions(argv[0], Path(tmp))
            if not found:
                print(f"step_costs: no steps.parquet under {argv[0]}", file=sys.stderr)
                return 2
            for s in found:
                report_session(s)
        if len(argv) > 1:
            report_lines(Path(argv[1]))
    except (tarfile.TarError, EOFError, OSError, ValueError, KeyError, PolarsError) as e:  # a torn archive, a
        # foreign parquet or JSON line
        print(f"step_costs: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
