#!/usr/bin/env bash
# Issue #10, call 16 (final; nvidia-h200-x2 when lent, else one H200: the 2-GPU stage is skipped), from a
# snapshot of one commit (see device_run11.sh). Every stage time-limited, ~6 minutes in all:
#   kernels  tests/test_kernels.py compiled on the GPU; gputest: tests/test_decode.py -m gpu (the compile fix)
#   cost1    bench_sampler.py cost --gpus 1, twice (run-to-run spread): `gpuwatch record` (PCIe every 2 s, the
#            default now) beside the same with PCIe every 1 s, nvidia-smi -lms 100, a bare pynvml loop, ...
#   cost2    (2 GPUs) the same over both GPUs, and a GPU-0-only record beside: the cost of one more GPU
#   profile  bench_sampler.py profile --gpus 1 (host_cpu_pct source and PCIe cadence on its last line)
#   decode   bench_decode.py fast arm 32x512+128 (the final tree's kernels: int64 offsets)
#   stress   `gpuwatch stress --preset v2-lite --mode decode --batch 32` as a user runs it, recorded
set -u
R=/tmp/results16; mkdir -p $R
. benchmarks/device_env.sh
T0=$(date +%s)
echo "tree $(cat REV 2>/dev/null)" | tee $R/tree.txt
nvidia-smi --query-gpu=index,name,driver_version,memory.used --format=csv | tee $R/gpus.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1 | tee $R/env.txt
python3 -c "from gpuwatch.telemetry.host import HostSampler; print('host_cpu_pct source:', HostSampler().cpu_source)" 2>&1 | tee -a $R/env.txt
NG=$(nvidia-smi -L | wc -l)
EXT=txt stage kernels 90 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py
tail -n 2 $R/kernels.txt
EXT=txt stage gputest 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_decode.py -rA
grep -E "PASSED|FAILED|^E |passed|failed" $R/gputest.txt | tail -n 12
for k in 1 2; do
  stage cost1_$k 75 python3 benchmarks/bench_sampler.py cost --seconds 45 --gpus 1
  head -c 1100 $R/cost1_$k.json; echo
done
if [ "$NG" -ge 2 ]; then
  stage cost2 75 python3 benchmarks/bench_sampler.py cost --seconds 45
  head -c 1300 $R/cost2.json; echo
fi
EXT=txt stage profile 40 python3 benchmarks/bench_sampler.py profile --seconds 20 --gpus 1 --json $R/sampler_profile.json
head -n 48 $R/profile.txt
stage decode 90 python3 benchmarks/bench_decode.py --preset v2-lite --precision bf16 --decode 32x512+128 \
  --prefill "" --arms fast --seconds 3 --budget 60 --out $R/decode_partial.json
tail -n 4 $R/decode.err
stage stress 80 python3 -m gpuwatch stress --preset v2-lite --mode decode --batch 32 --duration 45s --no-model \
  -o /tmp/rec16 --summary-json $R/stress_summary.json
REC=/tmp/rec16 python3 benchmarks/stress_check.py > $R/stress_check.json 2>&1; head -c 700 $R/stress_check.json; echo
echo "total $(( $(date +%s) - T0 )) s"
tar czf $OUT/results16.tgz -C /tmp results16
