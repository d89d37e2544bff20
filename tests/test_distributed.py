"""Multi-rank stress over torch.distributed, on a CPU with gloo and two processes (issue 19): DDP
training with every rank's steps in rank 0's one session, the collective bandwidth check, the guard's
decision applied by every rank at the same step, and a fault on one rank: an OOM in forward survived by
both ranks, an OOM in backward stopping the job cleanly with its reason. Every run has a timeout, so a
hang fails the test instead of blocking CI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from gpuwatch.recording import schema
from gpuwatch.recording.reader import open_recording as read_session
from gpuwatch.workload import collectives as C
from gpuwatch.workload.comm import CommMeter

from conftest import RAMP, ROOT

TINY = ["--device", "cpu", "--preset", "tiny", "--mode", "train", "--batch", "4", "--seq-len", "32",
        "--set", "num_hidden_layers=1", "--no-model", "--progress", "0"]


def _torchrun(env, args, timeout=150, n=2, extra_env=None):
    e = {**env, "GPUWATCH_DIST_TIMEOUT_S": "30", **(extra_env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *args]
    return subprocess.run(cmd, env=e, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _session(out: Path):
    (d,) = [p for p in out.iterdir() if p.is_dir()]
    return d, read_session(d)


def test_sizes_and_bus_factors():
    assert C.sizes(64) == [8, 16, 32, 64]
    assert C.sizes(2**30)[-1] == 2**30 and len(C.sizes(2**30)) == 28  # 8 B .. 1 GiB, as nccl-tests -b 8 -e 1G -f 2
    assert C.bus_factor("all_reduce", 2) == 1.0 and C.bus_factor("all_reduce", 8) == 1.75
    assert C.bus_factor("all_gather", 8) == C.bus_factor("reduce_scatter", 8) == 0.875
    msg, fig = C.summary("all_reduce", [{"bytes": 2**30, "time_us": 1.0, "algbw_gbps": 200.0, "busbw_gbps": 400.0}], 450.0)
    assert "89% of 450 GB/s" in msg and fig["fraction_of_peak"] == pytest.approx(400 / 450)


def test_comm_time_is_the_union_of_bucket_spans():
    import torch

    m = CommMeter(torch.device("cpu"), 2)
    m.reset()
    m.ref = 0.0
    m.spans = [[0.1, 0.3], [0.2, 0.4], [0.5, 0.6], [0.55, None]]  # overlapping buckets count once
    m.bytes = 100
    secs, nbytes = m.result()
    assert secs == pytest.approx(0.4) and nbytes == 100


@pytest.mark.parametrize("name,version", [("sample-h200-guard-ramp-train", 2), ("sample-h200-ramp-train", 1)])
def test_older_sessions_read_with_rank_null(name, version):
    """The shipped H200 recordings are schema 2 and 1: they read, their steps with the v3 columns null."""
    folder = RAMP.parent / name
    assert json.loads((folder / "meta.json").read_text())["schema_version"] == version
    data = read_session(folder)
    assert data.steps.height > 0 and not data.warnings
    for col in ("rank", "world_size", "comm_time_s", "comm_bytes"):
        assert data.steps[col].null_count() == data.steps.height


@pytest.mark.slow
def test_two_ranks_one_session_and_collectives(env, tmp_path):
    """`stress --nproc 2` relaunches itself under torchrun: DDP on gloo, both ranks' steps in one session."""
    r = subprocess.run([sys.executable, "-m", "gpuwatch", "stress", "--nproc", "2", *TINY, "--steps", "3",
                        "--collectives", "4KiB", "-o", str(tmp_path)], env={**env, "GPUWATCH_DIST_TIMEOUT_S": "30"},
                       cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    d, data = _session(tmp_path)
    assert json.loads((d / "meta.json").read_text())["schema_version"] == schema.SCHEMA_VERSION
    steps = data.steps
    assert sorted(steps["rank"].to_list()) == [0, 0, 0, 1, 1, 1]
    assert set(steps["world_size"].to_list()) == {2}
    assert steps["comm_bytes"].min() > 0 and steps["comm_time_s"].min() > 0
    assert steps.filter(pl.col("rank") == 0)["comm_bytes"].to_list() == steps.filter(pl.col("rank") == 1)["comm_bytes"].to_list()
    ev = data.events.filter(pl.col("kind") == "collective")
    assert sorted(ev["message"].str.split(":").list.first().to_list()) == sorted(C.OPS)
    for det in map(json.loads, ev["detail"]):
        rows = det["rows"]
        assert rows and rows[-1]["bytes"] == 4096 and det["backend"] == "gloo" and det["world_size"] == 2
        for row in rows:
            assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * C.bus_factor(det["op"], 2))
            assert row["algbw_gbps"] == pytest.approx(row["bytes"] / row["time_us"] / 1e3)


