#!/usr/bin/env bash
# The planner's H200 call (issue 28): the Hugging Face curriculum arms, each in its own process, results under $OUT.
#   run: bash benchmarks/gpu_planner.sh ARMS ARM_TIMEOUT_S [EXTRA...]   (carry .dev: the wheels, benchmarks/device_env.sh)
set -u
R=${OUT:-/tmp/out}; mkdir -p "$R"
. benchmarks/device_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version,power.limit --format=csv > "$R/gpu.csv" 2>&1
python3 -c "import torch, transformers, accelerate; print(torch.__version__, transformers.__version__, accelerate.__version__)" > "$R/versions.txt" 2>&1
arms=${1:-planner,unguarded,static,threshold}; t=${2:-135}; shift 2 || true
echo "== planner_curriculum $arms $(date +%T)"
python3 benchmarks/planner_curriculum.py --out "$R/planner" --arms "$arms" --arm-timeout "$t" "$@" > "$R/planner.jsonl" 2> "$R/planner.err"
echo "rc=$? $(date +%T)"
cat "$R/planner.jsonl" | cut -c1-900
tail -n 5 "$R/planner.err"
rm -rf /tmp/gw-planner
