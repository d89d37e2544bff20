#!/usr/bin/env bash
# Issue #10, call 12 (one H200, <= ~9.5 minutes), from a snapshot of one commit (see device_run11.sh):
#   decode   bench_decode.py v2-lite bf16 32x512+128: fast (torch.compile'd one-token step in the graph) vs
#            fast-nocompile (call 11's fast arm); then 16x512+128 fast (the compile a guard's batch change
#            costs); per-kernel profile of the compiled step at 32x512+128
#   stress   `gpuwatch stress --preset v2-lite --mode decode --batch 32` as a user runs it, 60 s, recorded
#   gputest  tests/test_decode.py -m gpu (fp32 plain/compiled vs transformers on CUDA, graphs replay exactly)
set -u
R=/tmp/results12; mkdir -p $R
. benchmarks/device_env.sh
T0=$(date +%s)
echo "tree $(cat REV 2>/dev/null)" | tee $R/tree.txt
stage decode 290 python3 benchmarks/bench_decode.py --preset v2-lite --precision bf16 --decode 32x512+128 \
  --prefill "" --late 16x512+128 --arms fast,fast-nocompile --seconds 5 --budget 200 \
  --profile 32x512+128 --profile-arms fast-compiled --out $R/decode_partial.json
tail -n 30 $R/decode.err
stage stress 120 python3 -m gpuwatch stress --preset v2-lite --mode decode --batch 32 --duration 60s --no-model \
  -o /tmp/rec12 --summary-json $R/stress_summary.json
REC=/tmp/rec12 python3 benchmarks/stress_check.py > $R/stress_check.json 2>&1; head -c 1500 $R/stress_check.json
left=$(( 560 - ($(date +%s) - T0) ))
EXT=txt stage gputest $(( left > 30 ? left : 30 )) python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_decode.py -rA -s
grep -E "PASS|FAIL|Error|agreement|passed|failed" $R/gputest.txt | tail -n 15
echo "total $(( $(date +%s) - T0 )) s"
tar czf $OUT/results12.tgz -C /tmp results12
