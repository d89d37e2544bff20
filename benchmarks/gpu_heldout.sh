#!/usr/bin/env bash
# Issue 29's blind held-out sets on the H200: `bash benchmarks/gpu_heldout.sh SEED N_SCENARIOS SECONDS_EACH`
# from the repo root (carry .dev: the wheels, benchmarks/device_env.sh). Draws N scenarios from SEED
# (benchmarks/heldout_gen.py: the plan is a function of the seed alone), records each one unguarded under its
# own --gpu-memory-limit, side by side in waves whose caps fit the card, and packs the sessions, the logs and
# heldout.json (each scenario's exact command, calibrated peak and cap) into $OUT/heldout-SEED.tgz.
# Score them afterwards, here: `python3 -m gpuwatch eval --set DIR --per-session` (docs/BENCHMARKS.md).
# HELDOUT_DEADLINE_S (540): the wall time of the whole set - a device call has 600 s; later waves run shorter.
# HELDOUT_DRY=1: the CPU dry run (tiny preset, a toy loop model, no caps).
set -u
SEED=${1:?SEED}; N=${2:-10}; SECS=${3:-120}
OUT=${OUT:-/tmp/heldout-out}; mkdir -p "$OUT"
W=/tmp/heldout-$SEED; rm -rf "$W"; mkdir -p "$W"
if [ -z "${HELDOUT_DRY:-}" ]; then
  . benchmarks/device_env.sh
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$W/gpu.txt" 2>&1
  # a wave's slots add up to 94 % of this card (132 GiB on an H200, 74 on an H100: the 132 default put a 130 GiB
  # wave on an H100 in session 45); HELDOUT_BUDGET_GIB overrides
  MEM_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
  BUDGET=${HELDOUT_BUDGET_GIB:-$(( ${MEM_MIB:-143771} * 94 / 100 / 1024 ))}
  DRY=
else
  export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
  DRY=--dry-run
  BUDGET=${HELDOUT_BUDGET_GIB:-132}
fi
echo "tree $(cat REV 2>/dev/null || git rev-parse --short HEAD 2>/dev/null)" > "$W/tree.txt"
PY=${PYTHON:-python3}
$PY benchmarks/heldout_gen.py plan --seed "$SEED" -n "$N" --budget-gib "$BUDGET" $DRY > "$W/plan.json" || exit 1
echo "== heldout seed $SEED, $N scenarios x ${SECS}s, waves of ${BUDGET} GiB $(date +%T)"
$PY benchmarks/heldout_gen.py run --seed "$SEED" -n "$N" --seconds "$SECS" --deadline-s "${HELDOUT_DEADLINE_S:-540}" --budget-gib "$BUDGET" --out "$W" $DRY 2>&1 | tee "$W/run.txt"
echo "rc=${PIPESTATUS[0]} $(date +%T)"
tar czf "$OUT/heldout-$SEED.tgz" -C "$W" sessions logs heldout.json plan.json run.txt tree.txt $(cd "$W" && ls gpu.txt nvidia-smi.csv 2>/dev/null)
ls -la "$OUT"
