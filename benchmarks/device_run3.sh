#!/usr/bin/env bash
# Third GPU call: sampler cost after moving energy to 10 s and PCIe to counters; the watching-overhead
# pairs; and `gpuwatch stress` end to end with the fault injections (recordings kept as samples).
# Run from the repo root on the GPU machine with .whl carried:  bash benchmarks/device_run3.sh
set -u
R=/tmp/results3; S=/tmp/sessions3; mkdir -p $R $S
EXT=txt
. benchmarks/device_env.sh
stage nvml 60 python3 benchmarks/bench_nvml.py
stage cost 100 python3 benchmarks/bench_sampler.py cost --seconds 45
stage overhead 200 python3 benchmarks/bench_workload.py overhead --pairs 6 --window 8
stage leak 90 python3 -m gpuwatch stress --preset small --mode prefill --batch 8 --leak-mib 2048 --gpu-memory-limit 40GiB --duration 45s -o $S/leak
stage capped_ramp 120 python3 -m gpuwatch stress --preset v2-lite --mode train --schedule ramp --batch 8 --gpu-memory-limit 80GiB --duration 60s -o $S/capped
stage soak_fp16 90 python3 -m gpuwatch stress --preset small --mode train --schedule soak --precision fp16 --fp16-overflow --duration 30s -o $S/fp16
cat $R/nvml.txt $R/cost.txt $R/overhead.txt | head -c 5000
tar czf $OUT/results3.tgz -C /tmp results3 sessions3
