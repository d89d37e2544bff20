#!/usr/bin/env bash
# Session 41's GPU calls (each part dry-run on the CPU with DRY=1 before it is spent):
#   a: issue 28 - the no-cap Trainer pairs after the cache-release gate (f0ea353: no release unless the coming
#      peak nears the limit), interleaved p, u, p1, u, p, p1, u, p, u, p with the scorer at 1 Hz as a third arm
#      (p1: what the scorer costs), 256 -> 2,048 tokens, 60 steps (as s40h); then, on an H200 only, ramp-train
#      with the planner then the threshold rule after the pace fix (396b383: the per-micro-batch cost learned)
#   b: issue 29 - the fifth blind set (seed 2905), recorded after the trend change, with the rest of TOTAL
#   c: issue 30 - v3-slice prefill at 64, 96 and 128 x 512 on the H200 (s40h's sweep ran on an H100: 49.9 %),
#      the baseline and compile=layer, 5 timed steps each; first (RAMP=1) part a's ramp-train, which part a
#      skipped on an H100 (both arms in the call: they compare on either card)
#   d: what fits when the sweep cannot have an H200: c's ramp-train, then issue 31's fit of 40x the shipped set
#      on the host's 16 cores (`bench_train.py --copies 40 --jobs 16 --no-eval`; s40i ran 30x)
#   run (repo root, carry .dev and REV):  bash benchmarks/gpu_session41.sh a|b|c|d
set -u
. benchmarks/session_env.sh "${1:?the part: a, b, c or d}"
. benchmarks/session_fns.sh

case "$1" in
a)
  PL="--arm-timeout 70 --nocap-steps 60 --max-seq 2048"; [ -n "${DRY:-}" ] && PL="--dry-run --arm-timeout 120"
  # shellcheck disable=SC2086  # PL is a list of arguments
  PARMS=planner-nocap,unguarded-nocap,planner-nocap-1hz,unguarded-nocap#2,planner-nocap#2,planner-nocap-1hz#2,unguarded-nocap#3,planner-nocap#3,unguarded-nocap#4,planner-nocap#4 \
    nocap_pairs ${PT:-330} planner $PL
  if on_h200 && [ "$(left)" -gt 130 ]; then GT=$(( $(left) - 15 )) guard_ramp gpuwatch,gpuwatch-thresholds s41-guard
  else echo "ramp-train skipped (not an H200, or $(left) s left)"; fi
  ;;
b)
  SEED=${SEED:-2905} blind_set $(( $(left) - 35 )) 20
  ;;
d)
  GT=${GT:-170} guard_ramp gpuwatch,gpuwatch-thresholds s41-guard
  t=$(( $(left) - 10 ))
  echo "== train ${COPIES:-40}x, ${t} s $(date +%T)"
  cp="--copies ${COPIES:-40} --jobs 16 --no-eval"; [ -n "${DRY:-}" ] && cp="--copies 1 --jobs 2 --no-eval"
  # shellcheck disable=SC2086  # cp is a list of arguments
  timeout "$t" $PY benchmarks/bench_train.py $cp > "$R/train.json" 2> "$R/train.err"
  echo "rc=$? $(date +%T)"; cat "$R/train.json"; tail -n 3 "$R/train.err"
  ;;
c)
  # the ramp-train's two arms in one call compare on any card whose memory holds its 72 GiB cap
  if [ "${RAMP:-1}" = 1 ]; then GT=${GT:-170} guard_ramp gpuwatch,gpuwatch-thresholds s41-guard; fi
  VSTEPS=${VSTEPS:-5} prefill_sweep "${BATCHES:-64 96 128}"
  ;;
esac
echo "part $1 done in $((SECONDS - T0)) s $(date +%T)"
