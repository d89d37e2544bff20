"""Counterfactual caps: a recorded session relabeled as if it had run under a smaller memory cap.

Why it is sound: `--gpu-memory-limit` is a software limit (torch's per-process fraction). A step that
ran below a cap allocates the same under any cap above its peak - the model, the inputs and the
kernels are the same - so a session recorded with cap C (or none) says what would have happened under
any virtual cap V <= C up to the first step whose peak would not fit under V: there the OOM would have
happened, and nothing after it can be known.

The transform (`relabel`), for one GPU's workload:
- the first step whose recorded peak (torch max allocated) exceeds `peak.usable_limit(V)` - the rule the
  estimator uses before a step has shown what the allocator gives (every step before it ran under that limit, so
  its evidence never raises it: `usable_limit`'s `ran`) - is the virtual OOM, placed in the middle of that step; its steps, samples,
  events and everything after are dropped, and an `oom` event is written there (detail `virtual: true`);
- what the allocator held is clipped to what the virtual cap allows: torch reserved to V, the
  process's NVML memory to V + its memory outside torch (the allocator gives cached blocks back before
  it fails, as it does under a real cap), the whole GPU's used by as much;
- meta.json's cap becomes V and says where the session came from (`derived`).

Where it is not exact: under a real, lower cap the allocator frees its cache earlier, so reserved
memory, fragmentation and step times near the cap differ from the clipped recording; the step that
fails is the first that needs more than is usable, which `validate` checks against the real capped
sessions. Derived sessions are for training only: no reported figure for real OOMs uses them
(`predict/train.py` keeps them out of every evaluation fold, and out of the folds of their source).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from gpuwatch.atomic import write_file
from gpuwatch.predict.peak import usable_limit
from gpuwatch.recording.recorded import recorded_caps

NEAR_FRACTIONS = (0.90, 0.94, 0.97)  # healthy copies: the session's highest peak at these shares of the usable limit
FAIL_QUANTILES = (0.5, 0.8)  # failing copies: the usable limit at these quantiles of the distinct step peaks


@dataclass(frozen=True)
class Relabeled:
    path: Path
    source: str
    cap_bytes: int
    virtual_oom: bool
    oom_step: int | None


def _read(src: Path) -> tuple[dict[str, Any], dict[str, pl.DataFrame]]:
    """meta.json and the tables of `src` as every other reader sees them (`recording.reader`): meta.json
    checked, each table conformed to its schema (a renamed column reads as missing, a retyped one as a
    damaged table), so a session replay refuses is refused here too, with the reader's one line
    (RecordingError), and one it reads gives every column relabeling needs."""
    from gpuwatch.recording.reader import SessionReader

    reader = SessionReader(src)
    frames = reader.load_new()
    return reader.meta, {t: frames[t] for t in ("samples", "steps", "events")}


def caps_for(steps: pl.DataFrame, real_cap: int | None, total: int | None) -> list[int]:
    """The virtual caps worth deriving for one session: healthy near-limit copies and, where the
    peaks vary, copies that fail part-way. Never above the session's real cap (or the card)."""
    peaks = steps["torch_peak_bytes"].drop_nulls().cast(pl.Float64).to_numpy()
    if peaks.size < 3:
        return []
    hi = float(peaks.max())
    ceiling = float(real_cap or total or 0) or float("inf")
    want = [_cap_for_usable(hi / f) for f in NEAR_FRACTIONS]
    distinct = np.unique(np.round(peaks / 2**26))  # 64 MiB bins
    if distinct.size >= 3:
        want += [_cap_for_usable(float(np.quantile(peaks, q))) for q in FAIL_QUANTILES]
    return sorted({int(c) for c in want if c < ceiling})


def _cap_for_usable(usable: float) -> float:
    """The cap whose usable limit is `usable` (inverse of peak.usable_limit for caps over ~8.5 GiB,
    and for smaller ones where the margin is the fixed minimum)."""
    from gpuwatch.predict.peak import FRAGMENT_MARGIN, MARGIN_MIN_BYTES

    a = usable / (1.0 - FRAGMENT_MARGIN)
    return a if FRAGMENT_MARGIN * a >= MARGIN_MIN_BYTES else usable + MARGIN_MIN_BYTES


