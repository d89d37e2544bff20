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
. benchmarks/session_fns.sh  # decode_tests, nocap_pairs, blind_set, score_run (shared with later sessions' scripts)

case "${1:?a, b, c, h or g}" in
a|g)
  guard_ramp gpuwatch,gpuwatch-thresholds s40-guard
  PL="--arm-timeout 60 --nocap-steps 30"; [ -n "${DRY:-}" ] && PL="--dry-run --arm-timeout 120"
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
  prefill_sweep "16 32 64 128"
  ;;
esac
echo "part $1 done in $((SECONDS - T0)) s $(date +%T)"
