#!/usr/bin/env bash
# Session 42's GPU calls (each part dry-run on the CPU with DRY=1 before it is spent):
#   a, b: issue 30's v3-slice prefill sweep and issue 29's blind set 2906 ran through gpu_session41.sh c and b
#   c: issue 31 on the host's 16 cores - `score` of ten hours at 1 and 16 processes after the per-window speed-up,
#      then 1,000 shipped-size sessions (`bench_train.py --copies 20 --jobs 16 --no-eval`) with the tree's PSS
#      and USS beside its summed RSS (the <= 4 GiB target read as what the tree takes, not its pages counted per
#      worker)
#   run (repo root, carry .dev and REV):  bash benchmarks/gpu_session42.sh c
set -u
. benchmarks/session_env.sh "${1:?the part: c}"
. benchmarks/session_fns.sh

case "$1" in
c)
  score_run ${ST:-150}
  t=$(( $(left) - 10 ))
  echo "== train ${COPIES:-20}x, ${t} s $(date +%T)"
  cp="--copies ${COPIES:-20} --jobs 16 --no-eval"; [ -n "${DRY:-}" ] && cp="--copies 1 --jobs 2 --no-eval"
  # shellcheck disable=SC2086  # cp is a list of arguments
  timeout "$t" $PY benchmarks/bench_train.py $cp > "$R/train.json" 2> "$R/train.err"
  echo "rc=$? $(date +%T)"; cat "$R/train.json"; tail -n 3 "$R/train.err"
  ;;
esac
echo "part $1 done in $((SECONDS - T0)) s $(date +%T)"
