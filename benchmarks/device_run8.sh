#!/usr/bin/env bash
# Third call (~3 min): the gpuwatch arm of ramp-train and leak again after the fix of the refusal
# (call 7's two ramp-train OOMs and call 6's first leak OOM came after a refusal whose hold set the
# ceiling to the ramp's next batch instead of the last one that ran). Largest fits from calls 6/7.
set -u
R=/tmp/results8; S=/tmp/sessions8; mkdir -p $R $S
. benchmarks/device_env.sh
stage guard 300 python3 benchmarks/bench_guard.py --scenarios ramp-train,leak --arms gpuwatch --seconds 25 \
  --known-fit ramp-train=20,leak=1071 --record $S --out $R/guard_results.json
cat $R/guard.json
tar czf $OUT/results8.tgz -C /tmp results8 sessions8
