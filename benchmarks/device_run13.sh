#!/usr/bin/env bash
# Issue #10, call 13 (final; nvidia-h200-x2 when lent, else one H200: the 2-GPU stage is skipped), from a
# snapshot of one commit (see device_run11.sh). Every stage time-limited, ~9 minutes in all:
#   cost1    bench_sampler.py cost --gpus 1: `gpuwatch record` (1 GPU) beside nvidia-smi -lms 100, a bare
#            pynvml loop, a bash loop, record + risk scoring, and record with the sampler pinned to a CPU
#   cost2    (2 GPUs) the same over both GPUs, and a GPU-0-only record beside: the cost of one more GPU
#   profile  bench_sampler.py profile --gpus 1: where a tick's CPU goes now (call 11 was the "before")
#   recorder bench_recorder.py: CPU per flush, Parquet segment vs IPC stream append
#   decode   bench_decode.py v2-lite bf16 fast arm at 32x512+128 and 32x512+16, per-kernel profile
#   stress   `gpuwatch stress --preset v2-lite --mode decode --batch 32` as a user runs it, recorded
#   gputest  tests/test_decode.py -m gpu
set -u
R=/tmp/results13; mkdir -p $R
. benchmarks/device_env.sh
T0=$(date +%s)
echo "tree $(cat REV 2>/dev/null)" | tee $R/tree.txt
nvidia-smi --query-gpu=index,name,driver_version,memory.used --format=csv | tee $R/gpus.txt
NG=$(nvidia-smi -L | wc -l)
stage cost1 75 python3 benchmarks/bench_sampler.py cost --seconds 45 --gpus 1
cat $R/cost1.json | head -c 1500; echo
if [ "$NG" -ge 2 ]; then
  stage cost2 75 python3 benchmarks/bench_sampler.py cost --seconds 45
  cat $R/cost2.json | head -c 1500; echo
fi
EXT=txt stage profile 40 python3 benchmarks/bench_sampler.py profile --seconds 20 --gpus 1 --json $R/sampler_profile.json
head -n 40 $R/profile.txt
stage recorder 30 python3 benchmarks/bench_recorder.py --json $R/recorder.json
tail -n 6 $R/recorder.err
stage decode 130 python3 benchmarks/bench_decode.py --preset v2-lite --precision bf16 --decode 32x512+128 \
  --prefill "" --late 32x512+16 --arms fast --seconds 5 --budget 90 --profile 32x512+128 --profile-arms fast-dense \
  --out $R/decode_partial.json
tail -n 16 $R/decode.err
stage stress 95 python3 -m gpuwatch stress --preset v2-lite --mode decode --batch 32 --duration 50s --no-model \
  -o /tmp/rec13 --summary-json $R/stress_summary.json
REC=/tmp/rec13 python3 benchmarks/stress_check.py > $R/stress_check.json 2>&1; head -c 1200 $R/stress_check.json; echo
left=$(( 545 - ($(date +%s) - T0) ))
EXT=txt stage gputest $(( left > 30 ? left : 30 )) python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_decode.py -rA
grep -E "PASSED|FAILED|Error|passed|failed" $R/gputest.txt | tail -n 12
echo "total $(( $(date +%s) - T0 )) s"
tar czf $OUT/results13.tgz -C /tmp results13
