# Sourced by benchmarks/gpu.sh (and by the device_run*.sh scripts of calls 1-19, in git history): install the carried wheels (textual, polars) and define
# `stage NAME SECONDS CMD...`, which runs CMD with a time limit, saving its stdout to $R/NAME.$EXT and
# its stderr to $R/NAME.err, and prints its exit code and the tail of its output.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
EXT=${EXT:-json}
stage() {
  local name=$1 secs=$2; shift 2
  echo "== $name $(date +%T)"
  timeout "$secs" "$@" > "$R/$name.$EXT" 2> "$R/$name.err"
  echo "rc=$? $(date +%T)"
  tail -n 3 "$R/$name.err"
}
