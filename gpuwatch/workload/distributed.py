"""Data-parallel training over torch.distributed: `torchrun --nproc-per-node N -m gpuwatch stress ...`.

Every rank is one process on its own device (cuda:LOCAL_RANK with NCCL, the CPU with gloo). Rank 0 runs
the whole session (sampler, recorder, scorer, guard, dashboard); the other ranks run the workload only.
The model is wrapped in torch's `DistributedDataParallel` (train mode: the gradients are all-reduced in
backward by DDP's own reducer); gpuwatch adds a comm hook that times the all-reduce and counts its bytes
(`comm.CommMeter`).

The ranks agree through a second process group, gloo on the CPU (the control plane, a few hundred bytes a
step, never in the way of NCCL's streams):
  * before every step one `all_gather_object`: rank 0's decision (stop, pause, the schedule's state, the
    controls it applied - batch ceiling, hold, precision - so every rank applies them at the same step)
    and every rank's step rows, events, counters (OOMs...) and GPU identity of the previous step (rank 0
    records them: one session, a `rank` column; its guard decides on the riskiest rank's figures);
  * after forward and backward one all-reduce (max) of two flags, "OOM" and "non-finite": an OOM on any
    rank makes every rank skip the update of that step and back off together (the rank that failed in
    forward first joins the gradient all-reduce with zero gradients, so nobody waits alone).
An OOM inside backward cannot rejoin DDP's reducer: that rank writes its reason to the rendezvous store and
fails; the others' collectives fail (peer gone) or time out (`GPUWATCH_DIST_TIMEOUT_S`, default 600 s),
and every rank stops with that reason in its `workload_error` event. Never a hang past the timeout.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from gpuwatch.contract import next_step_columns
from gpuwatch.errors import UsageError
from gpuwatch.telemetry.bus import Bus
from gpuwatch.workload import flops as F
from gpuwatch.workload import mechanics as X
from gpuwatch.workload import model as M
from gpuwatch.workload.allocator import release_cache
from gpuwatch.workload.comm import CommMeter
from gpuwatch.workload.dist_init import DistContext, shutdown
from gpuwatch.workload.runner import Workload, WorkloadConfig

ENV_SIM_OOM = "GPUWATCH_SIM_OOM"  # tests: "RANK:STEP[:backward]" - a simulated OOM on that rank at that step
ENV_SIM_RISK = "GPUWATCH_SIM_RISK"  # tests: "RANK:STEP:RISK" - that rank reports that risk before that step


def _sim_oom() -> tuple[int, int, str] | None:
    text = os.environ.get(ENV_SIM_OOM)
    if not text:
        return None
    parts = text.split(":")
    try:
        return int(parts[0]), int(parts[1]), parts[2] if len(parts) > 2 else "forward"
    except (IndexError, ValueError):
        raise UsageError(f"{ENV_SIM_OOM}={text!r}: use RANK:STEP or RANK:STEP:backward") from None


def _sim_risk() -> tuple[int, int, float] | None:
    text = os.environ.get(ENV_SIM_RISK)
    if not text:
        return None
    try:
        r, step, risk = text.split(":")
        return int(r), int(step), float(risk)
    except ValueError:
        raise UsageError(f"{ENV_SIM_RISK}={text!r}: use RANK:STEP:RISK") from None


class RankFailed(RuntimeError):
    """This rank cannot go on with the others (an OOM inside backward): the job stops with the reason."""


class DistributedWorkload(Workload):
    """gpuwatch's workload as one rank of a data-parallel job (see the module's docstring)."""

    honours_deadline = False  # its ranks step together (_decide): a deadline would have to reach them all
    cancellable_build = False  # nor may one rank abandon the build the others finish (DDP's constructor is a collective)

    def __init__(self, bus: Bus, cfg: WorkloadConfig, ctx: DistContext, dp: str = "ddp") -> None:
        super().__init__(bus, cfg)
        self.ctx = ctx
        self.dp = dp  # "ddp" or "fsdp" (gpuwatch/workload/fsdp.py)
        self.engine = "DistributedDataParallel" if dp == "ddp" else _fsdp().engine_name()
        self.rank = ctx.rank
        self.ddp: DDP | None = None
        self.meter = CommMeter(self.device, ctx.world)
        self._gen.manual_seed(cfg.seed * 1_000_003 + ctx.rank)  # each rank its own data
        self._applied: list[tuple[str, Any, str, str]] = []
        self._rewrap = False
        self._stage = "idle"
        self._sim = _sim_oom()
        self._sim_risk = _sim_risk()
        self.nvml_index = None  # rank 0: the Session's CUDA device -> NVML index (a peer's GPU's risk)
        self.peer_risk: dict[int, dict[str, Any]] = {}  # rank 0: what each rank said of its own risk
        self.peer_gpu: dict[int, int | None] = {}  # rank 0: each rank's NVML index on this host (None: unknown)
        self.peer_counts: dict[int, dict[str, Any]] = {}  # rank 0: each rank's own counters (OOMs...), latest
        self._out = {"steps": bus.steps.next_seq, "events": bus.events.next_seq}  # what the others have not seen
        self.peers: dict[int, dict[str, Any]] = {}  # rank 0: each rank's last step row
        self.collectives_max: int | None = None  # run the bandwidth check first (bytes), set by the front end
        self.collectives_peak: float | None = None

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "distributed": {**self.ctx.describe(), "dp": self.dp, "engine": self.engine}}

    # -- DDP ----------------------------------------------------------------------------------------
    def build(self) -> None:
        """Build the model as a single-GPU workload does, then wrap it for data parallelism (train)."""
        super().build()
        if self.cfg.mode == "train":
            self._wrap()

    def _wrap(self) -> None:
        """(Re)wrap the model in DDP: after a precision change the reducer's buckets must be rebuilt.
        Every rank does it at the same step (DDP's constructor is a collective). FSDP: sharded once."""
        if self.dp == "fsdp":
            self.ddp, self.engine = _fsdp().shard(self.model, self.device)
            from gpuwatch.workload.tuning import make_optimizer

            self.optimizer = make_optimizer(self.ddp, self.cfg.tuning)  # over the shards (--tune optimizer=)
            here, full = _fsdp().param_bytes(self.ddp)
            self.bus.emit("dp_engine", f"rank {self.rank}: {self.engine}, one unit per decoder layer; holds "
                          f"{here / 2**20:.1f} of {full / 2**20:.1f} MiB of parameters", gpu=self.cfg.gpu_index,
                          rank=self.rank, engine=self.engine, param_bytes_here=here, param_bytes_full=full)
            self._rewrap = False
            return
        self.ddp = None
        ids = [self.device.index] if self.device.type == "cuda" else None
        # find_unused_parameters only where a step can leave a parameter without a gradient (one module per
        # expert); with transformers 5's fused experts every parameter takes part, and the flag only cost an
        # extra graph traversal a step and torch's warning on every rank
        unused = not every_param_takes_part(self.model)
        with warnings.catch_warnings():  # broadcast_buffers: deprecated in torch 2.13, the only spelling in 2.11
            warnings.simplefilter("ignore", FutureWarning)
            self.ddp = DDP(self.model, device_ids=ids, broadcast_buffers=False, find_unused_parameters=unused,
                            gradient_as_bucket_view=True)  # no second copy of the gradients
        self.ddp.register_comm_hook(None, self.meter.hook)
        self._rewrap = False

    # -- the control plane -----------------------------------------------------------------------------
    def accepts(self) -> frozenset[str]:
        # the planner's plan and checkpointing are not offered across ranks yet (each rank would switch its own
        # model between steps; not measured under DDP/FSDP): the threshold rule decides for a job
        return super().accepts() - {"plan", "checkpointing"} - ({"precision"} if self.dp == "fsdp" else set())

    def _apply_controls(self) -> None:
        with self._lock:
            if self.dp == "fsdp" and "precision" in self._pending:
                value, who, _ = self._pending.pop("precision")
                self.bus.emit("control_refused", f"precision -> {value} ({who}) not applied: under FSDP the "
                              "shards would have to be rebuilt", "warning", gpu=self.cfg.gpu_index, control="precision",
                              value=value, who=who, rank=self.rank)
            self._applied = [(k, v[0], v[1], v[2]) for k, v in self._pending.items()]
        was = self.precision
        super()._apply_controls()
        if self.precision != was and self.ddp is not None:
            self._rewrap = True

    def _decide(self) -> dict[str, Any]:
        """Rank 0: the guard, the user's keys and the schedule decide the next step, once for all ranks."""
        if not self._resume.is_set() and not self._stop.is_set():
            self.state = "paused"
            if not self._resume.wait(1.0):
                return {"stop": False, "step": False}
        if self.guard is not None and not self.manual and not self._stop.is_set():
            self.guard.before_step(self, worst=self._worst_rank())
        self._apply_controls()
        self._maybe_snapshot()
        plan = self.schedule.wanted()
        finished = plan is None or bool(self.cfg.max_steps and self._step >= self.cfg.max_steps)
        return {"stop": self._stop.is_set() or finished, "finished": finished, "why": self.stopped_by,
                "step": True, "schedule": self.schedule.state(), "controls": self._applied,
                "precision": self.precision, "at_step": self._step}

    def _own_risk(self) -> dict[str, Any] | None:
        """What this rank says of its own risk before the next step. A rank has no scorer of its own (rank
        0 scores every GPU of its host, peers' too); here only the test's injection (`GPUWATCH_SIM_RISK`)."""
        s = self._sim_risk
        if s and s[0] == self.rank and s[1] == self._step:
            return {"risk": s[2], "reasons": [["simulated", s[2]]], "features": {}}
        return None

    def _worst_rank(self) -> dict[str, Any] | None:
        """Rank 0: the riskiest other rank before the next step, as the guard takes it (`worst`): its risk
        (rank 0's scorer's figure for that rank's GPU when it is on this host, else what the rank said), its
        GPU and its memory figures of its last step. The guard compares it with rank 0's own risk and
        decides on the larger, once for all ranks."""
        latest = getattr(self.guard, "latest_risk", None)
        best = None
        for r in sorted(set(self.peer_risk) | set(self.peer_gpu)):
            gpu = self.peer_gpu.get(r)
            got = latest(gpu) if latest is not None and gpu is not None else None
            said = self.peer_risk.get(r)
            if said is not None and (got is None or (said.get("risk") or 0.0) > (got.get("risk") or 0.0)):
                got = said
            if not got or got.get("risk") is None:
                continue
            if best is None or got["risk"] > best["risk"]:
                row = self.peers.get(r) or {}
                best = {**got, "rank": r, "gpu": gpu,
                        "view": {"last_peak_bytes": row.get("torch_peak_bytes"),
                                 "last_allocated_bytes": row.get("torch_allocated_bytes"),
                                 "last_reserved_bytes": row.get("torch_reserved_bytes")}}
        return best

    def _outbox(self) -> dict[str, Any]:
        steps, self._out["steps"], _ = self.bus.steps.since(self._out["steps"])
        events, self._out["events"], _ = self.bus.events.since(self._out["events"])
        return {"rank": self.rank, "steps": steps, "events": events, "risk": self._own_risk(),
                "ident": {"uuid": self.cfg.gpu_uuid, "pci_bus_id": self.cfg.gpu_pci_bus_id},
                "counts": self.own_counts()}

    def own_counts(self) -> dict[str, Any]:
        """This rank's counters, as the summary counts them (sent to rank 0 before every step and at the end)."""
        return {"rank": self.rank, "state": self.state, "steps": self._step, "ooms": self.ooms,
                "recovered": self.recovered, "lost_steps": self.lost_steps, "nonfinite": self.nonfinite,
                "integrity_failures": self.integrity_failures, "unrecovered": self.unrecovered}

    def rank_counts(self) -> list[dict[str, Any]]:
        """Rank 0: every rank's counters, rank 0's own first (another rank's are the last it sent: at the
        end of the job, or before its last step where it failed)."""
        return [self.own_counts(), *(self.peer_counts[k] for k in sorted(self.peer_counts))]

    def _exchange(self, decision: dict[str, Any] | None) -> dict[str, Any]:
        mine = self._outbox() if not self.ctx.leader else {"rank": 0, "decision": decision}
        got: list[Any] = [None] * self.ctx.world
        dist.all_gather_object(got, mine, group=self.ctx.ctrl)
        if self.ctx.leader:
            self._ingest(got[1:])
        return got[0]["decision"]

    def _ingest(self, parts: list[dict[str, Any]]) -> None:
        """Rank 0: the other ranks' step rows and events go into this session's bus (and recording)."""
        for part in parts:
            k = part["rank"]
            self.peer_risk[k] = part.get("risk")
            if part.get("counts"):
                self.peer_counts[k] = part["counts"]
            if k not in self.peer_gpu:
                ident = part.get("ident") or {}
                self.peer_gpu[k] = self.nvml_index(ident) if self.nvml_index and any(ident.values()) else None
            for ev in part["events"]:
                ev.detail.setdefault("rank", part["rank"])
                if not ev.message.startswith("rank "):
                    ev.message = f"rank {part['rank']}: {ev.message}"
                self.bus.events.append(ev)
            for row in part["steps"]:
                self.peers[part["rank"]] = row
                self.bus.steps.append(row)

    def _adopt(self, d: dict[str, Any]) -> None:
        """Another rank: apply rank 0's decision exactly (same schedule state, same controls)."""
        self.schedule.restore(d["schedule"])
        for key, value, who, why in d["controls"]:
            if key == "precision" and value != self.precision:
                M.apply_precision(self.model, value)
                self.precision = value
                if self.cfg.mode == "train":
                    self.scaler = M.LossScaler() if value == "fp16" else None
                    self._rewrap = self.ddp is not None
            elif key == "release_cache":
                value = ", ".join(release_cache(self.device, expandable=value)) or "nothing to release here"
            self.bus.emit("control", f"{key} -> {value} (rank 0's {who}, applied on rank {self.rank} at step "
                          f"{d['at_step']})", gpu=self.cfg.gpu_index, control=key, value=value, who=who, why=why,
                          rank=self.rank, at_step=d["at_step"])

    # -- the loop ------------------------------------------------------------------------------------
    def run(self) -> None:
        finished = False
        try:
            self.build()
            if self.collectives_max:
                self._collectives()
            while True:
                d = self._exchange(self._decide() if self.ctx.leader else None)
                if d["stop"]:
                    finished = bool(d.get("finished"))
                    self.stopped_by = self.stopped_by or d.get("why")
                    break
                if not d["step"]:
                    self.state = "paused"
                    continue
                if not self.ctx.leader:
                    self._adopt(d)
                if self._rewrap:
                    self._wrap()
                self.state = "running"
                self._dist_step(*self.schedule.wanted())
        except Exception as e:  # noqa: BLE001 - visible, never a crash of the app
            self.state = "failed"
            text = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            if not isinstance(e, RankFailed):
                self.ctx.fatal(text)
            first = self.ctx.fatal_reason()
            self.unrecovered = text if first is None or first.startswith(f"rank {self.rank}:") else \
                f"{first} (here: {text})"
            self.bus.emit("workload_error", f"workload stopped: {self.unrecovered}", "error", gpu=self.cfg.gpu_index,
                          rank=self.rank, first_failure=first)
        finally:
            if self.state != "failed":
                self.state = "finished" if finished else "stopped"
            by = f" by the guard: {self.stopped_by}" if self.stopped_by else ""
            self.bus.emit("workload_stop", f"rank {self.rank}: workload {self.state} after {self._step} steps{by}",
                          gpu=self.cfg.gpu_index, stopped_by=self.stopped_by, rank=self.rank)
            if self.state != "failed":
                self._flush_last()

    def _flush_last(self) -> None:
        """The last rows and events of the other ranks reach rank 0 (one more gather, after the stop)."""
        try:
            got: list[Any] = [None] * self.ctx.world
            dist.all_gather_object(got, self._outbox() if not self.ctx.leader else {"rank": 0},
                                   group=self.ctx.ctrl)
            if self.ctx.leader:
                self._ingest(got[1:])
        except Exception:  # noqa: BLE001 - a rank that failed cannot send it
            pass

    def _collectives(self) -> None:
        from gpuwatch.workload.collectives import record_check

        was, self.state = self.state, "collectives"
        try:
            record_check(self.ctx, self.bus, self.collectives_max, self.collectives_peak, self.cfg.gpu_index)
        finally:
            self.state = was

    # -- one step --------------------------------------------------------------------------------------
    def _dist_step(self, wanted: int, seq: int, phase: str) -> None:
        seq = self._step_seq(seq)
        batch, micro, k = self._split(wanted)
        before = X.memory(self.device)["torch_allocated_bytes"]
        row, failure = self._attempt(self._rank_step, batch, seq, phase, micro, k)
        if failure is not None and self.ddp is not None:
            # DDP's reducer part-way through backward, or FSDP's per-layer all-gathers part-way through forward
            # or backward: this rank's collectives no longer line up with the others'; it cannot rejoin
            if self._stage == "backward" or (self.dp == "fsdp" and self._stage == "forward"):
                self.ctx.fatal(f"OOM in {self._stage} at step {self._step} (batch {micro} x {seq}): {failure}")
                raise RankFailed(f"OOM in {self._stage} at step {self._step}: cannot rejoin the gradients' collectives")
            self._shadow_pass()
        flags = torch.tensor([failure is not None, row is not None and row.pop("_nonfinite")], dtype=torch.float32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.ctx.ctrl)
        if flags[0] > 0:
            self._skip_together(failure, batch, seq, before, micro)
            return
        if self.ddp is not None:
            self._update(skip=bool(flags[1] > 0))
        M.synchronize(self.device)
        self._finish_row(row, micro)

    def _rank_step(self, batch: int, seq: int, phase: str, micro: int, k: int) -> dict[str, Any]:
        dev = self.device
        self._stage = "idle"  # an OOM before the model runs: every rank's collectives still line up
        if self._sim and self._sim[0] == self.rank and self._sim[1] == self._step and self._sim[2] == "forward":
            self._sim = None
            raise torch.OutOfMemoryError(f"CUDA out of memory (simulated on rank {self.rank} at step {self._step})")
        if self.ddp is None:  # prefill/decode: the base step, every rank in step with the others
            row = self.timed_step(batch, seq, phase, micro, k)
            row["_t0"] = time.perf_counter() - row["step_time_s"]
            row["_nonfinite"] = False
            return row
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        ids = M.random_ids(self.fields["vocab_size"], batch, seq, dev, self._gen)
        M.synchronize(dev)
        t0 = time.perf_counter()
        self.meter.reset()
        lim = self.cfg.faults.oom_above_tokens
        if lim and micro * seq > lim:
            raise torch.OutOfMemoryError(f"CUDA out of memory (simulated: {micro * seq} tokens > {lim})")
        loss, max_logit = self._forward_backward(ids.split(micro) if k > 1 else [ids])
        del ids
        return {"_t0": t0, "_nonfinite": not (_finite(loss) and _finite(max_logit)), "ts": None, "step": self._step,
                "gpu": self.cfg.gpu_index, "mode": "train", "phase": phase, "precision": self.precision,
                "batch": batch, "seq_len": seq, "loss": loss, "max_abs_logit": max_logit, "micro_batches": k}

    def _forward_backward(self, chunks) -> tuple[float, float]:
        """Forward and backward of every micro-batch through DDP (the all-reduce runs in the last
        backward, `no_sync` before it). The update waits for the ranks' agreement."""
        ddp, k = self.ddp, len(chunks)
        ddp.train()
        losses, max_logit = [], 0.0
        try:
            for i, ids in enumerate(chunks):
                self._stage = "forward"
                with self._no_sync(i == k - 1):
                    out = ddp(input_ids=ids, labels=ids, use_cache=False)
                    loss = out.loss
                    max_logit = max(max_logit, out.logits.detach().float().abs().max().item())
                    del out
                    losses.append(loss.item())
                    self._stage = "backward"
                    if self._sim and self._sim[:2] == (self.rank, self._step) and self._sim[2] == "backward":
                        self._sim = None
                        raise torch.OutOfMemoryError(f"CUDA out of memory (simulated in backward on rank {self.rank})")
                    ((loss / k) * (self.scaler.scale if self.scaler else 1.0)).backward()
                    del loss
            self._stage = "done"
            return sum(losses) / k, max_logit
        finally:
            ddp.eval()

    def _no_sync(self, last: bool):
        """Every micro-batch but the last accumulates without the gradients' collective."""
        if self.dp == "fsdp":
            return _fsdp().no_sync(self.ddp, self.engine, sync=last)
        return contextlib.nullcontext() if last else self.ddp.no_sync()

    def _shadow_pass(self) -> None:
        """This rank failed in forward: join the gradient all-reduce with zero gradients (a one-token
        forward times 0), so the other ranks' backward is not left waiting for it."""
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        ids = torch.zeros((1, 2), dtype=torch.long, device=self.device)
        self.ddp.train()
        try:
            out = self.ddp(input_ids=ids, labels=ids, use_cache=False)
            (out.loss * 0.0).backward()
        finally:
            self.ddp.eval()

    def _update(self, skip: bool) -> None:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if not skip and (self.scaler is None or self.scaler.unscale_and_check(params)):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _skip_together(self, failure: str | None, batch: int, seq: int, before, micro: int) -> None:
        """Some rank ran out of memory: no rank updates, every rank backs off the same way (rank 0's
        schedule state reaches the others before the next step anyway)."""
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        if failure is not None:
            self._recover_oom(failure, batch, seq, before, micro)
            return
        decision = self.schedule.oom(micro)
        self.lost_steps += 1
        self.bus.emit("oom_recovered", f"another rank ran out of memory at step {self._step}: the step is skipped "
                      f"on every rank; {decision}", "warning", gpu=self.cfg.gpu_index, decision=decision,
                      who="recovery", rank=self.rank, peer_oom=True,
                      **next_step_columns(self.next_plan()))

    def _finish_row(self, row: dict[str, Any], micro: int) -> None:
        dt = time.perf_counter() - row.pop("_t0")
        comm_s, comm_bytes = self.meter.result() if self.ddp is not None and self.dp == "ddp" else (None, None)
        mode, batch, seq = row["mode"], row["batch"], row["seq_len"]
        if self.ddp is not None:
            tokens = batch * seq
            tflops = F.step_flops(self.fields, mode, batch, seq, self.cfg.decode_tokens) / dt / 1e12
            peak = F.peak_tflops(self.device_name, self.precision)
            row.update(step_time_s=dt, tokens_per_s=tokens / dt, tflops=tflops, mfu=tflops / peak if peak else None,
                       **X.step_memory(self.device), expert_impl=self._impl_label())
        row.update(ts=time.time_ns() // 1000, rank=self.rank, world_size=self.ctx.world, comm_time_s=comm_s,
                   comm_bytes=comm_bytes)
        self.schedule.done()
        self._step += 1
        self._floor_ooms = self._ooms_in_row = 0
        self.last_ok_batch = micro
        self._plan_columns(row)
        self.last = row
        self.bus.steps.append(row)
        if not (_finite(row["loss"]) and _finite(row["max_abs_logit"])):
            self.nonfinite += 1
            self.bus.emit("nonfinite", f"non-finite output at step {self._step} ({self.precision}): update skipped "
                          "on every rank", "warning", gpu=self.cfg.gpu_index, loss=row["loss"], rank=self.rank)
        if self.cfg.integrity_every and self._step % self.cfg.integrity_every == 0:
            self._integrity()


def every_param_takes_part(model) -> bool:
    """Whether every parameter gets a gradient in every train step, whatever the router chose. transformers 5
    keeps a MoE layer's experts as one Parameter for all experts' gate/up and one for their down projections
    (`gate_up_proj` (E, 2I, D), `down_proj`): an expert no token was routed to still takes part in autograd,
    its slice of the gradient zero. A layout with one module per expert (an nn.ModuleList of experts: older
    transformers, other models) leaves an unrouted expert's parameters out of the step: DDP must then look
    for unused parameters. The rest of the DeepSeek model (attention, norms, router, shared experts, dense
    MLPs, embeddings, head) runs for every token."""
    return not any(isinstance(getattr(m, "experts", None), torch.nn.ModuleList) for m in model.modules())


def _fsdp():
    from gpuwatch.workload import fsdp

    return fsdp


def _finite(x) -> bool:
    return x is None or x == x and abs(x) != float("inf")


def make_rank_workloads(ctx: DistContext, collectives_max: int | None = None, peak_gbps: float | None = None,
                        dp: str | None = None):
    """The `workload_factory` of rank 0's Session (and of the other ranks' bare loop): this rank's one
    workload on its own device."""
    from dataclasses import replace

    from gpuwatch.workload.factory import make_workloads

    def factory(spec, bus, nvml_index=None):
        if spec.gpus:
            raise UsageError("--gpus runs independent workloads; under torchrun each rank takes cuda:LOCAL_RANK")
        one = replace(spec, device=str(ctx.device))
        (w,) = make_workloads(one, bus, nvml_index)
        dw = DistributedWorkload(bus, w.cfg, ctx, dp or "ddp")
        dw.collectives_max, dw.collectives_peak = collectives_max, peak_gbps
        dw.nvml_index = nvml_index
        return [dw]

    return factory


def run_rank(ctx: DistContext, spec, collectives_max: int | None = None, peak_gbps: float | None = None,
             dp: str | None = None) -> int:
    """A rank other than 0: the workload alone, in this thread, until rank 0 says stop. Its steps and
    events reach rank 0's session. SIGINT/SIGTERM are left to rank 0 (torchrun signals every rank; rank 0
    stops the job at the next step, so no rank leaves the others waiting in a collective)."""
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    bus = Bus()
    (w,) = make_rank_workloads(ctx, collectives_max, peak_gbps, dp)(spec, bus)
    try:
        w.run()
    finally:
        if w.state != "failed":
            shutdown(ctx)
    if w.state == "failed":
        print(f"gpuwatch: rank {ctx.rank}: {w.unrecovered}", flush=True)
        return 1
    return 0
