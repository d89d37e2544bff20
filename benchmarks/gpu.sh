#!/usr/bin/env bash
# The one GPU benchmark runner: `bash benchmarks/gpu.sh STAGE [STAGE ...]` on the GPU machine, from the
# project root, with the wheels the machine lacks in .whl/ (../shared/tools/device-wheels.sh). Each stage
# writes under $R; everything is packed into $OUT/gpu-<stages>.tgz at the end (the device tool brings back
# at most 8 files), and recordings into $OUT/gpu-sessions.tgz. Figures go to docs/BENCHMARKS.md with the
# command, raw files to benchmarks/results/. Run from a snapshot of one commit (`git archive HEAD | tar -x
# -C .snap`, carried with .whl and a REV file), so uncommitted edits never reach the GPU machine. Every
# stage is time-limited; a device call is at most 10 minutes, so pick the stages that fit.
#
# Stages (the calls of docs/BENCHMARKS.md that measured each; their one-off device_run*.sh scripts are
# in git history):
#   info        GPUs, driver, torch/triton/transformers/scikit-learn versions, the host CPU source
#   tests       the GPU test suite in one process (tests marked gpu)                        [calls 11-19]
#   kernels     tests/test_kernels.py compiled on the GPU (fused Triton kernels vs torch)   [15, 16]
#   cloop       the sampler child's C loop on the real driver: it loads, tests/test_gpu.py and
#               test_ticker.py, C vs Python loop rows side by side (sampler_loop_check.py)  [19]
#   cost        `gpuwatch record` (1 GPU) side by side with nvidia-smi -lms 100, a bare pynvml loop and
#               the variants, CPU from schedstat, COST_S s (90) x COST_RUNS (2)             [1-9, 13-19]
#   cost2       the same over every GPU, and a GPU-0-only record beside: the cost of one more GPU
#               (skipped with one GPU)                                                      [13, 16]
#   profile     where a tick's CPU goes inside the running `gpuwatch record` (1 GPU)        [11, 13, 15, 16]
#   parts       the sampler's CPU per piece (a wake-up, a tick, a slow read, a hand-over)   [4, 5]
#   threads     where `gpuwatch record`'s CPU goes, per OS thread                           [4]
#   jitter      sample-interval p50/p99/max, idle and beside a busy thread + a matmul loop  [1, 4]
#   memory      nvidia-smi's memory.used/.reserved vs gpuwatch's (NVML v2) and NVML v1      [5]
#   nvml        CPU per NVML call                                                          [2, 3]
#   recorder    CPU per flush: Parquet segment vs IPC stream append                         [13]
#   prometheus  the Prometheus exporter's cost (one scrape a second, the bus full)          [10]
#   scorer      live risk scoring: CPU per round, the workload's tokens/s on vs off (ABBA)  [9]
#   decode      bench_decode.py v2-lite bf16 32x512+128 and 32x512+16, arms DECODE_ARMS (fast,eager),
#               per-kernel profile of the fast step                                        [5, 11-16]
#   v3          bench_decode.py --preset v3-slice (DeepSeek-V3 widths) 16x512+128, every arm  [18]
#   stress      `gpuwatch stress --preset v2-lite --mode decode --batch 32` as a user runs it, recorded;
#               tokens/s and GPU utilization from the recording (stress_check.py)          [11-16]
#   overhead    the cost of watching: watched/bare ABBA pairs of the workload's tokens/s    [1-4]
#   samples     the sample recordings (batch sweep, injected OOMs, ramp to OOM) with a background
#               `gpuwatch record` of it all, and its bytes per GPU-sample                  [1]
#   faults      `stress` with the fault injections (leak, capped ramp, fp16 overflow), recorded [3]
#   tui         the dashboard's CPU, and its effect on the workload's tokens/s             [2]
#   guard       the guard scenario suite against the alternatives (bench_guard.py; GUARD_ARGS, e.g.
#               "--scenarios ramp-train,leak --arms gpuwatch --seconds 25"), every arm recorded [6-8]
#   multi       one workload per GPU (`stress --gpus all`), recorded (skipped with one GPU)  [4]
#   multigpu    issue 19, needs >= 2 GPUs: v2-lite DDP training, 1 GPU (plain stress) vs 2 ranks (torchrun via
#               `stress --nproc 2`, NCCL) at the same batch per GPU, tokens/s scaling (target >= 1.9x),
#               and the 2-rank job's collective check to 1 GiB: all-reduce busbw against NVLink 4's 450 GB/s
#               per direction (target >= 80 %); then v3-slice training sharded with FSDP (`--dp fsdp`, 2
#               ranks; MULTIGPU_FSDP_BATCH, default 4 x 512) - the preset DDP cannot train on one H200: steps,
#               engine, parameter bytes and peak memory per rank in $R/multigpu.json's "fsdp"
#               (benchmarks/multigpu_check.py)
#   fragment    issue 16: the library guard's fragment scenario alone (guard_library.py --only fragment;
#               FRAG_BUDGET s, 120): unguarded must fail from fragmentation, guarded must not  [29]
#   nccl1       NCCL on one GPU (world size 1): `torchrun --nproc-per-node 1 -m gpuwatch stress --preset small
#               --mode train --steps 12 --collectives 64MiB`, the session checked for rank/comm columns and
#               collective events; $R/nccl_smoke.json (benchmarks/nccl_smoke.sh, < 150 s)
#   risk        issue 20: scoring cost per window (bench_scorer.py), `score` of an hour (bench_score.py), the
#               workload's tokens/s in sessions with and without a scorer (bench_scorer_overhead.py, ABBA)
#   nearcap     healthy running at 90-97 % of a memory cap, 8 capped workloads side by side with
#               --guard observe (benchmarks/nearcap.py; NEARCAP_SET=1..6 picks the scenario table,
#               NEARCAP_S the seconds): issue 20's training data
#   firststep   the guard before a session's first step: five held-out first steps (three that ran out of memory
#               under --guard observe) re-run at their caps with --guard on (benchmarks/first_step_guard.py; FIRST_S s)
#   library     the guard in users' loops: plain PyTorch and HF Trainer ramps, healthy, fragment and leak,
#               unguarded vs guarded under a calibrated cap (benchmarks/guard_library.py; <= 4 minutes;
#               the HF Trainer needs accelerate: ../shared/tools/device-wheels.sh accelerate==1.15.0)
set -u
T0=$(date +%s)
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
R=/tmp/gpu-results; mkdir -p $R
S=/tmp/gpu-sessions; mkdir -p $S
. benchmarks/device_env.sh
echo "tree $(cat REV 2>/dev/null || git rev-parse --short HEAD 2>/dev/null)" | tee $R/tree.txt  # REV: written here before a call and carried (the copy's .git can be stale: calls 34-36 printed the session's first HEAD)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt
NG=$(nvidia-smi -L | wc -l)

