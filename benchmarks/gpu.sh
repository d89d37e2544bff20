#!/usr/bin/env bash
# The one GPU benchmark runner: `bash benchmarks/gpu.sh STAGE [STAGE ...]` on the GPU machine, from the
# project root, with the wheels the machine lacks in .whl/ (../shared/tools/device-wheels.sh). Each stage
# writes under $R; everything is packed into $OUT/gpu-<stages>.tgz at the end (the device tool brings back
# at most 8 files). Figures go to docs/BENCHMARKS.md with the command, raw files to benchmarks/results/.
#
# Stages:
#   nearcap     healthy running at 90-97 % of a memory cap, 8 capped workloads side by side with
#               --guard observe (benchmarks/nearcap.py; ~9 minutes): issue 20's training data
#   tests       the GPU test suite in one process (tests marked gpu)
#   library     the guard in users' loops: plain PyTorch and HF Trainer ramps, healthy, fragment and leak,
#               unguarded vs guarded under a calibrated cap (benchmarks/guard_library.py; <= 4 minutes;
#               the HF Trainer needs accelerate: ../shared/tools/device-wheels.sh accelerate==1.15.0)
set -u
T0=$(date +%s)
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
R=/tmp/gpu-results; mkdir -p $R
. benchmarks/device_env.sh
echo "tree $(git rev-parse --short HEAD 2>/dev/null || cat REV 2>/dev/null)" | tee $R/tree.txt
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt

stage_nearcap() {
  python3 benchmarks/nearcap.py --seconds "${NEARCAP_S:-520}" --out /tmp/nearcap 2>&1 | tee $R/nearcap.txt
  cp /tmp/nearcap/nearcap.json /tmp/nearcap/nvidia-smi.csv $R/ 2>/dev/null
  tar czf "$OUT/nearcap-sessions.tgz" -C /tmp/nearcap sessions calib logs 2>/dev/null
}
stage_tests() {
  EXT=txt stage gputests 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ -rA
  grep -E "PASSED|FAILED|^E |passed|failed" $R/gputests.txt | tail -n 20
}
stage_library() {
  EXT=txt stage guard_library 250 python3 benchmarks/guard_library.py --out $R/guard_library.json \
    --sessions /tmp/guard-library-sessions --budget-s 200
  tail -n 1 $R/guard_library.txt
  tar czf "$OUT/guard-library-sessions.tgz" -C /tmp guard-library-sessions --exclude='hf-*' 2>/dev/null
}

for s in "$@"; do
  echo "== stage $s $(date +%T)"
  "stage_$s"
done
echo "total $(( $(date +%s) - T0 )) s"
tar czf "$OUT/gpu-$(IFS=-; echo "$*").tgz" -C /tmp gpu-results
