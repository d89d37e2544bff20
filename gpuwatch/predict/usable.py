"""What a usable session is, for `gpuwatch score` and `gpuwatch train` alike: one rule, said in one line.

A recorded session is usable for the risk model when
1. it opens: a folder (or one Parquet file) whose meta.json is a gpuwatch object of a readable schema
   version and whose samples can be read (the reader's own one-line refusals: no such folder, a symbolic
   link loop, meta.json a list, ...);
2. it holds samples of at least one GPU: the model predicts a GPU's memory running out, and a CPU-only
   session (NVML unavailable, a gloo run) has no GPU memory to score nor healthy GPU time to learn from;
3. where it ran a workload (meta.json's config lists one), its steps table is there and reads: the step
   figures are half the features (the next step's peak, the plan) and where each failure's warning ends,
   so a session without them would be scored blind and teach the model moments no live run has.

`score` refuses an unusable session with that line (exit 1, as replay and report refuse an unreadable one);
`train` refuses one it was named the same way, and skips one it found under a folder it was given (or in
the shipped set), saying the same line. A session whose meta.json lists no workload (`watch`, `record`) or
that is one file has no steps to miss.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from gpuwatch.errors import RecordingError
from gpuwatch.recording.layout import table_files
from gpuwatch.recording.source import ReplaySource

__all__ = ["Unusable", "open_usable", "why_unusable"]


class Unusable(RecordingError):
    """A session the risk model cannot use: one line naming the session and why."""


def open_usable(path: Path | str) -> ReplaySource:
    """The session at `path`, opened as replay opens it, if it is usable (see the module's rule);
    else Unusable (one line naming the session)."""
    try:
        src = ReplaySource(path)
    except RecordingError as e:
        raise Unusable(str(e)) from None
    why = why_unusable(src)
    if why:
        raise Unusable(f"{src.reader.path}: {why}")
    return src


def why_unusable(src: ReplaySource) -> str | None:
    """Rules 2 and 3 on an opened session: None where it is usable, else why not (a clause)."""
    if not any(g.index is not None and _has_samples(src, g.index) for g in src.gpus):
        note = src.reader.meta.get("gpu_note")
        return ("no GPU in its samples: a CPU-only session"
                + (f" ({note})" if isinstance(note, str) and note else "") + "; there is no GPU memory to score")
    return _steps_problem(src)


def _has_samples(src: ReplaySource, gpu: int) -> bool:
    ts = src.times(gpu)
    return ts is not None and ts.size > 0


def _steps_problem(src: ReplaySource) -> str | None:
    meta = src.reader.meta
    cfg = c if isinstance(c := meta.get("config"), dict) else {}
    if meta.get("single_file") or not (cfg.get("workloads") or []):
        return None  # no workload ran (or one file: nothing beside it to say so)
    if not src.steps_df.is_empty():
        return None
    try:
        files = table_files(src.reader.path, "steps")
    except OSError as e:
        return f"its steps table cannot be listed ({os.strerror(e.errno or errno.EIO)})"
    if not files:
        return "it ran a workload but has no steps table (steps.parquet missing): no step figures to score or learn from"
    bad = [w for w in src.reader.warnings if any(w.startswith(str(f)) for f in files)]
    if bad:
        return "its steps table cannot be read (" + "; ".join(w.removeprefix(f"{src.reader.path}{os.sep}")
                                                              for w in bad) + ")"
    return None  # read, and empty: the workload ran no step (an OOM on the first, say)
