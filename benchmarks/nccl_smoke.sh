#!/usr/bin/env bash
# Issue 19's NCCL path on a machine with one GPU (`bash benchmarks/gpu.sh nccl1`, or alone from the project
# root): torchrun with ONE rank (NCCL refuses two ranks on one GPU), so NCCL's init, DDP's gradient
# all-reduce with gpuwatch's comm hook, the control plane and the collective check all run for real, at
# world size 1 (an all-reduce's bus bandwidth is 0 by nccl-tests' formula at n = 1: the figures are not
# the point, the code path is). The session is then checked: rank/world_size/comm columns filled on every
# step, three `collective` events on nccl. Writes /tmp/gpu-results/nccl_smoke.json ("ok": true when every
# check passed) and exits non-zero otherwise. Whole script < 150 s (the run is limited to 110 s).
#
#   NCCL1_STEPS (12), NCCL1_GPU (0: the CUDA device it runs on)
set -u
R=/tmp/gpu-results; mkdir -p $R
D=/tmp/gpu-sessions/nccl1; rm -rf "$D"; mkdir -p "$D"
T0=$(date +%s)
CUDA_VISIBLE_DEVICES=${NCCL1_GPU:-0} GPUWATCH_DIST_TIMEOUT_S=60 timeout 110 \
  python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m gpuwatch stress --preset small --mode train \
  --steps "${NCCL1_STEPS:-12}" --collectives 64MiB --no-model --guard off --progress 0 -o "$D" \
  > $R/nccl_smoke.txt 2> $R/nccl_smoke.err
RC=$?
python3 - "$D" "$RC" "$(( $(date +%s) - T0 ))" "${NCCL1_STEPS:-12}" > $R/nccl_smoke.json <<'PY'
import json, pathlib, sys

import polars as pl

from gpuwatch.recording.reader import open_recording

root, rc, secs, want = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
out = {"rc": rc, "seconds": secs, "checks": {}}
found = sorted(p for p in root.iterdir() if (p / "meta.json").exists()) if root.exists() else []
if not found:
    out.update(ok=False, error=f"no session under {root}")
else:
    rec = open_recording(found[-1])
    st, ev = rec.steps, rec.events
    meta = json.loads((rec.path / "meta.json").read_text())
    dist = ((meta.get("config") or {}).get("workloads") or [{}])[0].get("distributed") or {}
    coll = [json.loads(d) for d in ev.filter(pl.col("kind") == "collective")["detail"]]
    c = out["checks"]
    c["exit_0"] = rc == 0
    c["schema_v3"] = meta.get("schema_version", 0) >= 3
    c["backend_nccl"] = dist.get("backend") == "nccl"
    c["steps_all"] = st.height == want
    for col in ("rank", "world_size", "comm_time_s", "comm_bytes"):
        c[f"{col}_filled"] = st.height > 0 and col in st.columns and st[col].null_count() == 0
    c["comm_bytes_positive"] = st.height > 0 and (st["comm_bytes"].fill_null(0) > 0).all()
    c["rank_0_world_1"] = st.height > 0 and st["rank"].unique().to_list() == [0] and st["world_size"].unique().to_list() == [1]
    c["collectives_3_ops"] = sorted(d.get("op") for d in coll) == ["all_gather", "all_reduce", "reduce_scatter"]
    c["collectives_on_nccl"] = bool(coll) and all(d.get("backend") == "nccl" for d in coll)
    c["collectives_to_64MiB"] = bool(coll) and all(d["rows"][-1]["bytes"] == 64 * 2**20 for d in coll)
    c["no_workload_error"] = ev.filter(pl.col("kind") == "workload_error").height == 0
    c["under_150s"] = secs < 150
    out.update(ok=all(c.values()), session=str(rec.path), distributed=dist, steps=st.height,
               comm_time_s_p50=st["comm_time_s"].median() if st.height else None,
               comm_bytes=st["comm_bytes"].max() if st.height else None,
               tokens_per_s_p50=st["tokens_per_s"].median() if st.height else None,
               collectives={d.get("op"): {"rows": len(d["rows"]), "max_bytes": d["rows"][-1]["bytes"],
                                          "algbw_at_max_gbps": d["rows"][-1].get("algbw_gbps")} for d in coll})
err = pathlib.Path("/tmp/gpu-results/nccl_smoke.err")
out["stderr_tail"] = err.read_text(errors="replace")[-1500:] if not out.get("ok") and err.exists() else None
print(json.dumps(out, indent=1, default=str))
sys.exit(0 if out.get("ok") else 1)
PY
OK=$?
echo "nccl1: $([ $OK = 0 ] && echo ok || echo FAILED) in $(( $(date +%s) - T0 )) s (rc $RC); $R/nccl_smoke.json"
exit $OK
