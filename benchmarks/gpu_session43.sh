#!/usr/bin/env bash
# Session 43's GPU call (dry-run on the CPU with DRY=1 before it is spent):
#   a: issue 29 - the seventh blind set (seed 2907, next in sequence), recorded after the risk's ranking above the
#      alarm (composite.py `over`: the estimate's excess over the usable limit); then, on an H200 only, issue 30's
#      owed v3-slice prefill sweep (compile=layer at 64, 96 and 128 x 512, 5 timed steps: s42a/b ran it on an H100)
#   c: the sweep alone (where part a ran on an H100): exits 3 at once on any other card, to save the budget
#   t: (session 44) tests/test_gpu.py on any card - the schema v6 column torch_inactive_split_bytes among them
#      (~1 min); then part c's sweep where the card is an H200 and time is left
#   d: (session 45) part t's tests, then a design set that records the v6 column (seed 3120: two small prefill
#      leaks, a prefill ramp and random lengths - chosen for the fragmentation class; seen, never a headline)
#      in what is left of TOTAL; no sweep
#   e: (session 45) part t's tests, then blind set 2909 (the eighth, recorded after the trend's v6 split-block
#      rule, 7b4384c) in what is left of TOTAL, then the owed sweep on an H200 where time is left
#   next (session 46): SEED=2910 TOTAL=570 bash benchmarks/gpu_session43.sh a - the tenth blind set, whole (2909 ran
#      1 of 5 before the runner's wave fix), then the sweep where the card is an H200
#   run (repo root, carry .dev and REV):  TOTAL=570 bash benchmarks/gpu_session43.sh a|c|t
set -u
. benchmarks/session_env.sh "${1:?the part: a, c, d, e or t}"
. benchmarks/session_fns.sh
gpu_tests() {
  echo "== GPU tests: tests/test_gpu.py $(date +%T)"
  timeout ${GT_S:-150} $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -rA > "$R/gpu_tests.txt" 2>&1
  echo "rc=$? $(date +%T)"; tail -n 12 "$R/gpu_tests.txt"
}
owed_sweep() { SWEEP_VARIANTS=${SWEEP_VARIANTS:-compile=layer} VSTEPS=${VSTEPS:-5} prefill_sweep "${BATCHES:-64 96 128}"; }
sweep_if_h200() { if on_h200; then owed_sweep; else echo "sweep skipped: not an H200 ($(cat "$R/gpu.txt" 2>/dev/null))"; fi; }

case "$1" in
a)  # the set's deadline: 255 s on an H200 (the sweep gets the rest), all but 50 s of TOTAL on any other card
  if on_h200; then BT=${BT:-255}; else BT=${BT:-$(( $(left) - 50 ))}; fi
  SEED=${SEED:-2907} blind_set "$BT" 20
  sweep_if_h200
  ;;
c)
  on_h200 || { echo "not an H200: $(cat "$R/gpu.txt")"; exit 3; }
  owed_sweep
  ;;
t)
  gpu_tests
  sweep_if_h200
  ;;
e)
  gpu_tests
  SEED=${SEED:-2909} blind_set $(( $(left) - ${SWEEP_S:-40} )) 20
  sweep_if_h200
  ;;
d)
  gpu_tests
  SEED=${SEED:-3120} blind_set $(( $(left) - 40 )) 20
  ;;
esac
echo "part $1 done in $((SECONDS - T0)) s $(date +%T)"
