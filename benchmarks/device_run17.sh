#!/usr/bin/env bash
# Issue #10, call 17 (one H200, ~3.5 minutes), from a snapshot of one commit (see device_run11.sh): the
# sampler's cost measured more precisely than calls 13-16 (which spread 0.44-0.58 % run to run):
#   cost_k   bench_sampler.py cost --seconds 90 --gpus 1 --variants side-by-side, twice: `gpuwatch record`
#            (default: PCIe every 2 s) and with PCIe every 1 s, beside nvidia-smi -lms 100 and a bare pynvml
#            loop only (no bash loop starting nvidia-smi 10x/s beside them), CPU from schedstat (ns), not
#            10 ms clock ticks
set -u
R=/tmp/results17; mkdir -p $R
. benchmarks/device_env.sh
T0=$(date +%s)
echo "tree $(cat REV 2>/dev/null)" | tee $R/tree.txt
for k in 1 2; do
  stage cost_$k 120 python3 benchmarks/bench_sampler.py cost --seconds 90 --gpus 1 --variants side-by-side
  head -c 900 $R/cost_$k.json; echo
done
echo "total $(( $(date +%s) - T0 )) s"
tar czf $OUT/results17.tgz -C /tmp results17