stage_info() {
  nvidia-smi --query-gpu=index,name,driver_version,power.limit,memory.used,memory.reserved,memory.total,clocks.max.sm \
    --format=csv 2>&1 | tee $R/gpus.txt
  python3 -c "import torch, transformers, sklearn; print('torch', torch.__version__, 'transformers', transformers.__version__,
'sklearn', sklearn.__version__, 'cuda', torch.cuda.is_available())" 2>&1 | tee $R/versions.txt
  python3 -c "import triton; print('triton', triton.__version__)" 2>&1 | tee -a $R/versions.txt
  python3 -c "from gpuwatch.telemetry.host import HostSampler; print('host_cpu_pct source:', HostSampler().cpu_source)" \
    2>&1 | tee -a $R/versions.txt
  python3 -m gpuwatch info > $R/info.txt 2>&1
}
stage_tests() {
  EXT=txt stage gputests "${TESTS_S:-300}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/ -rA
  grep -E "PASSED|FAILED|^E |passed|failed" $R/gputests.txt | tail -n 20
}
stage_kernels() {
  EXT=txt stage kernels 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -rA
  grep -E "PASSED|FAILED|^E |passed|failed" $R/kernels.txt | tail -n 20
}
stage_cloop() {
  python3 -c "from gpuwatch.telemetry import ticker; ticker.load(); print('C loop loads')" 2>&1 | tee $R/cloop_load.txt
  EXT=txt stage cloop_tests 90 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_ticker.py -rA
  grep -E "PASSED|FAILED|^E |passed|failed" $R/cloop_tests.txt | tail -n 12
  stage cloop_check 60 python3 benchmarks/sampler_loop_check.py 8s
  head -c 700 $R/cloop_check.json; echo
}
stage_cost() {
  for k in $(seq "${COST_RUNS:-2}"); do
    stage cost_$k $(( ${COST_S:-90} + 30 )) python3 benchmarks/bench_sampler.py cost --seconds "${COST_S:-90}" --gpus 1 \
      --variants side-by-side
    head -c 1100 $R/cost_$k.json; echo
  done
}
stage_cost2() {
  if [ "$NG" -lt 2 ]; then echo "cost2: one GPU here, skipped"; return; fi
  stage cost2 75 python3 benchmarks/bench_sampler.py cost --seconds 45
  head -c 1300 $R/cost2.json; echo
}
stage_profile() {
  EXT=txt stage profile 40 python3 benchmarks/bench_sampler.py profile --seconds 20 --gpus 1 --json $R/sampler_profile.json
  head -n 48 $R/profile.txt
}
stage_parts() { stage parts 90 python3 benchmarks/bench_sampler.py parts; head -c 2500 $R/parts.json; echo; }
stage_threads() { stage threads 60 python3 benchmarks/bench_sampler.py threads --seconds 40; head -c 1500 $R/threads.json; echo; }
stage_jitter() { stage jitter 80 python3 benchmarks/bench_sampler.py jitter --seconds 30; head -c 1500 $R/jitter.json; echo; }
stage_memory() { stage memory 25 python3 benchmarks/bench_sampler.py memory; head -c 1500 $R/memory.json; echo; }
stage_nvml() { stage nvml 60 python3 benchmarks/bench_nvml.py; head -c 2000 $R/nvml.json; echo; }
stage_recorder() { stage recorder 30 python3 benchmarks/bench_recorder.py --json $R/recorder_results.json; tail -n 6 $R/recorder.err; }
stage_prometheus() { EXT=txt stage prometheus 150 python3 benchmarks/bench_prometheus.py --seconds 30 --blocks 2; cat $R/prometheus.txt; }
stage_scorer() {
  stage scorer 40 python3 benchmarks/bench_scorer.py --rounds 300
  cat $R/scorer.json
  stage scorer_overhead 300 python3 benchmarks/bench_scorer_overhead.py --preset v2-lite --batch 8 --pairs 6 --window 6
  cat $R/scorer_overhead.json; tail -8 $R/scorer_overhead.err
}
stage_library() {
  EXT=txt stage guard_library $(( ${LIB_BUDGET:-200} + 50 )) python3 benchmarks/guard_library.py --out $R/guard_library.json \
    --sessions /tmp/guard-library-sessions --budget-s "${LIB_BUDGET:-200}"
  tail -n 1 $R/guard_library.txt
  tar czf "$OUT/guard-library-sessions.tgz" -C /tmp guard-library-sessions --exclude='hf-*' 2>/dev/null
}
stage_fragment() {  # issue 16: the fragment scenario alone (benchmarks/guard_fragment.py), read criteria.shown first
  EXT=txt stage guard_fragment 200 python3 benchmarks/guard_library.py --out $R/guard_library_fragment.json \
    --sessions /tmp/guard-library-sessions --budget-s "${FRAG_BUDGET:-120}" --only fragment
  tail -n 3 $R/guard_fragment.txt
  python3 -c "import json; d=json.load(open('$R/guard_library_fragment.json')); print(json.dumps(d['scenarios']['fragment'].get('criteria'), indent=1))" 2>&1 | head -40
  tar czf "$OUT/guard-fragment-sessions.tgz" -C /tmp guard-library-sessions 2>/dev/null
}
stage_risk() {  # issue 20: one window's cost, an hour of `score`, and scoring's effect on the workload (ABBA)
  stage risk_scorer 60 python3 benchmarks/bench_scorer.py --rounds 300 --session "${RISK_SESSION:-recordings/h200-nearcap-2026-12-01/nc-v2lite-prefill-b48}"
  cat $R/risk_scorer.json; echo
  stage risk_scorer_steps 60 python3 benchmarks/bench_scorer.py --rounds 300 --steps --session "${RISK_SESSION:-recordings/h200-nearcap-2026-12-01/nc-v2lite-prefill-b48}"
  cat $R/risk_scorer_steps.json; echo
  stage risk_score_hour 150 python3 benchmarks/bench_score.py --minutes 60 --strides "${RISK_STRIDES:-5,1}"
  cat $R/risk_score_hour.json; echo
  stage risk_overhead 300 python3 benchmarks/bench_scorer_overhead.py --preset v2-lite --batch 8 --pairs "${RISK_PAIRS:-4}" --window "${RISK_WINDOW:-6}"
  cat $R/risk_overhead.json; tail -8 $R/risk_overhead.err
}
stage_decode() {
  stage decode 200 python3 benchmarks/bench_decode.py --preset v2-lite --precision bf16 --decode 32x512+128 \
    --prefill "" --late 32x512+16 --arms "${DECODE_ARMS:-fast,eager}" --seconds 4 --eager-reps 2 --budget 150 \
    --profile 32x512+128 --profile-arms fast-dense --out $R/decode_partial.json
  tail -n 30 $R/decode.err
}
stage_v3() {
  stage v3 150 python3 benchmarks/bench_decode.py --preset v3-slice --precision bf16 --decode 16x512+128 \
    --prefill "" --arms fast,fast-dense,fast-unfused,eager --seconds 3 --eager-reps 1 --budget 100 --out $R/v3_partial.json
  tail -n 9 $R/v3.err
}
stage_stress() {
  stage stress 90 python3 -m gpuwatch stress --preset v2-lite --mode decode --batch 32 --duration 45s --no-model \
    -o $S/stress --summary-json $R/stress_summary.json
  REC=$S/stress python3 benchmarks/stress_check.py > $R/stress_check.json 2>&1; head -c 900 $R/stress_check.json; echo
}
stage_overhead() { stage overhead 300 python3 benchmarks/bench_workload.py overhead --pairs 12 --window 6; head -c 2000 $R/overhead.json; echo; }
stage_samples() {
  python3 -m gpuwatch record -o $S/bg > $R/bg.txt 2>&1 & local bg=$!
  stage sweep 150 python3 benchmarks/bench_workload.py sweep --record $S
  stage oom 120 python3 benchmarks/bench_workload.py oom --batch 8 --big-batch 64 --record $S
  stage ramp 150 python3 benchmarks/bench_workload.py ramp --batch 8 --seconds "${RAMP_S:-80}" --record $S
  kill -TERM $bg; wait $bg; cat $R/bg.txt
  python3 - <<'PY' > $R/bg_bytes.json
import json, pathlib, polars as pl
for d in pathlib.Path("/tmp/gpu-sessions/bg").iterdir():
    f = d / "samples.parquet"; n = pl.read_parquet(f).height; b = f.stat().st_size
    print(json.dumps({"session": d.name, "rows": n, "bytes": b, "bytes_per_gpu_sample": round(b / n, 2),
                      "mb_per_gpu_day_10hz": round(b / n * 864000 / 1e6, 2)}))
PY
  cat $R/bg_bytes.json
}
stage_faults() {
  EXT=txt stage leak 90 python3 -m gpuwatch stress --preset small --mode prefill --batch 8 --leak-mib 2048 \
    --gpu-memory-limit 40GiB --duration 45s -o $S/leak
  EXT=txt stage capped_ramp 120 python3 -m gpuwatch stress --preset v2-lite --mode train --schedule ramp --batch 8 \
    --gpu-memory-limit 80GiB --duration 60s -o $S/capped
  EXT=txt stage soak_fp16 90 python3 -m gpuwatch stress --preset small --mode train --schedule soak --precision fp16 \
    --fp16-overflow --duration 30s -o $S/fp16
}
stage_tui() {
  stage tui_cost $(( ${TUI_S:-30} * 2 + 30 )) python3 benchmarks/bench_tui.py cost --seconds "${TUI_S:-30}"
  stage tui_tokens "${TUI_TOKENS_LIMIT:-400}" python3 benchmarks/bench_tui.py tokens --seconds "${TUI_TOKEN_S:-35}" \
    --pairs "${TUI_PAIRS:-3}" --preset v2-lite --batch 8
  head -c 2000 $R/tui_cost.json $R/tui_tokens.json; echo
}
stage_guard() {
  # the shipped model where this machine's scikit-learn loads it; else the same data refitted here (no
  # evaluation, the shipped threshold kept), and guard_model.txt says so
  local model=models/risk.joblib
  if ! python3 -c "from gpuwatch.predict.model import load_model; load_model()" 2> $R/model_load.err; then
    local thr
    thr=$(python3 -c "import json; print(json.load(open('models/risk.manifest.json'))['threshold'])")
    echo "shipped model not loadable here ($(tail -1 $R/model_load.err)); refitting with threshold $thr" | tee $R/guard_model.txt
    EXT=txt stage refit 150 python3 -m gpuwatch train --no-eval --stride 2 --threshold "$thr" -o /tmp/risk.joblib
    model=/tmp/risk.joblib
  fi
  # shellcheck disable=SC2086  # GUARD_ARGS is a list of arguments
  stage guard 540 python3 benchmarks/bench_guard.py --model $model ${GUARD_ARGS:---seconds 12} --record $S/guard \
    --out $R/guard_results.json
  head -n 40 $R/guard.json
}
stage_multi() {
  if [ "$NG" -lt 2 ]; then echo "multi: one GPU here, skipped"; return; fi
  EXT=txt stage multi 150 python3 -m gpuwatch stress --gpus all --preset small --mode train --schedule ramp --duration 60s \
    -o $S/multi
}
stage_multigpu() {
  if [ "$NG" -lt 2 ]; then
    echo "multigpu: needs at least 2 GPUs; this machine has $NG - nothing measured (use a 2-GPU machine)" | tee $R/multigpu.txt >&2
    echo '{"skipped": "needs >= 2 GPUs", "gpus": '"$NG"'}' > $R/multigpu.json
    return 1
  fi
  local M=$S/multigpu B=${MULTIGPU_BATCH:-8} N=${MULTIGPU_STEPS:-30}
  local W="--preset v2-lite --mode train --batch $B --steps $N --no-model --guard off --progress 0"
  EXT=txt stage multigpu-one 300 python3 -m gpuwatch stress $W --device cuda:0 -o $M/one
  GPUWATCH_DIST_TIMEOUT_S=300 CUDA_VISIBLE_DEVICES=0,1 EXT=txt stage multigpu-two 420 \
    python3 -m gpuwatch stress --nproc 2 $W --collectives 1GiB -o $M/two
  GPUWATCH_DIST_TIMEOUT_S=300 CUDA_VISIBLE_DEVICES=0,1 EXT=txt stage multigpu-fsdp 420 \
    python3 -m gpuwatch stress --nproc 2 --dp fsdp --preset v3-slice --mode train --batch "${MULTIGPU_FSDP_BATCH:-4}" \
    --seq-len 512 --steps "${MULTIGPU_FSDP_STEPS:-10}" --no-model --guard off --progress 0 -o $M/fsdp
  python3 benchmarks/multigpu_check.py $M/one $M/two --fsdp $M/fsdp > $R/multigpu.json
  echo "multigpu: rc=$? (0 = both targets met)"; head -c 1500 $R/multigpu.json
}
stage_nccl1() { bash benchmarks/nccl_smoke.sh; head -c 1500 $R/nccl_smoke.json; echo; }
stage_firststep() {  # the guard before a session's first step: held-out first-step OOMs re-run with --guard on
  python3 benchmarks/first_step_guard.py --out /tmp/firststep --seconds "${FIRST_S:-40}" 2>&1 | tee $R/firststep.txt
  cp /tmp/firststep/first_step_guard.json $R/ 2>/dev/null
  tar czf "$OUT/firststep-sessions.tgz" -C /tmp/firststep . 2>/dev/null
}
stage_nearcap() {
  python3 benchmarks/nearcap.py --set "${NEARCAP_SET:-1}" --seconds "${NEARCAP_S:-520}" --out /tmp/nearcap 2>&1 | tee $R/nearcap.txt
  cp /tmp/nearcap/nearcap.json /tmp/nearcap/nvidia-smi.csv $R/ 2>/dev/null
  tar czf "$OUT/nearcap-sessions.tgz" -C /tmp/nearcap sessions calib logs 2>/dev/null
}

for s in "$@"; do
  if ! declare -F "stage_$s" > /dev/null; then echo "no stage $s (see the list at the top of $0)"; continue; fi
  echo "== stage $s $(date +%T)"
  "stage_$s"
done
echo "total $(( $(date +%s) - T0 )) s"
tar czf "$OUT/gpu-$(IFS=-; echo "$*").tgz" -C /tmp gpu-results
if [ -n "$(ls -A $S)" ]; then tar czf "$OUT/gpu-sessions.tgz" -C /tmp gpu-sessions; fi