def relabel(src: Path, cap: int, out: Path, scenario: str = "") -> Relabeled:
    """Write `src` relabeled under a virtual cap of `cap` bytes to the folder `out`; `scenario` (the
    source's kind of run, for grouped evaluation) is kept in its meta.json."""
    src = Path(src)
    meta, t = _read(src)
    r, meta, tables = relabeled(meta, t, cap, out, src.name, scenario)
    out.mkdir(parents=True, exist_ok=True)
    for name, df in tables.items():
        _write_like(src / f"{name}.parquet", df, out / f"{name}.parquet")
    write_file(out / "meta.json", json.dumps(meta, indent=1), fsync=False)  # a training scratch copy
    return r


def relabeled(meta: dict[str, Any], t: dict[str, pl.DataFrame], cap: int, out: Path, source: str, scenario: str = ""
              ) -> tuple[Relabeled, dict[str, Any], dict[str, pl.DataFrame]]:
    """A session's meta.json and tables (`_read`) relabeled under a virtual cap of `cap` bytes, in memory: the
    copy's (Relabeled with `out` as its path, meta, samples/steps/events) - what `relabel` writes."""
    samples, steps, events = t["samples"], t["steps"], t["events"]
    if samples.is_empty() or steps.is_empty():
        raise ValueError(f"{source}: needs samples and steps")
    usable = usable_limit(cap)
    peaks = steps["torch_peak_bytes"].cast(pl.Float64).fill_null(0.0).to_numpy()
    over = np.where(peaks > usable)[0]
    oom_step = int(over[0]) if over.size else None
    ts = steps["ts"].dt.epoch("us").to_numpy()
    if oom_step is not None:
        st = float(steps["step_time_s"][oom_step] or 0.0)
        begin = ts[oom_step - 1] if oom_step > 0 else ts[0] - int(st * 1e6)
        t_f = int(begin + (ts[oom_step] - begin) // 2)
        row = steps.row(oom_step, named=True)
        cut = pl.lit(t_f).cast(pl.Datetime("us", "UTC"))
        steps = steps.head(oom_step)
        samples = samples.filter(pl.col("ts") <= cut)
        events = events.filter(pl.col("ts") < cut)
        oom: dict[str, Any] = {c: None for c in events.columns}
        oom.update(ts=t_f, kind="oom", severity="error", gpu=row.get("gpu"),
                   message=f"CUDA OOM at batch {row['batch']} x {row['seq_len']} ({row['precision']}) under a virtual cap",
                   detail=json.dumps({"virtual": True, "cap_bytes": cap, "peak_bytes": int(peaks[oom_step])}))
        ev_new = pl.DataFrame([oom], schema={c: (pl.Int64 if c == "ts" else events.schema[c]) for c in events.columns})
        ev_new = ev_new.with_columns(pl.col("ts").cast(pl.Datetime("us", "UTC")))
        events = pl.concat([events, ev_new.select(events.columns).cast(events.schema)]).sort("ts")
    samples, steps = _clip(samples, steps, meta, cap)
    meta = _meta_under(meta, cap, source, oom_step is not None)
    meta["derived"]["scenario"] = scenario
    return (Relabeled(out, source, cap, oom_step is not None, oom_step), meta,
            {"samples": samples, "steps": steps, "events": events})


def _write_like(orig: Path, df: pl.DataFrame, dest: Path) -> None:
    """Write `df` as a Parquet file carrying the original's key-value metadata (the schema version), or,
    where the table was no one Parquet file (a killed session's stream files), what the recorder writes."""
    from gpuwatch.recording.writer import FILE_META

    md = pl.read_parquet_metadata(orig) if orig.is_file() else FILE_META
    df.write_parquet(dest, metadata=md or None)


def _clip(samples: pl.DataFrame, steps: pl.DataFrame, meta: dict[str, Any], cap: int
          ) -> tuple[pl.DataFrame, pl.DataFrame]:
    steps = steps.with_columns(pl.col("torch_reserved_bytes").cast(pl.Int64).clip(upper_bound=cap)
                               .cast(steps.schema["torch_reserved_bytes"]))  # a null stays null (min_horizontal filled it)
    # (v6, v7) what lies in the cache no more than it holds, a segment no larger than the reserve; a null (not
    # recorded, not read on that step) stays null: clip, not min_horizontal, which would fill it in
    cache = (pl.col("torch_reserved_bytes").cast(pl.Int64) - pl.col("torch_allocated_bytes").cast(pl.Int64)).clip(0)
    inside = {"torch_inactive_split_bytes": cache, "torch_largest_free_bytes": cache,
              "torch_largest_segment_bytes": pl.col("torch_reserved_bytes").cast(pl.Int64)}
    steps = steps.with_columns(pl.col(c).cast(pl.Int64).clip(upper_bound=b).cast(steps.schema[c])
                               for c, b in inside.items() if c in steps.columns)
    pid = meta.get("pid")
    procs = samples["gpu_procs"] if "gpu_procs" in samples.columns else None
    if isinstance(pid, int) and procs is not None:
        own = procs.list.eval(pl.element().filter(pl.element().struct.field("pid") == pid)
                              .struct.field("used_bytes")).list.first().cast(pl.Float64).fill_null(0.0).to_numpy()
    else:  # one process on the GPU: the whole GPU's memory is its own
        own = samples["gpu_mem_used_bytes"].cast(pl.Float64).fill_null(0.0).to_numpy()
    res = steps["torch_reserved_bytes"].cast(pl.Float64).to_numpy()
    nontorch = float(np.clip(np.nanmedian(own[own > 0]) - np.nanmedian(res), 0, 8 * 2**30)) if (own > 0).any() and res.size else 0.0
    nontorch = min(nontorch, 2 * 2**30)
    cut = np.maximum(0.0, own - (cap + nontorch))  # what the allocator would have given back
    if not cut.any():
        return samples, steps
    used = samples["gpu_mem_used_bytes"].cast(pl.Float64).to_numpy() - cut
    cols = [pl.Series("gpu_mem_used_bytes", np.maximum(used, 0)).cast(samples.schema["gpu_mem_used_bytes"])]
    if isinstance(pid, int) and procs is not None:
        new = [[{**p, "used_bytes": int(max(0, p["used_bytes"] - c))} if p.get("pid") == pid and p.get("used_bytes") is not None else p
                for p in (ps or [])] if ps is not None else None for ps, c in zip(procs.to_list(), cut)]
        cols.append(pl.Series("gpu_procs", new, dtype=samples.schema["gpu_procs"]))
    return samples.with_columns(cols), steps


def _meta_under(meta: dict[str, Any], cap: int, source: str, failed: bool) -> dict[str, Any]:
    meta = json.loads(json.dumps(meta))
    for w in (meta.get("config") or {}).get("workloads") or []:
        if isinstance(w, dict):
            w.setdefault("faults", {})
            w["faults"]["memory_limit_bytes"] = int(cap)
    meta["derived"] = {"kind": "counterfactual-cap", "from": source, "cap_bytes": int(cap), "virtual_oom": failed}
    return meta


def derive(src: Path, out_root: Path, scenario: str = "") -> list[Relabeled]:
    """Every counterfactual copy of one session worth training on, under `out_root/<name>@<GiB>`.
    RecordingError (one line) where the session cannot be read."""
    meta, t = _read(Path(src))
    out = []
    for cap in _caps(meta, t):
        dest = out_root / f"{Path(src).name}@{cap / 2**30:.2f}GiB"
        if dest.exists():
            shutil.rmtree(dest)
        out.append(relabel(Path(src), cap, dest, scenario))
    return out


def derive_sources(src: Path, scenario: str = "") -> list[tuple[Relabeled, Any]]:
    """`derive`'s copies held in memory, not written: each as a ReplaySource over its tables (named
    `<name>@<GiB>`, as `derive` names its folders). Training cuts them into windows and drops them; the same
    timelines as the written copies (tested)."""
    from gpuwatch.recording.reader import TablesReader
    from gpuwatch.recording.source import ReplaySource

    src = Path(src)
    meta, t = _read(src)
    out = []
    for cap in _caps(meta, t):
        name = Path(f"{src.name}@{cap / 2**30:.2f}GiB")
        r, m, tables = relabeled(meta, t, cap, name, src.name, scenario)
        out.append((r, ReplaySource(name, reader=TablesReader(name, m, tables))))
    return out


def _caps(meta: dict[str, Any], t: dict[str, pl.DataFrame]) -> list[int]:
    """The virtual caps a session is copied under (`caps_for`); none for a copy, a session with no steps, or
    several workloads (a cap is per GPU)."""
    if meta.get("derived"):
        return []
    steps = t["steps"]
    if steps.is_empty():
        return []
    if steps["gpu"].drop_nulls().n_unique() > 1:
        return []  # one workload per session only (a cap is per GPU)
    caps = recorded_caps(meta)
    gpus = meta.get("gpus") or []
    total = gpus[0].get("mem_total_bytes") if gpus and isinstance(gpus[0], dict) else None
    return caps_for(steps, next(iter(caps.values()), None), total)


def validate(sessions: list[Path]) -> dict[str, Any]:
    """How well the relabeling rule reproduces what real caps did, on real capped sessions:
    - steps that ran under a real cap and that the rule would have failed (false virtual OOMs);
    - real OOMs whose failing shape ran elsewhere (same preset, mode, precision, batch, sequence
      length; not a leak): does that shape's peak exceed the usable limit of the cap it failed under?
    Peaks are also reported as fractions of the cap, for both, so the margin can be read off.
    A session the reader refuses is left out (training says why once, where it skips it)."""
    from gpuwatch.errors import RecordingError

    table: dict[tuple, float] = {}
    runs = []
    for p in sessions:
        try:
            meta, t = _read(Path(p))
        except RecordingError:
            continue
        if meta.get("derived"):
            continue
        w = ((meta.get("config") or {}).get("workloads") or [{}])[0]
        if not isinstance(w, dict) or (w.get("faults") or {}).get("leak_mib"):
            continue
        st, ev = t["steps"], t["events"]
        if not st.height:
            continue
        key0 = (w.get("preset"), w.get("mode"), tuple(sorted((w.get("overrides") or {}).items())))
        for r in st.group_by(["precision", "batch", "seq_len"]).agg(pl.col("torch_peak_bytes").max()).iter_rows():
            if r[3]:
                k = key0 + tuple(r[:3])
                table[k] = max(table.get(k, 0.0), float(r[3]))
        cap = recorded_caps(meta).get(w.get("gpu_index", 0))
        if cap:
            runs.append((p.name, key0, cap, st, ev))
    false_ooms = steps_n = 0
    ok_fracs, oom_fracs, reproduced, known, unknown = [], [], 0, 0, 0
    for name, key0, cap, st, ev in runs:
        peaks = st["torch_peak_bytes"].cast(pl.Float64).drop_nulls().to_numpy()
        steps_n += peaks.size
        false_ooms += int((peaks > usable_limit(cap)).sum())
        ok_fracs += (peaks / cap).tolist()
        for msg in ev.filter(pl.col("kind") == "oom")["message"].to_list():
            shape = _shape_of(msg)
            pk = table.get(key0 + shape) if shape else None
            if pk is None:
                unknown += 1
                continue
            known += 1
            oom_fracs.append(pk / cap)
            reproduced += pk > usable_limit(cap)
    q = lambda v, p: round(float(np.percentile(v, p)), 4) if v else None  # noqa: E731
    return {"capped_sessions": len(runs), "steps_under_real_caps": steps_n, "false_virtual_ooms": false_ooms,
            "step_peak_over_cap_max": q(ok_fracs, 100), "step_peak_over_cap_p99": q(ok_fracs, 99),
            "real_ooms_with_known_peak": known, "real_ooms_reproduced": reproduced, "real_ooms_peak_unknown": unknown,
            "real_oom_peak_over_cap_min": q(oom_fracs, 0), "real_oom_peak_over_cap_median": q(oom_fracs, 50),
            "usable_fraction_of_cap": None}


def _shape_of(msg: str) -> tuple | None:
    """(precision, batch, seq_len) from 'CUDA OOM at batch 15 x 512 (bf16)'."""
    import re

    m = re.search(r"batch (\d+) x (\d+) \((\w+)\)", msg or "")
    return (m.group(3), int(m.group(1)), int(m.group(2))) if m else None
