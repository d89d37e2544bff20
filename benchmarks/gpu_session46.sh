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
curriculum() {  # NAME STATIC ARMS: planner_curriculum's arms in one call, each in its own process
  local name=$1 sb=$2 arms=$3 t
  t=$(( $(left) - 10 ))
  [ "$t" -lt 90 ] && { echo "== $name skipped: $t s left"; return 0; }
  local PL="--arm-timeout ${AT:-115} --static-batch $sb"; [ -n "${DRY:-}" ] && PL="--dry-run --arm-timeout 120"
  echo "== planner_curriculum $name: $arms ($t s left) $(date +%T)"
  # shellcheck disable=SC2086  # PL is a list of arguments
  timeout "$t" $PY benchmarks/planner_curriculum.py --out "$R/planner-$name" --work /tmp/gw-s46 $PL --arms "$arms" \
    > "$R/$name.jsonl" 2> "$R/$name.err"
  echo "rc=$? $(date +%T)"; cut -c1-700 "$R/$name.jsonl"; grep -v "Warning\|warn" "$R/$name.err" | tail -n 3
  tar czf "$R/$name-sessions.tgz" -C "$R/planner-$name" sessions 2>/dev/null; rm -rf /tmp/gw-s46 "$R/planner-$name/sessions"
}
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
