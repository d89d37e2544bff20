#!/usr/bin/env bash
# Issue #10, call 15 (one H200, ~7 minutes), from a snapshot of one commit (see device_run11.sh):
#   env      triton / torch versions on the GPU machine
#   kernels  tests/test_kernels.py compiled on the GPU (the fused Triton kernels vs the torch ops)
#   gputest  tests/test_decode.py -m gpu (fp32 CUDA fast step = transformers' tokens, now with the kernels)
#   decode   bench_decode.py v2-lite bf16 32x512+128: fast (fused kernels) vs fast-unfused (calls 13-14's step)
#            vs eager, same call; then 32x512+16 (the issue's own step) fast vs eager; per-kernel profiles
#   stress   `gpuwatch stress --preset v2-lite --mode decode --batch 32` as a user runs it, recorded
#   cost1    bench_sampler.py cost --gpus 1 (the sampler as committed at this tree), profile
set -u
R=/tmp/results15; mkdir -p $R
. benchmarks/device_env.sh
T0=$(date +%s)
echo "tree $(cat REV 2>/dev/null)" | tee $R/tree.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1 | tee $R/env.txt
EXT=txt stage kernels 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -rA
grep -E "PASSED|FAILED|^E |passed|failed" $R/kernels.txt | tail -n 20
EXT=txt stage gputest 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_decode.py -rA
grep -E "PASSED|FAILED|^E |passed|failed" $R/gputest.txt | tail -n 14
stage decode 200 python3 benchmarks/bench_decode.py --preset v2-lite --precision bf16 --decode 32x512+128 \
  --prefill "" --late 32x512+16 --arms fast,fast-unfused,eager --seconds 4 --eager-reps 2 --budget 150 \
  --profile 32x512+128 --profile-arms fast-dense,fast-unfused --out $R/decode_partial.json
tail -n 30 $R/decode.err
stage stress 80 python3 -m gpuwatch stress --preset v2-lite --mode decode --batch 32 --duration 45s --no-model \
  -o /tmp/rec15 --summary-json $R/stress_summary.json
REC=/tmp/rec15 python3 benchmarks/stress_check.py > $R/stress_check.json 2>&1; head -c 900 $R/stress_check.json; echo
stage cost1 75 python3 benchmarks/bench_sampler.py cost --seconds 45 --gpus 1
head -c 1500 $R/cost1.json; echo
EXT=txt stage profile 40 python3 benchmarks/bench_sampler.py profile --seconds 20 --gpus 1 --json $R/sampler_profile.json
head -n 45 $R/profile.txt
echo "total $(( $(date +%s) - T0 )) s"
tar czf $OUT/results15.tgz -C /tmp results15
