#!/usr/bin/env bash
# Issue #10, call 19 (one H200, ~4.5 minutes), from a snapshot of one commit (see device_run11.sh): the
# sampler child's 10 Hz loop in C (telemetry/_ticker.c) on the real driver, and its cost:
#   load     the C loop compiles and loads here (gcc)
#   tests    tests/test_gpu.py (NVML on a real GPU) and tests/test_ticker.py (C loop vs Python loop, fake NVML)
#   check    benchmarks/sampler_loop_check.py: `gpuwatch record` with the C loop and with the Python loop at
#            once on the real GPU: same columns, same nulls, 10 Hz, consecutive ticks
#   cost_k   bench_sampler.py cost --seconds 90 --gpus 1 --variants side-by-side, twice: `gpuwatch record`
#            (C loop), the same with GPUWATCH_SAMPLER_LOOP=python, PCIe every 1 s, --sampler thread,
#            nvidia-smi -lms 100, a bare pynvml loop; CPU from schedstat (ns)
set -u
R=/tmp/results19; mkdir -p $R
. benchmarks/device_env.sh
T0=$(date +%s)
echo "tree $(cat REV 2>/dev/null)" | tee $R/tree.txt
python3 -c "from gpuwatch.telemetry import ticker; ticker.load(); print('C loop loads')" 2>&1 | tee $R/load.txt
EXT=txt stage tests 90 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_ticker.py -rA
grep -E "PASSED|FAILED|^E |passed|failed" $R/tests.txt | tail -n 12
stage check 60 python3 benchmarks/sampler_loop_check.py 8s
head -c 700 $R/check.json; echo
for k in 1 2; do
  stage cost_$k 120 python3 benchmarks/bench_sampler.py cost --seconds 90 --gpus 1 --variants side-by-side
  head -c 1100 $R/cost_$k.json; echo
done
echo "total $(( $(date +%s) - T0 )) s"
tar czf $OUT/results19.tgz -C /tmp results19
