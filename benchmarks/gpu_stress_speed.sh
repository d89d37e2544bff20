#!/usr/bin/env bash
# Issue 30's H200 call: where the stress workload's time goes (benchmarks/gpu_profile.py), every preset and
# mode, the baseline and the `workload.tuning` switches (VARIANTS), results under $OUT (profile.md,
# profile.jsonl, profile.err, gpu.csv, versions.txt). Fits a device call: the profile stops starting runs
# after BUDGET_S (200) and is killed at LIMIT_S (230).
#   run (repo root, carry .dev):  bash benchmarks/gpu_stress_speed.sh
#   env: PRESETS="v2-lite v3-slice"  MODES=train,prefill,decode  VARIANTS=baseline  EXTRA="--steps 3"
#        PRESET_BUDGET_S=N (start no run of a preset after N s of it: both presets get their share)
#   the switches (call B of session 35; now benchmarks/gpu_session38.sh style scripts): VARIANTS=baseline,attention=sdpa-flash,... MODES=train,prefill
set -u
R=${OUT:-/tmp/out}; mkdir -p "$R"
if [ -f .dev/site312.tar.xz ] || ls .whl/*.whl > /dev/null 2>&1; then
  . benchmarks/device_env.sh
else
  export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,power.limit,clocks.max.sm --format=csv > "$R/gpu.csv" 2>&1
python3 -c "import torch, transformers; print(torch.__version__, torch.version.cuda, transformers.__version__)" > "$R/versions.txt" 2>&1
presets=""
for p in ${PRESETS:-v2-lite v3-slice}; do presets="$presets --preset $p"; done
echo "== gpu_profile $(date +%T) presets:${presets} modes=${MODES:-train,prefill,decode} variants=${VARIANTS:-baseline}"
timeout "${LIMIT_S:-230}" python3 benchmarks/gpu_profile.py $presets --modes "${MODES:-train,prefill,decode}" \
  --variants "${VARIANTS:-baseline}" --budget-s "${BUDGET_S:-200}" ${PRESET_BUDGET_S:+--preset-budget-s $PRESET_BUDGET_S} \
  --out "$R" ${EXTRA:-} > "$R/profile.stdout" 2> "$R/profile.err"
echo "rc=$? $(date +%T)"
cat "$R/versions.txt" "$R/gpu.csv"
grep -v '^USDT' "$R/profile.err" | tail -n 8
[ -f "$R/profile.md" ] && sed -n '1,20p' "$R/profile.md"
