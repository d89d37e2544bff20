# Sourced by the session scripts (benchmarks/gpu_session38.sh, gpu_session39.sh) after `set -u`, with the part
# letter as $1: $R (the results, $OUT), `left` (seconds left of TOTAL, 540 by default, since the start), $PY, and
# either the device's environment (benchmarks/device_env.sh: the carried wheels; the GPU and versions written
# under $R) or, with DRY=1, the CPU dry run's (this checkout on PYTHONPATH). Prints and keeps the tree's commit.
R=${OUT:-/tmp/out}; mkdir -p "$R"
T0=$SECONDS
left() { echo $(( ${TOTAL:-540} - (SECONDS - T0) )); }
if [ -z "${DRY:-}" ]; then
  . benchmarks/device_env.sh
  nvidia-smi --query-gpu=name,memory.total,driver_version,power.limit --format=csv,noheader > "$R/gpu.txt" 2>&1
  python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" > "$R/versions.txt" 2>&1
else
  export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
fi
PY=${PYTHON:-python3}
echo "tree $(cat REV 2>/dev/null || git rev-parse --short HEAD 2>/dev/null) part $1 $(date +%T)" | tee "$R/tree.txt"
