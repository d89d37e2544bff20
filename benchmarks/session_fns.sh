# Sourced by the session scripts (benchmarks/gpu_session40.sh ... gpu_session47.sh) after session_env.sh: the steps
# their parts share, each writing under $R and printing its exit code and the tail of its output; DRY=1 runs
# each as its CPU dry run.
decode_tests() {  # issue 30's decode GPU tests (the CPU dry run: the moved-batch test alone)
  local m="gpu" k=""; [ -n "${DRY:-}" ] && m="not gpu" && k="moved_batch"
  echo "== decode GPU tests $(date +%T)"
  timeout ${DT:-120} $PY -m pytest -q -p no:cacheprovider -m "$m" -k "$k" tests/test_decode.py -rA > "$R/decode_tests.txt" 2>&1
  echo "rc=$? $(date +%T)"; grep -E "^(PASSED|FAILED|ERROR)|passed|failed| MiB" "$R/decode_tests.txt" | tail -n 20
}
nocap_pairs() {  # SECONDS NAME ARGS...: issue 28's no-cap Trainer pairs, interleaved, into $R/NAME.jsonl
  local t=$1 name=$2; shift 2
  echo "== no-cap pairs, ${t} s $(date +%T)"
  timeout "$t" $PY benchmarks/planner_curriculum.py --out "$R/planner" --work /tmp/gw-s40 "$@" \
    --arms "${PARMS:-planner-nocap,unguarded-nocap,unguarded-nocap#2,planner-nocap#2,planner-nocap#3,unguarded-nocap#3}" \
    > "$R/$name.jsonl" 2> "$R/$name.err"
  echo "rc=$? $(date +%T)"; cut -c1-420 "$R/$name.jsonl"; tail -n 3 "$R/$name.err"
  rm -rf /tmp/gw-s40 "$R/planner"
}
blind_set() {  # DEADLINE SLACK: issue 29's blind set of SEED (2904), the whole set within DEADLINE s
  if [ -z "${DRY:-}" ]; then
    OUT="$R" HELDOUT_DEADLINE_S=$1 timeout $(( $1 + $2 )) bash benchmarks/gpu_heldout.sh ${SEED:-2904} ${N:-5} ${SECS:-200} 2>&1 | tail -n 12
  else
    OUT="$R" HELDOUT_DRY=1 HELDOUT_DEADLINE_S=60 PYTHON=$PY bash benchmarks/gpu_heldout.sh ${SEED:-2904} ${N:-5} 8 2>&1 | tail -n 8
  fi
}
score_run() {  # SECONDS: issue 31's `score` of ten hours, 1 and 16 processes (the dry run: five minutes, 1 and 2)
  local sc="--minutes 600 --strides 5 --jobs 1,16,16"; [ -n "${DRY:-}" ] && sc="--minutes 5 --strides 5 --jobs 1,2"
  echo "== score, $1 s $(date +%T)"
  # shellcheck disable=SC2086  # sc is a list of arguments
  timeout "$1" $PY benchmarks/bench_score.py $sc > "$R/score.json" 2> "$R/score.err"
  echo "rc=$? $(date +%T)"; cat "$R/score.json"; tail -n 3 "$R/score.err"
}

guard_ramp() {  # ARMS TAG: bench_guard's ramp-train (the estimator's known fit at 20), ARMS in order, GSECS s an
  # arm (20), within GT s (150); the recorded sessions into $R/guard-sessions.tgz
  local G
  if [ -z "${DRY:-}" ]; then
    G="--model models/risk.joblib --scenarios ramp-train --seconds ${GSECS:-20} --known-fit ramp-train=20"
  else
    G="--cpu --scenarios ramp-train --seconds 3"
  fi
  echo "== bench_guard ramp-train $1 $(date +%T)"
  # shellcheck disable=SC2086  # G is a list of arguments
  timeout ${GT:-150} $PY benchmarks/bench_guard.py $G --arms "$1" --record "/tmp/$2" \
    --out "$R/guard.json" > "$R/guard.txt" 2> "$R/guard.err"
  echo "rc=$? $(date +%T)"; tail -n 6 "$R/guard.txt"; grep -v "Warning\|setter" "$R/guard.err" | tail -n 3
  tar czf "$R/guard-sessions.tgz" --exclude='*.pickle' -C /tmp "$2" 2>/dev/null; rm -rf "/tmp/$2"
}
prefill_sweep() {  # "BATCHES": issue 30's v3-slice prefill, the baseline and compile=layer at each BATCH x 512,
  # with what is left of TOTAL (the dry run: the tiny preset on the CPU at 2 and 4)
  local P V B="" b t
  if [ -z "${DRY:-}" ]; then P=v3-slice; V=${SWEEP_VARIANTS:-baseline,compile=layer}; for b in $1; do B="$B --batch prefill=$b"; done
  else P=tiny; V=baseline; B="--batch prefill=2 --batch prefill=4 --device cpu"; fi
  t=$(( $(left) - 15 ))
  [ "$t" -lt 60 ] && { echo "no time left for the sweep ($t s)"; return 0; }
  PRESETS=$P MODES=prefill VARIANTS=$V BUDGET_S=$(( t - 40 )) LIMIT_S=$t \
    EXTRA="--profile-steps 0 --sweep-variants --variant-steps ${VSTEPS:-3} $B" bash benchmarks/gpu_stress_speed.sh
}
curriculum() {  # NAME STATIC ARMS: issue 28's planner_curriculum arms in one call, each in its own process (AT: arm timeout)
  local name=$1 sb=$2 arms=$3 t
  t=$(( $(left) - 10 ))
  [ "$t" -lt 90 ] && { echo "== $name skipped: $t s left"; return 0; }
  local PL="--arm-timeout ${AT:-115} --static-batch $sb"; [ -n "${DRY:-}" ] && PL="--dry-run --arm-timeout 120"
  echo "== planner_curriculum $name: $arms ($t s left) $(date +%T)"
  # shellcheck disable=SC2086  # PL is a list of arguments
  timeout "$t" $PY benchmarks/planner_curriculum.py --out "$R/planner-$name" --work /tmp/gw-curriculum $PL --arms "$arms" \
    > "$R/$name.jsonl" 2> "$R/$name.err"
  echo "rc=$? $(date +%T)"; cut -c1-700 "$R/$name.jsonl"; grep -v "Warning\|warn" "$R/$name.err" | tail -n 3
  tar czf "$R/$name-sessions.tgz" -C "$R/planner-$name" sessions 2>/dev/null; rm -rf /tmp/gw-curriculum "$R/planner-$name/sessions"
}
on_h200() { grep -q H200 "$R/gpu.txt" 2>/dev/null || [ -n "${DRY:-}" ]; }  # the card session_env.sh wrote down
h200_sweep() {  # issue 30's owed v3-slice prefill sweep (compile=layer at 64, 96, 128 x 512), where the card is an H200
  # and more than 200 s of TOTAL are left
  if on_h200 && [ "$(left)" -gt 200 ]; then
    SWEEP_VARIANTS=${SWEEP_VARIANTS:-compile=layer} VSTEPS=${VSTEPS:-5} prefill_sweep "${BATCHES:-64 96 128}"
  else echo "sweep skipped: $(cat "$R/gpu.txt" 2>/dev/null), $(left) s left"; fi
}
blind_set_whole() {  # SEED: issue 29's blind set, whole (an H200 keeps 255 s of it for the sweep), then h200_sweep
  if on_h200; then BT=${BT:-255}; else BT=${BT:-$(( $(left) - 45 ))}; fi
  SEED=$1 blind_set "$BT" 20
  h200_sweep
}
