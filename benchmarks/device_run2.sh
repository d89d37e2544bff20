#!/usr/bin/env bash
# Second GPU call: NVML per-field costs, sampler+recorder cost with the counter-based slow fields,
# the OOM-injection run, the watching-overhead pairs, and the TUI's cost and its effect on tokens/s.
# Run from the repo root on the GPU machine with .whl carried:  bash benchmarks/device_run2.sh
set -u
R=/tmp/results2; S=/tmp/sessions2; mkdir -p $R $S
EXT=json
. benchmarks/device_env.sh
stage nvml 60 python3 benchmarks/bench_nvml.py
stage cost 100 python3 benchmarks/bench_sampler.py cost --seconds 45
stage tui_cost 80 python3 benchmarks/bench_tui.py cost --seconds 30
stage oom 120 python3 benchmarks/bench_workload.py oom --batch 8 --big-batch 64 --record $S
stage overhead 170 python3 benchmarks/bench_workload.py overhead --pairs 8 --window 8
stage tui_tokens 200 python3 benchmarks/bench_tui.py tokens --seconds 35 --pairs 2
cat $R/*.json | head -c 6000
tar czf $OUT/results2.tgz -C /tmp results2 sessions2
