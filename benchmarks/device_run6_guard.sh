#!/usr/bin/env bash
# Issue 8's proof, in one call on one H200 (~8 min): the guard scenario suite, five ways each
# (none, accelerate, composer, fixed, gpuwatch), every arm recorded. The shipped model is used when
# this machine's scikit-learn can load it; otherwise the same data is refitted here (no evaluation,
# the shipped threshold kept) and the JSON says so.
#   bash benchmarks/device_run6_guard.sh        (nvidia-h200, .whl carried)
set -u
R=/tmp/results6; S=/tmp/sessions6; mkdir -p $R $S
. benchmarks/device_env.sh
nvidia-smi --query-gpu=index,name,driver_version,power.limit,memory.total --format=csv > $R/gpus.txt
python3 -c "import sklearn, numpy; print('sklearn', sklearn.__version__, 'numpy', numpy.__version__)" | tee $R/versions.txt
MODEL=models/risk.joblib
if ! python3 -c "from gpuwatch.predict.model import load_model; load_model()" 2> $R/model_load.err; then
  THR=$(python3 -c "import json; print(json.load(open('models/risk.manifest.json'))['threshold'])")
  echo "shipped model not loadable here ($(tail -1 $R/model_load.err)); refitting with threshold $THR" | tee $R/model_note.txt
  stage refit 150 python3 -m gpuwatch train --no-eval --stride 2 --threshold "$THR" -o /tmp/risk.joblib
  MODEL=/tmp/risk.joblib
fi
stage guard 540 python3 benchmarks/bench_guard.py --seconds 12 --model $MODEL --record $S --out $R/guard_results.json
cat $R/guard.json | head -40
tar czf $OUT/results6.tgz -C /tmp results6 sessions6
