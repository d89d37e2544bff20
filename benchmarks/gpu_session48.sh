#!/usr/bin/env bash
# Session 48's GPU call (dry-run on the CPU with DRY=1 before it is spent). Not run: no device start succeeded in
# session 48 (24 calls, 17:43-19:15, 1,576 of 1,800 s); one short call, owed:
#   p: issue 28 - the fixes since s47b/c, none yet on a GPU: the pace model's shared-length cost (0283073/b58ef72),
#      the snapshot's backoff under expandable segments (dfcbd24) and one cache release a run with the planner
#      (ab5441a). The Lightning pair first (the arm below static in s47: 0.84x / 0.93x), then the HF curriculum pair.
#   next (session 49): TOTAL=585 bash benchmarks/gpu_session47.sh b (blind set 2911, whole), then
#      TOTAL=585 bash benchmarks/gpu_session47.sh p (the pairs twice)
#   run (repo root, carry .dev and REV):  TOTAL=340 bash benchmarks/gpu_session48.sh p
set -u
. benchmarks/session_env.sh "${1:?the part: p}"
. benchmarks/session_fns.sh
case "$1" in
p)  # on s47's H100 host: a Lightning arm ~66 s, an HF arm ~105 s
  curriculum lightning 8 "${LARMS:-lightning-planner,lightning-static}"
  curriculum hf 4 "${HARMS:-planner,static}"
  ;;
esac
echo "part $1 done in $((SECONDS - T0)) s $(date +%T)"
