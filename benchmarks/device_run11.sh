#!/usr/bin/env bash
# Issue #10, call 11 (one H200, ~6 minutes, every stage time-limited), run from a snapshot of one commit:
#   rm -rf .snap && mkdir .snap && git archive HEAD | tar -x -C .snap     (here; carry .snap and .whl)
#   cd .snap && ln -s ../.whl .whl && bash benchmarks/device_run11.sh     (there)
# stages:
#   gputest  tests/test_decode.py -m gpu: the fast path's graphs replay exactly what its eager run computes,
#            bf16 agreement with transformers, re-capture on batch/precision change, small prefill graphs
#   profile  where one decode token's GPU time goes (torch.profiler, by kernel): transformers' forward,
#            fast path with dense experts, fast path with the model's experts module (grouped_mm)
#   decode   bench_decode.py v2-lite bf16: 32x512+16 (the issue's config) and 32x512+128 (stress's new
#            default), arms eager / hf (call 5's graphs) / fast / fast-module; prefill 1, 4, 8 x 512
#   stress   `gpuwatch stress --preset v2-lite --mode decode --batch 32` as a user runs it, 45 s, recorded:
#            steps' tokens/s, GPU utilization from the recording, the compile event
#   sampler  bench_sampler.py profile --seconds 30: where a tick's CPU goes in the running `gpuwatch record`
set -u
R=/tmp/results11; mkdir -p $R
. benchmarks/device_env.sh
T0=$(date +%s)
git_rev=$(cat REV 2>/dev/null || echo unknown); echo "tree $git_rev" | tee $R/tree.txt
nvidia-smi --query-gpu=index,name,driver_version,power.limit,memory.used,memory.total,clocks.max.sm --format=csv > $R/gpus.txt 2>&1
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.is_available())" > $R/versions.txt 2>&1
cat $R/gpus.txt $R/versions.txt
EXT=txt stage gputest 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_decode.py -rA -x -s
tail -n 8 $R/gputest.txt
stage decode 270 python3 benchmarks/bench_decode.py --preset v2-lite --precision bf16 --decode 32x512+16 \
  --prefill 1x512,4x512,8x512 --late 32x512+128 --arms eager,hf,fast,fast-module --seconds 4 --eager-reps 2 \
  --budget 200 --profile 32x512 --out $R/decode_partial.json
tail -n 45 $R/decode.err
stage stress 110 python3 -m gpuwatch stress --preset v2-lite --mode decode --batch 32 --duration 50s --no-model \
  -o /tmp/rec11 --summary-json $R/stress_summary.json
python3 - <<'PY' > $R/stress_check.json 2>&1
import json, glob, polars as pl
from gpuwatch.recording.reader import open_recording
d = sorted(glob.glob("/tmp/rec11/*"))[-1]
s = open_recording(d)
st, sm, ev = s.steps, s.samples, s.events
run = st.filter(pl.col("phase") != "warmup") if "phase" in st.columns else st
t0, t1 = run["ts"].min(), run["ts"].max()
win = sm.filter((pl.col("ts") >= t0) & (pl.col("ts") <= t1))
out = {"steps": st.height, "tokens_per_s_median": run["tokens_per_s"].median(), "step_s_median": run["step_time_s"].median(),
       "expert_impl": run["expert_impl"].unique().to_list(), "gpu_util_mean_pct": win["gpu_util_pct"].mean(),
       "gpu_util_p10_pct": win["gpu_util_pct"].quantile(0.1), "power_mean_w": win["gpu_power_w"].mean(),
       "compile_events": ev.filter(pl.col("kind") == "compile").select("message", "detail").to_dicts()}
print(json.dumps(out, indent=1, default=str))
PY
cat $R/stress_check.json | head -40
stage sampler 60 python3 benchmarks/bench_sampler.py profile --seconds 30 --json $R/sampler_profile.json
tail -n 40 $R/sampler.json
echo "total $(( $(date +%s) - T0 )) s"
tar czf $OUT/results11.tgz -C /tmp results11
