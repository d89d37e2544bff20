#!/usr/bin/env bash
# Session 46's GPU calls (each part dry-run on the CPU with DRY=1 before it is spent):
#   p: issue 28 - the planner with the step split in place (no restart in the Trainer, any step in Lightning),
#      under the 34 GiB cap of s35a, 150 steps: Lightning (3 epochs of 256 -> 1,536) planner with gw.step against
#      the static 8 x 2 that beat the epoch-only planner (s38c: 63,993 vs 55,261 tok/s), then the HF curriculum
#      (256 -> 4,096) planner against the static 4 x 4, then repeats while TOTAL lasts (the arms interleaved)
#   a: issue 29's tenth blind set and issue 30's owed H200 sweep: `SEED=2910 bash benchmarks/gpu_session43.sh a`
#   pa: (when refusals left time for one call) p's Lightning and HF pairs once each, then blind set 2910 in what is
#      left of TOTAL (no sweep)
#   run (repo root, carry .dev and REV):  TOTAL=560 bash benchmarks/gpu_session46.sh p
set -u
. benchmarks/session_env.sh "${1:?the part: p}"
. benchmarks/session_fns.sh
case "$1" in
p)
  curriculum lightning 8 lightning-planner,lightning-static
  curriculum hf 4 planner,static
  curriculum lightning2 8 lightning-static#2,lightning-planner#2
  curriculum hf2 4 static#2,planner#2
  ;;
pa)
  curriculum lightning 8 lightning-planner,lightning-static
  curriculum hf 4 planner,static
  if [ "$(left)" -gt 240 ]; then SEED=${SEED:-2910} blind_set $(( $(left) - 45 )) 20
  else echo "blind set skipped: $(left) s left (a part of a set is no set: 2909)"; fi
  ;;
esac
echo "part $1 done in $((SECONDS - T0)) s $(date +%T)"
