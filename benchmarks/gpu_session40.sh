#!/usr/bin/env bash
# Session 40's H200 calls (each part dry-run on the CPU with DRY=1 before it is spent):
#   a: issue 28 - ramp-train, the planner against the threshold rule, after the below-range estimate (ed76215:
#      3 x 7 weighed in proportion to its tokens); issue 30's decode GPU tests (a batch's memory after the
#      schedule moved); then the no-cap Trainer pairs, interleaved, with what is left of TOTAL
#   b: issue 29 - a blind set of a new seed (2904) after the generator fix (curriculum caps above the first
#      stage, the cache freed before a cap is lowered); then issue 31 - `score` of ten hours, 1 and 16 processes
#   c: issue 30 - v3-slice prefill at its best batch: the baseline and compile=layer at 16, 32, 64 and 128 x 512
#      (45.9 % MFU at 16 with compile=layer, against the 50 % target; the sweep never ran)
#   h: what fits an H100 when no H200 comes: issue 30's decode GPU tests; issue 28's no-cap pairs at 256 -> 2,048
#      tokens (4,096 needs ~99 GiB), 60 steps; issue 31's score of ten hours on 16 cores; then part c's sweep
#   g: the H200's part after h ran on an H100: a's ramp-train, then b's blind set with the rest of TOTAL
#   run (repo root, carry .dev and REV):  bash benchmarks/gpu_session40.sh a|b|c|h|g
set -u
. benchmarks/session_env.sh "${1:?the part: a, b, c, h or g}"
case "${1:?a, b, c, h or g}" in
a|g)
  if [ -z "${DRY:-}" ]; then
    G="--model models/risk.joblib --scenarios ramp-train --seconds ${GSECS:-20} --known-fit ramp-train=20"
    PL="--arm-timeout 60 --nocap-steps 30"
  else
    G="--cpu --scenarios ramp-train --seconds 3"; PL="--dry-run --arm-timeout 120"
  fi
  echo "== bench_guard ramp-train $(date +%T)"
  # shellcheck disable=SC2086  # G is a list of arguments
  timeout ${GT:-150} $PY benchmarks/bench_guard.py $G --arms gpuwatch,gpuwatch-thresholds --record /tmp/s40-guard \
    --out "$R/guard.json" > "$R/guard.txt" 2> "$R/guard.err"
  echo "rc=$? $(date +%T)"; tail -n 6 "$R/guard.txt"; grep -v "Warning\|setter" "$R/guard.err" | tail -n 3
  tar czf "$R/guard-sessions.tgz" --exclude='*.pickle' -C /tmp s40-guard 2>/dev/null; rm -rf /tmp/s40-guard
  if [ "$1" = g ]; then
    t=$(( $(left) - 30 ))
    echo "== blind set ${SEED:-2904}, ${t} s $(date +%T)"
    if [ -z "${DRY:-}" ]; then
      OUT="$R" HELDOUT_DEADLINE_S=$t timeout $(( t + 20 )) bash benchmarks/gpu_heldout.sh ${SEED:-2904} ${N:-5} ${SECS:-200} 2>&1 | tail -n 12
    else
      OUT="$R" HELDOUT_DRY=1 HELDOUT_DEADLINE_S=60 PYTHON=$PY bash benchmarks/gpu_heldout.sh ${SEED:-2904} ${N:-5} 8 2>&1 | tail -n 8
    fi
    echo "part g done in $((SECONDS - T0)) s $(date +%T)"; exit 0
  fi
  M="gpu"; K=""; [ -n "${DRY:-}" ] && M="not gpu" && K="moved_batch"
  echo "== decode GPU tests $(date +%T)"
  timeout ${DT:-120} $PY -m pytest -q -p no:cacheprovider -m "$M" -k "$K" tests/test_decode.py -rA > "$R/decode_tests.txt" 2>&1
  echo "rc=$? $(date +%T)"; grep -E "^(PASSED|FAILED|ERROR)|passed|failed| MiB" "$R/decode_tests.txt" | tail -n 20
  t=$(( $(left) - 10 ))
  echo "== no-cap pairs, ${t} s $(date +%T)"
  # shellcheck disable=SC2086
  timeout "$t" $PY benchmarks/planner_curriculum.py --out "$R/planner" --work /tmp/gw-s40 $PL \
    --arms "${PARMS:-planner-nocap,unguarded-nocap,unguarded-nocap#2,planner-nocap#2,planner-nocap#3,unguarded-nocap#3}" \
    > "$R/planner.jsonl" 2> "$R/planner.err"
  echo "rc=$? $(date +%T)"; cut -c1-330 "$R/planner.jsonl"; tail -n 3 "$R/planner.err"
  rm -rf /tmp/gw-s40 "$R/planner"
  ;;
