#!/usr/bin/env bash
# Session 38's H200 calls, several issues' measurements in one call each (device time is scarce; each part is
# its own script, run here in sequence, never side by side, so no part's figures are another's):
#   a: issue 29's second blind held-out set (seed 2901, recorded after the trend's reuse rule, afd6164; 8
#      scenarios x 90 s in waves, HD s for the whole set), then issue 30's GPU tests of the switches and the
#      profile's categories (every one, no -x)
#   b: issue 28 on gpuwatch's own stress: ramp-train, leak, fragment x unguarded / planner / the threshold rule
#      alone (bench_guard.py, --guard-plan's arms), then the library loop's ramp (variable lengths), healthy,
#      fragment and leak (guard_library.py)
#   c: issue 31's 1,000-session fit and `score` on 16 cores, bench_guard's fragment arms again (now with the
#      allocator reset between arms), then issue 28's fairer Lightning static arm (8 x 2) and the no-cap pairs,
#      interleaved (where the guard need not act)
#   d: the blind set 2901 again, 5 scenarios in 2 waves (part a's 8 needed 3 waves: only one ran, and the
#      library-loop scenarios failed on an import that the issue-27 move broke, fixed since)
#   run (repo root, carry .dev):  bash benchmarks/gpu_session38.sh a|b|c
#   CPU dry run of a part's code paths (no GPU): DRY=1 bash benchmarks/gpu_session38.sh a|b|c
set -u
. benchmarks/session_env.sh "${1:?the part: a, b, c or d}"
case "${1:?a, b, c or d}" in
d)
  if [ -z "${DRY:-}" ]; then
    OUT="$R" HELDOUT_DEADLINE_S=${HD:-430} timeout $(( ${HD:-430} + 25 )) bash benchmarks/gpu_heldout.sh 2901 ${N:-5} ${SECS:-90} 2>&1 | tail -n 12
  else
    OUT="$R" HELDOUT_DRY=1 HELDOUT_DEADLINE_S=60 PYTHON=$PY bash benchmarks/gpu_heldout.sh 2901 5 15 2>&1 | tail -n 8
  fi
  ;;
a)
  if [ -z "${DRY:-}" ]; then
    OUT="$R" HELDOUT_DEADLINE_S=${HD:-330} timeout $(( ${HD:-330} + 25 )) bash benchmarks/gpu_heldout.sh 2901 ${N:-8} ${SECS:-90} 2>&1 | tail -n 14
  else
    OUT="$R" HELDOUT_DRY=1 HELDOUT_DEADLINE_S=60 PYTHON=$PY bash benchmarks/gpu_heldout.sh 2901 2 4 2>&1 | tail -n 6
  fi
  t=$(( $(left) - 10 ))
  echo "== gpu tests, ${t} s $(date +%T)"
  timeout "$t" $PY -m pytest -q -m gpu tests/test_workload_tuning.py tests/test_workload_profile.py -p no:cacheprovider -rA \
    > "$R/gpu_tests.txt" 2>&1
  echo "rc=$? $(date +%T)"; grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$R/gpu_tests.txt" | tail -n 30
  ;;
b)
  if [ -z "${DRY:-}" ]; then
    G="--model models/risk.joblib --scenarios ramp-train,leak,fragment --seconds ${GSECS:-20} --known-fit ramp-train=20,leak=1071,fragment=43"
    L="--budget-s ${LBUDGET:-140}"
  else
    G="--cpu --scenarios ramp-train,leak --seconds 3"; L="--dry-run"
  fi
  echo "== bench_guard $(date +%T)"
  # shellcheck disable=SC2086  # G is a list of arguments
  timeout ${GT:-300} $PY benchmarks/bench_guard.py $G --arms none,gpuwatch,gpuwatch-thresholds --record /tmp/s38-guard \
    --out "$R/guard_results.json" > "$R/guard.txt" 2> "$R/guard.err"
  echo "rc=$? $(date +%T)"; tail -n 40 "$R/guard.txt"; tail -n 3 "$R/guard.err"
  tar czf "$R/guard-sessions.tgz" -C /tmp s38-guard 2>/dev/null; rm -rf /tmp/s38-guard
  t=$(( $(left) - 15 ))
  echo "== guard_library, ${t} s $(date +%T)"
  # shellcheck disable=SC2086
  timeout "$t" $PY benchmarks/guard_library.py --out "$R/guard_library.json" --sessions /tmp/s38-lib $L \
    --only ramp-loop healthy fragment leak > "$R/guard_library.txt" 2> "$R/guard_library.err"
  echo "rc=$? $(date +%T)"; tail -n 12 "$R/guard_library.txt"; tail -n 3 "$R/guard_library.err"
  tar czf "$R/guard-library-sessions.tgz" -C /tmp s38-lib 2>/dev/null; rm -rf /tmp/s38-lib
  ;;
