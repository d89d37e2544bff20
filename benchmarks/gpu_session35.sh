#!/usr/bin/env bash
# Session 35's H200 calls, several issues' measurements in one call each (device time is scarce; each part
# is its own script, run here in sequence, never side by side, so no part's figures are another's):
#   b: issue 30's baseline profile (gpu_stress_speed.sh, ~200 s), issue 29's blind held-out set of seed 2901
#      (gpu_heldout.sh, 8 scenarios, ~185 s), issue 28's no-cap pairs (unguarded / planner interleaved, 30 steps)
#   c: issue 30's switches beside the baseline (train, prefill), then the switches' GPU tests
#   d: issue 29's blind held-out set (SEED 2902, N 12 scenarios in 2 waves, SECS 90, HD=400 s), then with what is left of
#      TOTAL (480 s) issue 31's 1,000-session fit on 16 cores (bench_train.py --copies 20 --jobs 16 --no-eval)
#   run (repo root, carry .dev):  bash benchmarks/gpu_session35.sh b|c|d
set -u
R=${OUT:-/tmp/out}; mkdir -p "$R"
case "${1:?b, c or d}" in
b)
  OUT="$R/profile" LIMIT_S=200 BUDGET_S=170 bash benchmarks/gpu_stress_speed.sh 2>&1 | tail -n 30
  echo "== heldout $(date +%T)"
  OUT="$R" HELDOUT_DEADLINE_S=160 timeout 185 bash benchmarks/gpu_heldout.sh 2901 8 60 2>&1 | tail -n 14
  echo "== nocap pairs $(date +%T)"
  . benchmarks/device_env.sh
  timeout 190 python3 benchmarks/planner_curriculum.py --out "$R/nocap" --work /tmp/gw-nocap --arm-timeout 50 \
    --nocap-steps 30 --arms "unguarded-nocap,planner-nocap,unguarded-nocap#2,planner-nocap#2" > "$R/nocap.jsonl" 2> "$R/nocap.err"
  echo "rc=$? $(date +%T)"; cut -c1-420 "$R/nocap.jsonl"
  tar czf "$R/nocap-sessions.tgz" -C "$R/nocap" sessions 2>/dev/null; rm -rf "$R/nocap/sessions" /tmp/gw-nocap
  ;;
c)
  OUT="$R/switches" MODES=train,prefill PRESET_BUDGET_S=105 LIMIT_S=240 BUDGET_S=215 EXTRA='--profile-steps 0' \
    VARIANTS=baseline,experts=gw-grouped,attention=sdpa-flash,lean=on,optimizer=adamw-fused,experts=gw-grouped+attention=sdpa-flash+lean=on,compile=moe,attention=flex,compile=layer \
    bash benchmarks/gpu_stress_speed.sh 2>&1 | tail -n 30
  echo "== gpu tests $(date +%T)"
  . benchmarks/device_env.sh
  timeout 150 python3 -m pytest -q -m gpu tests/test_workload_tuning.py -x -p no:cacheprovider > "$R/gpu_tests.txt" 2>&1
  echo "rc=$? $(date +%T)"; tail -n 15 "$R/gpu_tests.txt"
  ;;
d)
  T0=$SECONDS
  OUT="$R" HELDOUT_DEADLINE_S=${HD:-400} timeout $(( ${HD:-400} + 25 )) bash benchmarks/gpu_heldout.sh ${SEED:-2902} ${N:-12} ${SECS:-90} 2>&1 | tail -n 14
  left=$(( ${TOTAL:-480} - (SECONDS - T0) ))
  echo "== train, 1,000 sessions on 16 cores: ${left} s left $(date +%T)"
  . benchmarks/device_env.sh
  if [ "$left" -gt 70 ]; then
    timeout $((left - 10)) python3 benchmarks/bench_train.py --copies 20 --jobs 16 --no-eval > "$R/train_1000.json" 2> "$R/train_1000.err"
    echo "rc=$? $(date +%T)"; cat "$R/train_1000.json"; tail -n 3 "$R/train_1000.err"
  fi
  ;;
esac