b)
  if [ -z "${DRY:-}" ]; then
    OUT="$R" HELDOUT_DEADLINE_S=${HD:-400} timeout $(( ${HD:-400} + 25 )) bash benchmarks/gpu_heldout.sh ${SEED:-2904} ${N:-5} ${SECS:-200} 2>&1 | tail -n 12
    SC="--minutes 600 --strides 5 --jobs 1,16,16"
  else
    OUT="$R" HELDOUT_DRY=1 HELDOUT_DEADLINE_S=60 PYTHON=$PY bash benchmarks/gpu_heldout.sh ${SEED:-2904} ${N:-5} 8 2>&1 | tail -n 8
    SC="--minutes 5 --strides 5 --jobs 1,2"
  fi
  t=$(( $(left) - 5 ))
  echo "== score, ${t} s $(date +%T)"
  # shellcheck disable=SC2086
  timeout "$t" $PY benchmarks/bench_score.py $SC > "$R/score.json" 2> "$R/score.err"
  echo "rc=$? $(date +%T)"; cat "$R/score.json"; tail -n 3 "$R/score.err"
  ;;
h)
  M="gpu"; K=""; [ -n "${DRY:-}" ] && M="not gpu" && K="moved_batch"
  echo "== decode GPU tests $(date +%T)"
  timeout ${DT:-120} $PY -m pytest -q -p no:cacheprovider -m "$M" -k "$K" tests/test_decode.py -rA > "$R/decode_tests.txt" 2>&1
  echo "rc=$? $(date +%T)"; grep -E "^(PASSED|FAILED|ERROR)|passed|failed| MiB" "$R/decode_tests.txt" | tail -n 20
  if [ -z "${DRY:-}" ]; then PL="--arm-timeout 70 --nocap-steps 60 --max-seq 2048"; SC="--minutes 600 --strides 5 --jobs 1,16,16"
  else PL="--dry-run --arm-timeout 120"; SC="--minutes 5 --strides 5 --jobs 1,2"; fi
  echo "== no-cap pairs, ${PT:-240} s $(date +%T)"
  # shellcheck disable=SC2086
  timeout ${PT:-240} $PY benchmarks/planner_curriculum.py --out "$R/planner" --work /tmp/gw-s40 $PL \
    --arms "${PARMS:-planner-nocap,unguarded-nocap,unguarded-nocap#2,planner-nocap#2,planner-nocap#3,unguarded-nocap#3}" \
    > "$R/planner_h.jsonl" 2> "$R/planner_h.err"
  echo "rc=$? $(date +%T)"; cut -c1-420 "$R/planner_h.jsonl"; tail -n 3 "$R/planner_h.err"
  rm -rf /tmp/gw-s40 "$R/planner"
  echo "== score $(date +%T)"
  # shellcheck disable=SC2086
  timeout ${ST:-100} $PY benchmarks/bench_score.py $SC > "$R/score.json" 2> "$R/score.err"
  echo "rc=$? $(date +%T)"; cat "$R/score.json"; tail -n 3 "$R/score.err"
  ;&
c)
  if [ -z "${DRY:-}" ]; then P=v3-slice; V=baseline,compile=layer; B="--batch prefill=16 --batch prefill=32 --batch prefill=64 --batch prefill=128"
  else P=tiny; V=baseline; B="--batch prefill=2 --batch prefill=4 --device cpu"; fi
  t=$(( $(left) - 15 ))
  [ "$t" -lt 60 ] && { echo "no time left for the sweep ($t s)"; exit 0; }
  PRESETS=$P MODES=prefill VARIANTS=$V BUDGET_S=$(( t - 40 )) LIMIT_S=$t \
    EXTRA="--profile-steps 0 --sweep-variants --variant-steps 3 $B" bash benchmarks/gpu_stress_speed.sh
  ;;
esac
echo "part $1 done in $((SECONDS - T0)) s $(date +%T)"