c)
  if [ -z "${DRY:-}" ]; then
    TR="--copies 20 --jobs 16 --no-eval"; SC="--strides 5 --jobs 1,16"; PL="--arm-timeout 60 --nocap-steps 30"
  else
    TR="--copies 1 --jobs 2 --no-eval"; SC="--strides 5 --jobs 1,2 --minutes 2"; PL="--dry-run --arm-timeout 120"
  fi
  echo "== train, 1,000 sessions $(date +%T)"
  # shellcheck disable=SC2086
  timeout ${TT:-170} $PY benchmarks/bench_train.py $TR > "$R/train_1000.json" 2> "$R/train_1000.err"
  echo "rc=$? $(date +%T)"; cut -c1-600 "$R/train_1000.json"; tail -n 3 "$R/train_1000.err"
  echo "== score $(date +%T)"
  # shellcheck disable=SC2086
  timeout ${ST:-60} $PY benchmarks/bench_score.py $SC > "$R/score16.json" 2> "$R/score16.err"
  echo "rc=$? $(date +%T)"; cut -c1-600 "$R/score16.json"; tail -n 3 "$R/score16.err"
  t=$(( $(left) - 10 ))
  echo "== bench_guard fragment, the arms apart (call b's ran after an arm that switched to expandable segments) $(date +%T)"
  if [ -z "${DRY:-}" ]; then G="--model models/risk.joblib --seconds ${GSECS:-20} --known-fit fragment=43"; else G="--cpu --seconds 3"; GSCN=${GSCN:-ramp-train}; fi
  # shellcheck disable=SC2086
  timeout ${GT:-150} $PY benchmarks/bench_guard.py $G --scenarios ${GSCN:-fragment} --arms none,gpuwatch,gpuwatch-thresholds \
    --record /tmp/s38-frag --out "$R/guard_fragment.json" > "$R/guard_fragment.txt" 2> "$R/guard_fragment.err"
  echo "rc=$? $(date +%T)"; tail -n 8 "$R/guard_fragment.txt"; grep -v "Warning\|setter" "$R/guard_fragment.err" | tail -n 3
  tar czf "$R/guard-fragment-sessions.tgz" -C /tmp s38-frag 2>/dev/null; rm -rf /tmp/s38-frag
  t=$(( $(left) - 10 ))
  echo "== planner: lightning-static 8 x 2, no-cap pairs, ${t} s $(date +%T)"
  # shellcheck disable=SC2086
  timeout "$t" $PY benchmarks/planner_curriculum.py --out "$R/planner" --work /tmp/gw-s38 $PL \
    --arms "${PARMS:-lightning-static,unguarded-nocap,planner-nocap,planner-nocap#2,unguarded-nocap#2}" \
    --static-batch 8 > "$R/planner.jsonl" 2> "$R/planner.err"
  echo "rc=$? $(date +%T)"; cut -c1-500 "$R/planner.jsonl"; tail -n 3 "$R/planner.err"
  rm -rf /tmp/gw-s38 "$R/planner/sessions"
  ;;
esac
echo "part $1 done in $((SECONDS - T0)) s $(date +%T)"
