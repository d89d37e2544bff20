#!/usr/bin/env bash
# Session 47's GPU calls (each part dry-run on the CPU with DRY=1 before it is spent):
#   p: issue 28 - the guard's start/first-step/close cost on the host's cores (guard_start_cost.py); after the estimator's curvature beyond the longest length seen (a3be43c) and the guard's start
#      taken off the training thread: the Lightning pairs (planner with gw.step against the static 8 x 2; both arms
#      now print their steady rate) and the HF curriculum pairs (planner against the static 4 x 4), twice each,
#      interleaved; then the no-cap Trainer pairs (planner and unguarded, 256 -> 2,048, 60 steps) with what is left
#   b: issue 29's eleventh blind set (seed 2911), whole, recorded after a3be43c; then issue 30's owed sweep where
#      the card is an H200 and time is left
#   next (session 48): TOTAL=585 bash benchmarks/gpu_session47.sh b (blind set 2911, whole), then on the warm machine
#      TOTAL=585 bash benchmarks/gpu_session47.sh p (the HF pairs twice, then a Lightning pair: the pace fix 0283073/b58ef72
#      and the blocks change dfcbd24 on a GPU); GR=N adds guard_start_cost.py's N repeats first
#   run (repo root, carry .dev and REV):  TOTAL=585 bash benchmarks/gpu_session47.sh p|b
set -u
. benchmarks/session_env.sh "${1:?the part: p or b}"
. benchmarks/session_fns.sh
case "$1" in
p)  # on s47's H100 host: an HF arm ~105 s, a Lightning arm ~66 s, guard_start_cost ~50 s a repeat
  if [ "${GR:-0}" -gt 0 ] || [ -n "${DRY:-}" ]; then
    echo "== guard_start_cost (the host's 16 cores, CPU) $(date +%T)"
    GR=${GR:-1}; [ -n "${DRY:-}" ] && GR=1
    timeout 100 $PY benchmarks/guard_start_cost.py --repeats "$GR" --json "$R/guard_start_cost.json" > "$R/guard_start_cost.txt" 2>&1
    echo "rc=$? $(date +%T)"; tail -n 8 "$R/guard_start_cost.txt"
  fi
  curriculum hf 4 "${HARMS:-planner,static,static#2,planner#2}"
  curriculum lightning 8 "${LARMS:-lightning-planner,lightning-static}"
  if [ "$(left)" -gt 100 ]; then
    PL="--arm-timeout 70 --nocap-steps 60 --max-seq 2048"; [ -n "${DRY:-}" ] && PL="--dry-run --arm-timeout 120"
    PARMS=${PARMS:-planner-nocap,unguarded-nocap,unguarded-nocap#2,planner-nocap#2} nocap_pairs $(( $(left) - 10 )) nocap $PL
  else echo "no-cap pairs skipped: $(left) s left"; fi
  ;;
b)
  blind_set_whole "${SEED:-2911}"
  ;;
esac
echo "part $1 done in $((SECONDS - T0)) s $(date +%T)"
