#!/usr/bin/env bash
# Second call (~8 min): (1) the ramp scenarios of the guard suite again, longer (25 s an arm) and
# starting one ramp level below the edge, since 12 s from batch/4 never reached it in call 6;
# (2) the sampler+recorder cost with and without live risk scoring (call 5 measured `record` with the
# old 10 Hz scorer: 22.7 % of a core, which is what this tree fixes).
#   bash benchmarks/device_run7.sh        (nvidia-h200, .whl carried)
set -u
R=/tmp/results7; S=/tmp/sessions7; mkdir -p $R $S
. benchmarks/device_env.sh
stage cost 100 python3 benchmarks/bench_sampler.py cost --seconds 60
head -c 1500 $R/cost.json
stage guard 400 python3 benchmarks/bench_guard.py --scenarios ramp-train,ramp-prefill --seconds 25 --record $S --out $R/guard_results.json
cat $R/guard.json | head -20
tar czf $OUT/results7.tgz -C /tmp results7 sessions7
