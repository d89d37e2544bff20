#!/usr/bin/env bash
# Issue #10, call 14 (one H200, ~3.5 minutes), from a snapshot of one commit (see device_run11.sh):
#   gputest  tests/test_decode.py -m gpu (after the capture fall-back change)
#   decode   bench_decode.py v2-lite bf16 32x512+128: eager vs fast (the gate/up GEMM change), same call
#   stress   `gpuwatch stress --preset v2-lite --mode decode --batch 32` as a user runs it, recorded; GPU
#            utilization of the workload's GPU from the recording
set -u
R=/tmp/results14; mkdir -p $R
. benchmarks/device_env.sh
T0=$(date +%s)
echo "tree $(cat REV 2>/dev/null)" | tee $R/tree.txt
EXT=txt stage gputest 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_decode.py -rA -s
grep -E "PASSED|FAILED|^E |passed|failed|fallback" $R/gputest.txt | tail -n 14
stage decode 100 python3 benchmarks/bench_decode.py --preset v2-lite --precision bf16 --decode 32x512+128 \
  --prefill "" --arms fast,eager --seconds 4 --eager-reps 2 --budget 60 --out $R/decode_partial.json
tail -n 5 $R/decode.err
stage stress 80 python3 -m gpuwatch stress --preset v2-lite --mode decode --batch 32 --duration 45s --no-model \
  -o /tmp/rec14 --summary-json $R/stress_summary.json
REC=/tmp/rec14 python3 benchmarks/stress_check.py > $R/stress_check.json 2>&1; head -c 700 $R/stress_check.json; echo
echo "total $(( $(date +%s) - T0 )) s"
tar czf $OUT/results14.tgz -C /tmp results14
