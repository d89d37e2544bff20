"""The C sampler loop against the Python loop on a real GPU: `gpuwatch record --no-model` twice at once (the
default loop, and GPUWATCH_SAMPLER_LOOP=python), read back; prints which loop each ran, rows, columns and,
per column, how many values are null in each. Run on the GPU machine (`bash benchmarks/gpu.sh cloop`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    seconds = sys.argv[1] if len(sys.argv) > 1 else "6s"
    work = Path(tempfile.mkdtemp(prefix="gw-loopcheck-"))
    runs = {}
    for name, env in (("c", {}), ("python", {"GPUWATCH_SAMPLER_LOOP": "python"})):
        runs[name] = subprocess.Popen([sys.executable, "-m", "gpuwatch", "record", "--no-model", "--duration", seconds,
                                       "-o", str(work / name)], cwd=ROOT, env=dict(os.environ, **env),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    from gpuwatch.recording.reader import open_recording

    out = {}
    for name, p in runs.items():
        _, err = p.communicate(timeout=120)
        session = next(d for d in (work / name).iterdir() if (d / "meta.json").exists())
        meta = json.loads((session / "meta.json").read_text())
        df = open_recording(session).samples
        iv = df["sampler_interval_us"].drop_nulls()
        out[name] = {"rc": p.returncode, "stderr_tail": err[-300:], "sampler_loop": meta.get("sampler_loop"),
                     "note": meta.get("sampler_loop_note"), "rows": df.height, "columns": df.columns,
                     "nulls": {c: df[c].null_count() for c in df.columns},
                     "interval_ms_p50": round(iv.quantile(0.5) / 1000, 2) if iv.len() else None,
                     "ticks_consecutive": bool((df["tick"].diff().drop_nulls() == 1).all()),
                     "last_row": {c: str(df[c][-1])[:60] for c in df.columns}}
    c, py = out["c"], out["python"]
    summary = {"loops": [c["sampler_loop"], py["sampler_loop"]], "rows": [c["rows"], py["rows"]],
               "same_columns": c["columns"] == py["columns"],
               "null_differences": {k: (c["nulls"][k], py["nulls"].get(k)) for k in c["nulls"]
                                    if c["nulls"][k] != py["nulls"].get(k)},
               "interval_ms_p50": [c["interval_ms_p50"], py["interval_ms_p50"]],
               "ticks_consecutive": [c["ticks_consecutive"], py["ticks_consecutive"]]}
    print(json.dumps({"summary": summary, "runs": out}, indent=1))


if __name__ == "__main__":
    main()
