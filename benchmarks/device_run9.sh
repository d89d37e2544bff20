#!/usr/bin/env bash
# Fourth call (~4 min): what live risk scoring costs after the scorer's rework (1343f51 and later):
# the watched workload's tokens/s with scoring on vs off (ABBA, v2-lite prefill batch 8: launch-bound,
# the most sensitive case), the scorer's CPU per round on this host, and `gpuwatch record` with and
# without scoring side by side with nvidia-smi.
set -u
R=/tmp/results9; mkdir -p $R
. benchmarks/device_env.sh
stage scorer 40 python3 benchmarks/bench_scorer.py --rounds 300
cat $R/scorer.json
stage overhead 150 python3 benchmarks/bench_scorer_overhead.py --preset v2-lite --batch 8 --pairs 6 --window 6
cat $R/overhead.json; tail -8 $R/overhead.err
stage cost 100 python3 benchmarks/bench_sampler.py cost --seconds 60
head -c 700 $R/cost.json
tar czf $OUT/results9.tgz -C /tmp results9
