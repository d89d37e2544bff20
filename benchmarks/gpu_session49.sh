#!/usr/bin/env bash
# Session 49's GPU call (dry-run on the CPU with DRY=1 before it is spent). No machine was lent in session 49
# ("no new device machine is lent at present"); written for the next session:
#   p: issue 28 - where Lightning's planner arm loses to the static 8 x 2 (s47: 0.91x / 0.955x steady). Read
#      from s47's sessions: its steps cost ~15-19 % more than static's at the same configuration, and a step
#      at a new length ~0.14 s more than a repeat. First the GPU test that the callback's step end no longer
#      syncs the host (StepLoss); then the Lightning arms static, observe (the guard watching static's
#      8 x 2: watching alone), planner x2 (the loss read without a sync, the decision on the batch in hand -
#      the give-back at each epoch's wrap -, the pace fix, the snapshot backoff, one release), each with its
#      step log (step times, cudaMalloc/cudaFree/retries a step); then the HF arms static, planner (~530 s in all).
#      Read with: python3 benchmarks/step_costs.py $OUT/lightning-sessions.tgz $OUT/lightning.jsonl
#   next: TOTAL=585 bash benchmarks/gpu_session47.sh b (blind set 2911, whole) first, then this part on the
#      warm machine.
#   run (repo root, carry .dev and REV):  TOTAL=585 bash benchmarks/gpu_session49.sh p
set -u
. benchmarks/session_env.sh "${1:?the part: p}"
. benchmarks/session_fns.sh
case "$1" in
p)  # on s47's H100 host: a Lightning arm ~66-74 s, an HF arm ~105 s
  echo "== the callback's step end without a host sync (GPU test) $(date +%T)"
  if [ -z "${DRY:-}" ]; then
    timeout 120 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_integrations.py -k host_sync -rA > "$R/gpu_test_sync.txt" 2>&1
  else
    timeout 120 $PY -m pytest -q -p no:cacheprovider tests/test_integrations.py -k host_sync -rA > "$R/gpu_test_sync.txt" 2>&1
  fi
  echo "rc=$? $(date +%T)"; tail -n 3 "$R/gpu_test_sync.txt"
  curriculum lightning 8 "${LARMS:-lightning-static,lightning-observe,lightning-planner,lightning-planner#2}"
  curriculum hf 4 "${HARMS:-static,planner}"  # HARMS=static,observe,planner where the time allows (~105 s an arm)
  ;;
esac
echo "part $1 done in $((SECONDS - T0)) s $(date +%T)"