def test_every_parameter_gets_a_gradient_even_where_routing_leaves_experts_unused():
    """Why DDP needs no find_unused_parameters: transformers 5 keeps a MoE layer's experts as one fused
    Parameter each for gate/up and down, so experts no token was routed to (2 tokens x top-2 of 8 here)
    still take part in autograd with a zero slice of the gradient."""
    import torch

    from gpuwatch.workload import model as M
    from gpuwatch.workload.distributed import every_param_takes_part
    from gpuwatch.workload.presets import config_fields

    model, _ = M.build_model(config_fields("tiny", {"num_hidden_layers": 2}), torch.device("cpu"), "fp32")
    assert every_param_takes_part(model)
    model.train()
    ids = torch.tensor([[5, 9]])
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert missing == []
    routed = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    assert routed and all((m.experts.gate_up_proj.grad.flatten(1).abs().sum(1) == 0).any() for m in routed)  # unrouted


def test_a_layout_with_one_module_per_expert_keeps_find_unused():
    import torch

    from gpuwatch.workload.distributed import every_param_takes_part

    class Moe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    assert not every_param_takes_part(torch.nn.Sequential(Moe()))


@pytest.mark.slow
def test_ddp_on_two_ranks_prints_no_find_unused_parameters_warning(env):
    r = subprocess.run([sys.executable, "-m", "gpuwatch", "stress", "--nproc", "2", *TINY, "--steps", "2",
                        "--no-record"], env={**env, "GPUWATCH_DIST_TIMEOUT_S": "30"}, cwd=ROOT, capture_output=True,
                       text=True, timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "find_unused_parameters" not in r.stderr + r.stdout, (r.stderr + r.stdout)[-3000:]


@pytest.mark.slow
def test_guard_decision_applied_by_every_rank_at_the_same_step(env):
    r = _torchrun(env, [str(ROOT / "tests" / "support" / "ddp_guard_worker.py")])
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["state"] == "finished"
    by_rank = {k: sorted((x for x in out["rows"] if x["rank"] == k), key=lambda x: x["step"]) for k in (0, 1)}
    for k, rows in by_rank.items():
        assert [x["step"] for x in rows] == [0, 1, 2, 3], k
        assert [x["precision"] for x in rows] == ["fp32", "fp32", "bf16", "bf16"], k
        assert [x["micro_batches"] for x in rows] == [1, 1, 2, 2], k  # ceiling 2 < batch 4: accumulation
    # rank 1 says it applied rank 0's decision, at the step rank 0 decided it
    applied = [e for e in out["events"] if e["kind"] == "control" and e["rank"] == 1]
    assert len(applied) == 2 and {e["at_step"] for e in applied} == {2}


@pytest.mark.slow
def test_guard_decides_on_the_riskiest_rank(env):
    """Rank 1 (not rank 0) is the one near its limit: its risk reaches rank 0 with its step rows, the real
    guard decides on it (the max over ranks), and both ranks apply the lower ceiling at the same step."""
    r = _torchrun(env, [str(ROOT / "tests" / "support" / "ddp_guard_worker.py"), "--worst-rank"],
                  extra_env={"GPUWATCH_SIM_RISK": "1:2:0.9"})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["state"] == "finished"
    acts = [e for e in out["events"] if e["kind"] == "guard_action"]
    assert len(acts) == 1 and acts[0]["decided_on_rank"] == 1 and acts[0]["value"] == 3
    for k in (0, 1):  # rank 1 said it before step 2; rank 0 decided before step 3; both ran step 3 at ceiling 3
        rows = sorted((x for x in out["rows"] if x["rank"] == k), key=lambda x: x["step"])
        assert [x["step"] for x in rows] == [0, 1, 2, 3], k
        assert [x["micro_batches"] for x in rows] == [1, 1, 1, 2], k
    applied = [e for e in out["events"] if e["kind"] == "control" and e["rank"] == 1]
    assert len(applied) == 1 and applied[0]["at_step"] == 3


@pytest.mark.slow
def test_oom_on_one_rank_is_survived_by_all(env, tmp_path):
    js = tmp_path / "summary.json"
    r = _torchrun(env, ["-m", "gpuwatch", "stress", *TINY, "--steps", "3", "-o", str(tmp_path / "rec"),
                        "--summary-json", str(js)], extra_env={"GPUWATCH_SIM_OOM": "1:1"})
    assert r.returncode == 0, r.stderr[-3000:]
    # the summary counts every rank's OOMs: rank 1's one, in the total and per rank
    (w,) = json.loads(js.read_text())["workloads"]
    assert w["ooms"] == 1 and w["recovered"] == 1 and w["steps"] == 3
    by = {c["rank"]: c for c in w["ranks"]}
    assert sorted(by) == [0, 1] and by[0]["ooms"] == 0 and by[1]["ooms"] == 1 and by[1]["recovered"] == 1
    assert by[0]["lost_steps"] == 1 and by[0]["state"] == by[1]["state"] == "finished"
    assert by[0]["steps"] == by[1]["steps"] == 3
    assert "1 OOM (1 recovered)" in r.stdout and "rank 1 finished, 3 steps, 1 OOM (1 recovered)" in r.stdout
    _, data = _session(tmp_path / "rec")
    steps = data.steps
    for k in (0, 1):  # the same steps on both ranks; the batch halved on both from the same step on
        mine = steps.filter(pl.col("rank") == k).sort("step")
        assert mine["step"].to_list() == [0, 1, 2], k
        assert mine["batch"].to_list() == [4, 2, 2], k
    ev = data.events
    oom = ev.filter(pl.col("kind") == "oom")
    assert oom.height == 1 and json.loads(oom["detail"][0])["rank"] == 1
    peer = [json.loads(x) for x in ev.filter(pl.col("kind") == "oom_recovered")["detail"]]
    assert {d.get("rank") for d in peer} == {0, 1}


@pytest.mark.slow
def test_fsdp_shards_per_layer_and_survives_an_oom_on_one_rank(env, tmp_path):
    """`--dp fsdp`: FSDP2's fully_shard per decoder layer on gloo; each rank holds about half the
    parameters; the engine is in the meta; rank 1's OOM (before its forward) is survived by both."""
    r = _torchrun(env, ["-m", "gpuwatch", "stress", *TINY[:-5], "--set", "num_hidden_layers=2", "--no-model",
                        "--progress", "0", "--dp", "fsdp", "--steps", "3", "-o", str(tmp_path)],
                  extra_env={"GPUWATCH_SIM_OOM": "1:1"})
    assert r.returncode == 0, r.stderr[-3000:]
    d, data = _session(tmp_path)
    dist_meta = json.loads((d / "meta.json").read_text())["config"]["workloads"][0]["distributed"]
    assert dist_meta["dp"] == "fsdp" and "fully_shard" in dist_meta["engine"]
    eng = [json.loads(x) for x in data.events.filter(pl.col("kind") == "dp_engine")["detail"]]
    assert sorted(e["rank"] for e in eng) == [0, 1]
    for e in eng:
        assert e["param_bytes_here"] <= 0.55 * e["param_bytes_full"]  # sharded: about 1/2 each
    for k in (0, 1):
        mine = data.steps.filter(pl.col("rank") == k).sort("step")
        assert mine["step"].to_list() == [0, 1, 2] and mine["batch"].to_list() == [4, 2, 2], k
        assert mine["comm_bytes"].null_count() == 3 and mine["loss"].is_finite().all()


@pytest.mark.slow
def test_fsdp_accumulates_and_refuses_a_precision_change(env):
    r = _torchrun(env, [str(ROOT / "tests" / "support" / "ddp_guard_worker.py"), "--fsdp"])
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for k in (0, 1):
        rows = sorted((x for x in out["rows"] if x["rank"] == k), key=lambda x: x["step"])
        assert [x["micro_batches"] for x in rows] == [1, 1, 2, 2] and {x["precision"] for x in rows} == {"fp32"}
    assert [e["value"] for e in out["events"] if e["kind"] == "control_refused"] == ["bf16"]


@pytest.mark.slow
def test_oom_in_backward_stops_every_rank_with_the_reason(env, tmp_path):
    r = _torchrun(env, ["-m", "gpuwatch", "stress", *TINY, "--steps", "4", "-o", str(tmp_path)],
                  extra_env={"GPUWATCH_SIM_OOM": "1:1:backward"})
    assert r.returncode != 0
    d, data = _session(tmp_path)
    assert json.loads((d / "meta.json").read_text())["complete"] is True  # rank 0 closed its recording
    err = data.events.filter(pl.col("kind") == "workload_error")
    assert err.height >= 1 and "rank 1: OOM in backward at step 1" in err["message"][0]


def test_bad_input_is_one_line(env, tmp_path):
    for args, want in ((["--collectives", "4KiB"], "needs several ranks"),
                       (["--nproc", "0"], "--nproc"), (["--dp", "fsdp"], "--dp fsdp needs several ranks"),
                       (["--nproc", "2", "--dp", "fsdp", "--mode", "prefill"], "--mode train")):
        r = subprocess.run([sys.executable, "-m", "gpuwatch", "stress", *TINY, "-o", str(tmp_path), *args], env=env,
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and want in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = subprocess.run([sys.executable, "-m", "gpuwatch", "stress", *TINY, "-o", str(tmp_path)],
                       env={**env, "WORLD_SIZE": "2", "RANK": "x"}, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "RANK" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


SHIPPED = RAMP.parent / "cpu-gloo-2rank-train"


def test_ranks_and_straggler_from_the_shipped_session():
    from gpuwatch.recording.ranks import collectives, rank_stats, straggler

    data = read_session(SHIPPED)
    stats = rank_stats(data.steps.sort("ts").to_dicts(), last=10**9)
    assert [s.rank for s in stats] == [0, 1] and all(s.steps == 8 and s.comm_bytes for s in stats)
    slow = straggler(stats)
    assert slow.step_s == max(s.step_s for s in stats) and slow.excess >= 0
    assert [c["op"] for c in collectives(data.events.to_dicts())] == list(C.OPS)
    assert rank_stats([{"rank": 0, "step_time_s": 1.0}]) == []  # one rank: nothing to compare


def test_report_has_ranks_and_collectives(tmp_path):
    from gpuwatch.report import write_report

    for fmt in ("md", "html"):
        out = write_report(SHIPPED, tmp_path / f"r.{fmt}", fmt)
        text = out.read_text()
        assert "Ranks and collectives" in text and "(slowest)" in text or "slowest" in text
        for op in C.OPS:
            assert op in text
