#!/usr/bin/env bash
# Issue #10 (speed), one call on one H200, <= ~7 minutes, every stage time-limited:
#   memory   nvidia-smi's memory.used vs gpuwatch's (NVML v2) and NVML v1, idle GPU (first: nothing loaded)
#   parts    the sampler's CPU per piece (batched field values, v2 memory, /proc host slow read, fake-NVML tick)
#   gputest  the CUDA-graph decode tests (tests/test_decode.py -m gpu), if pytest is installed here
#   decode   bench_decode.py: v2-lite bf16 decode 32x512+16 and prefill 1/4/8 x 512, eager vs static cache +
#            CUDA graphs (tokens/s, GPU util, power, CPU %, capture s, bandwidth bound); then 32x512+64 if
#            time is left
#   cost     bench_sampler.py cost --seconds 60: gpuwatch record vs nvidia-smi -lms 100 vs a pynvml loop
#   bash benchmarks/device_run5.sh        (nvidia-h200, .whl carried); results in $OUT/results5.tgz
set -u
R=/tmp/results5; mkdir -p $R
. benchmarks/device_env.sh
T0=$(date +%s)
nvidia-smi --query-gpu=index,name,driver_version,power.limit,memory.used,memory.reserved,memory.total --format=csv > $R/gpus.txt 2>&1
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.is_available())" > $R/versions.txt 2>&1
cat $R/gpus.txt $R/versions.txt
stage memory 25 python3 benchmarks/bench_sampler.py memory
stage parts 50 python3 benchmarks/bench_sampler.py parts
if python3 -c "import pytest" 2>/dev/null; then
  EXT=txt stage gputest 75 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_decode.py -rA
else
  echo "== gputest skipped: no pytest on this machine (bench_decode checks tokens against eager instead)"
fi
stage decode 190 python3 benchmarks/bench_decode.py --preset ${PRESET:-v2-lite} --precision ${PRECISION:-bf16} --decode 32x512+16 \
  --prefill 1x512,4x512,8x512 --late 32x512+64 --seconds 6 --budget 130 --out $R/decode_partial.json
tail -n 25 $R/decode.err
stage cost 100 python3 benchmarks/bench_sampler.py cost --seconds 60
echo "total $(( $(date +%s) - T0 )) s"
for f in memory parts cost; do echo "--- $f"; head -c 2500 $R/$f.json; echo; done
tar czf $OUT/results5.tgz -C /tmp results5
