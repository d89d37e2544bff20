#!/usr/bin/env bash
# Session 51's GPU calls (each part dry-run on the CPU with DRY=1 before it is spent):
#   a: issue 28 - the guard watching a static configuration under accumulation, after the plan shows the
#      micro-batch the step runs as (GuardedLoop.running_micro_batch, 5c2159a/2f7d5f0) and observe mode says a
#      would-be action once (fd3676c): Lightning observe and static (8 x 2), interleaved, then HF observe (4 x 4);
#      then, on an H200 with time left, issue 30's owed v3-slice prefill sweep (compile=layer at 64, 96, 128 x 512).
#      Read the plans and events with  python3 benchmarks/step_costs.py $OUT/lightning-sessions.tgz $OUT/lightning.jsonl
#   b: issue 29's twelfth blind set (seed 2912), whole, recorded after this session's risk-input change is committed
#   run (repo root, carry .dev and REV):  TOTAL=560 bash benchmarks/gpu_session51.sh a|b
set -u
. benchmarks/session_env.sh "${1:?the part: a or b}"
. benchmarks/session_fns.sh
case "$1" in
a)
  curriculum lightning 8 "${LARMS:-lightning-observe,lightning-static}"
  curriculum hf 4 "${HARMS:-observe}"
  h200_sweep
  ;;
b)
  blind_set_whole "${SEED:-2912}"
  ;;
esac
echo "part $1 done in $((SECONDS - T0)) s $(date +%T)"
