#!/usr/bin/env bash
# Everything measured on the GPU machine for issues 2 and 3, in one call (device time is scarce).
# Run from the repo root there, with .whl carried:  bash benchmarks/device_run.sh
# Writes $OUT/results.tgz (one JSON per stage + info.txt + log) and $OUT/sessions.tgz (recordings).
set -u
R=/tmp/results; S=/tmp/sessions; mkdir -p $R $S
EXT=json
. benchmarks/device_env.sh
{ nvidia-smi; python3 -m gpuwatch info; } > $R/info.txt 2>&1
# a background recording of the whole run: real data for the bytes-per-sample figure
python3 -m gpuwatch record -o $S/bg > $R/bg.txt 2>&1 & BG=$!
stage cost 120 python3 benchmarks/bench_sampler.py cost --seconds ${COST_S:-45}
stage jitter 90 python3 benchmarks/bench_sampler.py jitter --seconds ${JITTER_S:-20}
stage sweep 150 python3 benchmarks/bench_workload.py sweep --record $S
stage overhead 150 python3 benchmarks/bench_workload.py overhead --pairs ${PAIRS:-4} --window 8
stage oom 120 python3 benchmarks/bench_workload.py oom --batch 8 --big-batch 64 --record $S
stage ramp 150 python3 benchmarks/bench_workload.py ramp --batch 8 --seconds ${RAMP_S:-80} --record $S
kill -TERM $BG; wait $BG; cat $R/bg.txt
python3 - <<'PY' > $R/bg_bytes.json
import json, pathlib, polars as pl
for d in pathlib.Path("/tmp/sessions/bg").iterdir():
    f = d / "samples.parquet"; n = pl.read_parquet(f).height; b = f.stat().st_size
    print(json.dumps({"session": d.name, "rows": n, "bytes": b, "bytes_per_gpu_sample": round(b / n, 2),
                      "mb_per_gpu_day_10hz": round(b / n * 864000 / 1e6, 2)}))
PY
cat $R/bg_bytes.json
tar czf $OUT/results.tgz -C /tmp results
tar czf $OUT/sessions.tgz -C /tmp sessions
ls -la $OUT
