# Sourced by benchmarks/gpu.sh (and by the device_run*.sh scripts of calls 1-19, in git history): install the carried wheels (textual, polars) and define
# `stage NAME SECONDS CMD...`, which runs CMD with a time limit, saving its stdout to $R/NAME.$EXT and
# its stderr to $R/NAME.err, and prints its exit code and the tail of its output.
# The wheels travel either as .whl/*.whl or, when the tree is too large for both (the device call carries 64 MiB
# and polars' runtime wheel alone is 54 MB), as their unpacked files in one xz archive (.dev/site312.tar.xz, ~32 MB:
# made here with `mkdir site312; for w in .whl/*.whl; do python3 -m zipfile -e $w site312; done;
# tar cf - site312 | xz -9 > .dev/site312.tar.xz`).
if [ -f .dev/site312.tar.xz ]; then
  tar xJf .dev/site312.tar.xz -C /tmp && rm -rf /tmp/site && mv /tmp/site312 /tmp/site || exit 1
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
EXT=${EXT:-json}
stage() {
  local name=$1 secs=$2; shift 2
  echo "== $name $(date +%T)"
  timeout "$secs" "$@" > "$R/$name.$EXT" 2> "$R/$name.err"
  echo "rc=$? $(date +%T)"
  tail -n 3 "$R/$name.err"
}
