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
# the steps the parts share (each writes under $R and prints its exit code and the tail of its output)
decode_tests() {  # issue 30's decode GPU tests (the CPU dry run: the moved-batch test alone)
  local m="gpu" k=""; [ -n "${DRY:-}" ] && m="not gpu" && k="moved_batch"
  echo "== decode GPU tests $(date +%T)"
  timeout ${DT:-120} $PY -m pytest -q -p no:cacheprovider -m "$m" -k "$k" tests/test_decode.py -rA > "$R/decode_tests.txt" 2>&1
  echo "rc=$? $(date +%T)"; grep -E "^(PASSED|FAILED|ERROR)|passed|failed| MiB" "$R/decode_tests.txt" | tail -n 20
}
nocap_pairs() {  # SECONDS NAME ARGS...: issue 28's no-cap Trainer pairs, interleaved, into $R/NAME.jsonl
  local t=$1 name=$2; shift 2
  echo "== no-cap pairs, ${t} s $(date +%T)"
  timeout "$t" $PY benchmarks/planner_curriculum.py --out "$R/planner" --work /tmp/gw-s40 "$@" \
    --arms "${PARMS:-planner-nocap,unguarded-nocap,unguarded-nocap#2,planner-nocap#2,planner-nocap#3,unguarded-nocap#3}" \
    > "$R/$name.jsonl" 2> "$R/$name.err"
  echo "rc=$? $(date +%T)"; cut -c1-420 "$R/$name.jsonl"; tail -n 3 "$R/$name.err"
  rm -rf /tmp/gw-s40 "$R/planner"
}
blind_set() {  # DEADLINE SLACK: issue 29's blind set of SEED (2904), the whole set within DEADLINE s
  if [ -z "${DRY:-}" ]; then
    OUT="$R" HELDOUT_DEADLINE_S=$1 timeout $(( $1 + $2 )) bash benchmarks/gpu_heldout.sh ${SEED:-2904} ${N:-5} ${SECS:-200} 2>&1 | tail -n 12
  else
    OUT="$R" HELDOUT_DRY=1 HELDOUT_DEADLINE_S=60 PYTHON=$PY bash benchmarks/gpu_heldout.sh ${SEED:-2904} ${N:-5} 8 2>&1 | tail -n 8
  fi
}
score_run() {  # SECONDS: issue 31's `score` of ten hours, 1 and 16 processes (the dry run: five minutes, 1 and 2)
  local sc="--minutes 600 --strides 5 --jobs 1,16,16"; [ -n "${DRY:-}" ] && sc="--minutes 5 --strides 5 --jobs 1,2"
  echo "== score, $1 s $(date +%T)"
  # shellcheck disable=SC2086  # sc is a list of arguments
  timeout "$1" $PY benchmarks/bench_score.py $sc > "$R/score.json" 2> "$R/score.err"
  echo "rc=$? $(date +%T)"; cat "$R/score.json"; tail -n 3 "$R/score.err"
}

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
    blind_set "$t" 20
    echo "part g done in $((SECONDS - T0)) s $(date +%T)"; exit 0
  fi
  decode_tests
  # shellcheck disable=SC2086  # PL is a list of arguments
  nocap_pairs $(( $(left) - 10 )) planner $PL
  ;;
b)
  blind_set ${HD:-400} 25
  score_run $(( $(left) - 5 ))
  ;;
h)
  decode_tests
  PL="--arm-timeout 70 --nocap-steps 60 --max-seq 2048"; [ -n "${DRY:-}" ] && PL="--dry-run --arm-timeout 120"
  # shellcheck disable=SC2086  # PL is a list of arguments
  nocap_pairs ${PT:-240} planner_h $PL
  score_run ${ST:-100}
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
