#!/usr/bin/env bash
# Issue #10, call 18 (one H200, ~5 minutes), from a snapshot of one commit (see device_run11.sh):
#   gputest  tests/test_decode.py -m gpu: every CPU variant (query LoRA, group-limited routing, normalised and
#            scaled top-k, no interleave) on CUDA fp32 with the Triton kernels compiled = transformers' tokens
#   v3       bench_decode.py --preset v3-slice (DeepSeek-V3 widths: 128 heads, 256 experts, group routing)
#            decode 16x512+128: fast (auto: the model's experts at this batch), fast-dense, fast-unfused, eager
#   cost     bench_sampler.py cost --seconds 90 --gpus 1 --variants side-by-side: `gpuwatch record` (child
#            process) and `record --sampler thread` (no child, no pipe), PCIe every 1 s, nvidia-smi, pynvml
set -u
R=/tmp/results18; mkdir -p $R
. benchmarks/device_env.sh
T0=$(date +%s)
echo "tree $(cat REV 2>/dev/null)" | tee $R/tree.txt
EXT=txt stage gputest 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_decode.py -rA -k "fused_kernels_compiled or fp32"
grep -E "PASSED|FAILED|^E |passed|failed" $R/gputest.txt | tail -n 14
stage v3 150 python3 benchmarks/bench_decode.py --preset v3-slice --precision bf16 --decode 16x512+128 \
  --prefill "" --arms fast,fast-dense,fast-unfused,eager --seconds 3 --eager-reps 1 --budget 100 --out $R/v3_partial.json
tail -n 9 $R/v3.err
stage cost 120 python3 benchmarks/bench_sampler.py cost --seconds 90 --gpus 1 --variants side-by-side
head -c 1000 $R/cost.json; echo
echo "total $(( $(date +%s) - T0 )) s"
tar czf $OUT/results18.tgz -C /tmp results18
