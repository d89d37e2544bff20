#!/usr/bin/env bash
# Session 50's last GPU call (dry-run on the CPU with DRY=1 before it is spent):
#   o: issue 28 - the guard watching a static configuration under accumulation, after the plan shows the
#      micro-batch the step runs as (GuardedLoop.running_micro_batch). Calls s50b/c showed Lightning's observe
#      arm (8 x 2) said "would plan 8" at 108 of its 150 steps and weighed/scored 16 x 1, a shape that never
#      ran; it ran at 0.935x / 0.987x static's tokens/s. Arms: lightning-observe, lightning-static (interleaved,
#      ~45 s each), then HF observe (4 x 4, ~85 s) where time is left. Read the plans and events with
#      python3 benchmarks/step_costs.py $OUT/lightning-sessions.tgz $OUT/lightning.jsonl
#   run (repo root, carry .dev and REV):  TOTAL=300 bash benchmarks/gpu_session50.sh o
set -u
. benchmarks/session_env.sh "${1:?the part: o}"
. benchmarks/session_fns.sh
case "$1" in
o)
  curriculum lightning 8 "${LARMS:-lightning-observe,lightning-static}"
  curriculum hf 4 "${HARMS:-observe}"
  ;;
esac
echo "part $1 done in $((SECONDS - T0)) s $(date +%T)"
