#!/usr/bin/env bash
# The GPU figures still owed (issue 2's sampler cost, issue 3's cost of watching), in one call:
# where the sampler's CPU goes (per piece, per thread), the side-by-side cost against nvidia-smi and
# pynvml, jitter on this tree, and the watched/bare ABBA pairs. About 7 minutes on one H200.
#   bash benchmarks/device_run4.sh              (nvidia-h200, .whl carried)
# On nvidia-h200-x2 it also runs one workload per GPU (`--gpus all`) for 60 s and records it:
#   bash benchmarks/device_run4.sh multi
set -u
R=/tmp/results4; S=/tmp/sessions4; mkdir -p $R $S
. benchmarks/device_env.sh
nvidia-smi --query-gpu=index,name,driver_version,power.limit --format=csv > $R/gpus.txt
if [ "${1:-}" = multi ]; then
  stage gpus_all 150 python3 -m gpuwatch stress --gpus all --preset small --mode train --schedule ramp --duration 60s -o $S/multi
else
  stage parts 90 python3 benchmarks/bench_sampler.py parts
  stage threads 60 python3 benchmarks/bench_sampler.py threads --seconds 40
  stage cost 100 python3 benchmarks/bench_sampler.py cost --seconds 60
  stage jitter 80 python3 benchmarks/bench_sampler.py jitter --seconds 30
  stage overhead 300 python3 benchmarks/bench_workload.py overhead --pairs 12 --window 6
fi
cat $R/*.json 2>/dev/null | head -c 6000
tar czf $OUT/results4.tgz -C /tmp results4 sessions4
