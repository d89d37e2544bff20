"""Summarise a `gpuwatch stress` recording: steps tokens/s, GPU util over the steps, compile events
(the `stress` stage of benchmarks/gpu.sh). REC=<output dir> python benchmarks/stress_check.py"""
import glob, json, os, sys
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import polars as pl
from gpuwatch.recording.reader import open_recording
d = sorted(glob.glob(os.environ.get("REC", "/tmp/rec11") + "/*"))[-1]
s = open_recording(d)
st, sm, ev = s.steps, s.samples, s.events
run = st.filter(pl.col("phase") != "warmup") if "phase" in st.columns else st
t0, t1 = run["ts"].min(), run["ts"].max()
gpus = [g for g in run["gpu"].unique().to_list() if g is not None]  # the workload's GPU(s), not idle ones
win = sm.filter((pl.col("ts") >= t0) & (pl.col("ts") <= t1) & (pl.col("gpu").is_in(gpus) if gpus else True))
out = {"steps": st.height, "tokens_per_s_median": run["tokens_per_s"].median(), "step_s_median": run["step_time_s"].median(),
       "expert_impl": run["expert_impl"].unique().to_list(), "gpu_util_mean_pct": win["gpu_util_pct"].mean(),
       "gpu_util_p10_pct": win["gpu_util_pct"].quantile(0.1), "power_mean_w": win["gpu_power_w"].mean(),
       "compile_events": ev.filter(pl.col("kind") == "compile").select("message", "detail").to_dicts()}
print(json.dumps(out, indent=1, default=str))
