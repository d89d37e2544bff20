"""The workload thread: builds the model, runs steps by schedule, applies controls between steps,
publishes step metrics and events on the bus, and survives its own failures (OOM, non-finite loss).

Controls (`set_batch_size`, `set_ceiling`, `hold`, `set_seq_len`, `set_precision`, `pause`, `resume`,
`stop`) are thread-safe and take effect before the next step; each says who acted (user, guard,
schedule, recovery) and why, and becomes a `control` event. This is the interface the guard
(gpuwatch.control) drives. A batch ceiling below what the schedule wants makes a train step run as
micro-batches with gradient accumulation, so the effective batch (and the loss curve) is unchanged.
"""

from __future__ import annotations

import gc
import math
import threading
import time
from typing import Any, Callable

import torch

from gpuwatch.predict import ahead as A
from gpuwatch.contract import PRECISIONS, StepPlan, next_step_columns
from gpuwatch.telemetry.bus import Bus
from gpuwatch.threads import start_thread
from gpuwatch.workload import flops as F
from gpuwatch.workload import mechanics as X
from gpuwatch.workload.allocator import release_cache
from gpuwatch.workload.guarded import GuardedSide
from gpuwatch.workload.integrity import integrity
from gpuwatch.workload.config import Faults, WorkloadConfig  # noqa: F401 - imported from here by callers
from gpuwatch.workload import model as M
from gpuwatch.workload import tuning as T
from gpuwatch.workload.presets import config_fields, defaults
from gpuwatch.workload.schedule import Schedule


OOM_LOOP = 50  # OOMs in a row with no step between them: the run stops (call 29 looped 995 times)


def _fields_of(model, preset_fields: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The config fields (those a preset sets) of a caller's model, checked to be a DeepSeek-V3 on `device`."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) != "deepseek_v3":
        raise ValueError(f"model= takes a DeepseekV3ForCausalLM; got {type(model).__name__} "
                         f"(config model_type {getattr(config, 'model_type', None)!r})")
    on = next(model.parameters()).device
    if on.type != device.type or (on.index or 0) != (device.index or 0):
        raise ValueError(f"model= is on {on}; this workload runs on {device} (move it there first)")
    # a field the config keeps under another name (rope_theta, in rope_parameters) keeps the preset's value:
    # only a build reads it
    return {k: getattr(config, k, v) for k, v in preset_fields.items()}


class Workload(GuardedSide):
    """gpuwatch's DeepSeek workload; implements `gpuwatch.contract.GuardedWorkload` (the
    guard's side) and `WorkloadControls` (the dashboard's keys)."""

    honours_deadline = True  # it stops at `ends_at` (Session.ends_in); the data-parallel workload does not (yet)
    cancellable_build = True  # a stop or the deadline during the model's build ends the build there

    guard = None  # set by the session: called before every step (gpuwatch.control.guard.Guard)

    def __init__(self, bus: Bus, cfg: WorkloadConfig, model=None) -> None:
        """`model`: an already-built transformers `DeepseekV3ForCausalLM` (your own weights or config, or one
        model driven through several runs in turn) to run instead of building `cfg.preset` with
        `cfg.overrides`. It must already be on `cfg.device`; the workload casts it to `cfg.precision` and
        describes it by its own config (the figures the preset's config would give otherwise: parameters,
        FLOPs, vocabulary). ValueError for a model of another family or on another device."""
        self.bus, self.cfg = bus, cfg
        self.fields = config_fields(cfg.preset, cfg.overrides)
        if model is not None:
            self.fields = _fields_of(model, self.fields, torch.device(cfg.device))
        b, s = defaults(cfg.preset)
        self.schedule = Schedule(cfg.schedule, cfg.batch or b, cfg.seq_len or s, cfg.max_batch,
                                 long_seq=cfg.long_seq, accumulates=cfg.mode == "train" and cfg.accumulate)
        self.precision = cfg.precision
        self.device = torch.device(cfg.device)
        self.state = "idle"  # idle | building | running | paused | stopped | failed | finished
        self.last: dict[str, Any] = {}
        self.ooms = self.recovered = self.nonfinite = self.integrity_failures = 0
        self.unrecovered: str | None = None
        self.params = F.param_count(self.fields)
        self.expert_impl: str | None = None
        self.tuned = T.Applied({})  # the speed switches on the model (set by build)
        self._pending: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._resume = threading.Event()
        self._resume.set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._leak: list[torch.Tensor] = []
        self._step = 0
        self._baseline_blocks = None
        self._gen = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self._prebuilt = model
        self.decoder = None
        self.manual = False  # a user's batch/precision change overrides the guard until handed back
        self.last_ok_batch: int | None = None  # the micro-batch of the last step that ran
        self.retries = 0  # OOMs retried in place (reactive rules); the step was not lost
        self.lost_steps = 0  # OOMs the schedule recovered by moving on: those steps were lost
        self.snapshot_request: tuple[str, Any] | None = None
        self.stopped_by: str | None = None  # why the guard stopped this run cleanly (a leak), if it did
        self._floor_ooms = 0  # OOMs in a row at batch 1 (no step ran between them)
        self._ooms_in_row = 0  # OOMs since the last step that ran (OOM_LOOP of them: stop)
        self._ends: list[float] = []  # when the last steps ended (s): the lookahead's pace
        self._ahead: dict[str, Any] = {}  # the step columns ahead_* of the last step (predict/ahead.py)
        self.ends_at: float | None = None  # when the run ends (epoch s; --duration): the lookahead ends there
        self.remedies: list[str] = []  # allocator remedies applied (cache released, expandable segments)
        self.checkpointing = False  # activation checkpointing (train: the model's own switch; the planner's remedy)
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None
        self.device_name = name or "CPU"

    # -- controls (any thread) -----------------------------------------------------------------------
    def _put(self, key: str, value: Any, who: str, why: str) -> None:
        if who not in WHO:
            raise ValueError(f"who must be one of {WHO}")
        with self._lock:
            self._pending[key] = (value, who, why)
        if who == "user" and key in ("batch", "precision", "ceiling") and not self.manual and self.guard is not None:
            self.manual = True
            self.bus.emit("guard_override", f"manual {key} change: the guard leaves this workload alone until handed back",
                          gpu=self.cfg.gpu_index, who=who)

    def set_batch_size(self, n: int, who: str = "user", why: str = "") -> None:
        self._put("batch", max(1, int(n)), who, why)

    def set_ceiling(self, n: int | None, who: str = "user", why: str = "") -> None:
        self._put("ceiling", None if n is None else max(1, int(n)), who, why)

    def hold(self, who: str = "guard", why: str = "", batch: int | None = None) -> None:
        """Refuse the schedule's next step up: stay at `batch` (default: the last batch that ran)."""
        self._put("hold", batch or 0, who, why)

    def set_seq_len(self, n: int, who: str = "user", why: str = "") -> None:
        self._put("seq_len", max(1, int(n)), who, why)

    def set_precision(self, p: str, who: str = "user", why: str = "") -> None:
        if p not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}")
        self._put("precision", p, who, why)

    def hand_back(self) -> None:
        """The user hands control back to the guard."""
        if self.manual and self.guard is not None:
            self.manual = False
            self.bus.emit("guard_override", "control handed back to the guard", gpu=self.cfg.gpu_index, who="user")

    @property
    def paused(self) -> bool:
        return not self._resume.is_set()

    @property
    def bf16_supported(self) -> bool:
        """Whether this device runs bf16 (the guard falls back to fp16 where it does not)."""
        return self.device.type != "cuda" or bool(torch.cuda.is_bf16_supported())

    @property
    def ceiling(self) -> int | None:
        return self.schedule.ceiling

    def next_plan(self) -> StepPlan | None:
        """The next step as the guard and the risk model see it (gpuwatch.contract.GuardedWorkload): the
        micro-batch (what memory sees), its sequence length and precision, the effective batch and the
        lookahead. Read from any thread."""
        p = self.schedule.wanted()
        if p is None or self.past_end():
            return None
        with self._lock:
            pend = dict(self._pending)
        ceiling = pend["ceiling"][0] if "ceiling" in pend else self.schedule.ceiling
        wanted = pend["batch"][0] if "batch" in pend else p[0]
        micro = min(wanted, ceiling) if ceiling else wanted
        prec = pend["precision"][0] if "precision" in pend else self.precision
        seq = pend["seq_len"][0] if "seq_len" in pend else p[1]
        eff = wanted if self.cfg.mode == "train" and self.cfg.accumulate else micro
        k = math.ceil(eff / micro) if eff > micro else 1
        return StepPlan(batch=micro, seq_len=seq, precision=prec, mode=self.cfg.mode, micro_batches=k,
                        effective_batch=eff, wanted_batch=p[0], checkpointing=self.checkpointing,
                        **A.capped(self._ahead, ceiling))  # the lookahead of the last step, under today's ceiling

    def past_end(self) -> bool:
        """Past the run's deadline (`ends_at`): no step starts, nothing is planned."""
        return self.ends_at is not None and time.time() >= self.ends_at

    # -- the guard's contract (gpuwatch.contract.GuardedWorkload) -----------------------------------
    @property
    def gpu_index(self) -> int | None:
        return self.cfg.gpu_index

    @property
    def memory_limit_bytes(self) -> int | None:
        return self.cfg.faults.memory_limit_bytes

    def pause(self, who: str = "user") -> None:
        if self._resume.is_set():
            self.bus.emit("control", f"workload paused ({who})", gpu=self.cfg.gpu_index, control="pause", who=who)
        self._resume.clear()

    def resume(self, who: str = "user") -> None:
        if not self._resume.is_set():
            self.bus.emit("control", f"workload resumed ({who})", gpu=self.cfg.gpu_index, control="resume", who=who)
        self._resume.set()

    def stop(self, join: bool = True) -> None:
        self._stop.set()
        self._resume.set()
        if join and self._thread and self._thread is not threading.current_thread():
            self._thread.join(timeout=60)

    @property
    def batch(self) -> int:
        """The batch the next step will use (its micro-batch when a ceiling splits it)."""
        return self.schedule.plan()[0] if not self.schedule.finished else self.schedule.batch

    @property
    def seq_len(self) -> int:
        return self.schedule.seq_len

    def describe(self) -> dict[str, Any]:
        c = self.cfg
        return {"preset": c.preset, "mode": c.mode, "schedule": c.schedule, "precision": self.precision,
                "batch": self.schedule.batch, "seq_len": self.schedule.seq_len, "device": str(self.device),
                "params": self.params, "overrides": c.overrides, "faults": vars(c.faults),
                "integrity_every": c.integrity_every, "seed": c.seed, "tuning": dict(c.tuning), "gpu_index": c.gpu_index,
                "gpu_uuid": c.gpu_uuid, "gpu_pci_bus_id": c.gpu_pci_bus_id}

    # -- resume (before start) --------------------------------------------------------------------------
    def export_state(self) -> dict[str, Any]:
        """What a resumed run continues from: the step counter, precision, counters and the schedule."""
        return {"step": self._step, "precision": self.precision, "ooms": self.ooms, "recovered": self.recovered,
                "nonfinite": self.nonfinite, "integrity_failures": self.integrity_failures,
                "retries": self.retries, "lost_steps": self.lost_steps, "last_ok_batch": self.last_ok_batch,
                "schedule": self.schedule.state()}

    def restore_state(self, state: dict[str, Any], history=None) -> None:
        """Continue an interrupted run: `state` as `export_state()` gives it (its "schedule" may be left
        out when `history` is given: the schedule is then rebuilt by `Schedule.replay(history)`).
        Step numbers go on from `state["step"]`; the model is built again (fresh random weights)."""
        if self._thread is not None:
            raise RuntimeError("restore a workload before start()")
        if state.get("schedule"):
            self.schedule.restore(state["schedule"])
        elif history is not None:
            self.schedule.replay(history)
        self._step = int(state.get("step") or 0)
        if state.get("precision") in PRECISIONS:
            self.precision = state["precision"]
        for k in ("ooms", "recovered", "nonfinite", "integrity_failures", "retries", "lost_steps"):
            setattr(self, k, int(state.get(k) or 0))
        self.last_ok_batch = state.get("last_ok_batch")
        self._gen.manual_seed(self.cfg.seed * 1_000_003 + self._step)  # new inputs, not the first run's again

    # -- thread ----------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = start_thread(self.run, "gpuwatch-workload")

    def join(self, timeout: float | None = None) -> None:
        if self._thread:
            self._thread.join(timeout)

    def run(self) -> None:
        try:
            try:
                self.build()
            except M.BuildCancelled:
                self.bus.emit("control", "build abandoned: the run was stopped or its deadline passed while the "
                              "model was being built", gpu=self.cfg.gpu_index, control="stop", who="schedule")
            if self._stop.is_set() or self.past_end():  # stopped, or --duration ran out, while building:
                self._stop.wait()  # no step starts (the session stops it now, as after a last step)
                return
            while not self._stop.is_set():
                if not self._resume.is_set():
                    self.state = "paused"
                    self._resume.wait()
                    continue
                if self.guard is not None and not self.manual:
                    self.guard.before_step(self)
                    if self._stop.is_set():  # the guard stopped the run (a leak): no further step
                        break
                self._apply_controls()
                self._maybe_snapshot()
                if self.past_end():
                    self._stop.wait()  # no step more (the session stops it now)
                    break
                plan = self.schedule.wanted()
                if plan is None or (self.cfg.max_steps and self._step >= self.cfg.max_steps):
                    self.state = "finished"
                    break
                self.state = "running"
                self.run_step(*plan)
        except Exception as e:  # a failure we could not recover: visible, never a crash of the app
            self.state = "failed"
            self.unrecovered = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            self.bus.emit("workload_error", f"workload stopped: {self.unrecovered}", "error", gpu=self.cfg.gpu_index)
        finally:
            if self.state not in ("failed", "finished"):
                self.state = "stopped"
            by = f" by the guard: {self.stopped_by}" if self.stopped_by else ""
            self.bus.emit("workload_stop", f"workload {self.state} after {self._step} steps{by}", gpu=self.cfg.gpu_index,
                          stopped_by=self.stopped_by)

    def build(self) -> None:
        """Build the model and what its steps need (optimizer, scaler, decode engine): `run` does it first."""
        self.state = "building"
        lim = self.cfg.faults.memory_limit_bytes
        if lim and self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, lim / total), self.device)
        if self._prebuilt is not None:  # the caller's model (`model=`): nothing to build
            self.model, secs = self._prebuilt, 0.0
            M.apply_precision(self.model, self.precision)
        else:
            self.model, secs = M.build_model(self.fields, self.device, self.precision, self.cfg.seed,
                                             cancelled=self._build_cancelled if self.cancellable_build else None)
        self.tuned = T.apply(self.model, self.cfg.tuning)  # the speed switches (none by default)
        self.expert_impl = getattr(self.model.config, "_experts_implementation", None) or "eager"
        if self.cfg.faults.fp16_overflow:
            self.model.get_input_embeddings().register_forward_hook(lambda m, i, o: o * 1e7)
        self.optimizer = T.make_optimizer(self.model, self.cfg.tuning) if self.cfg.mode == "train" else None
        self.scaler = M.LossScaler() if self.cfg.mode == "train" and self.precision == "fp16" else None
        self.decoder = None
        g, mode = self.cfg.graphs, self.cfg.mode
        if g != "off" and (mode == "decode" or (mode == "prefill" and g == "on")):
            self.decoder = M.DecodeEngine(
                self.model, self.schedule.batch, self.schedule.seq_len,
                self.cfg.decode_tokens if mode == "decode" else 0, self.device,
                lambda kind, msg, **d: self.bus.emit(kind, msg, gpu=self.cfg.gpu_index, **d))
        self.bus.emit("workload_start", f"{self.cfg.preset} ({self.params / 1e9:.3g} B params) built on "
                      f"{self.device_name} in {secs:.2f} s", gpu=self.cfg.gpu_index,
                      build_s=secs, **self.describe(), **X.memory(self.device))

    def _build_cancelled(self) -> bool:
        return self._stop.is_set() or self.past_end()

    def _apply_controls(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for key, (value, who, why) in pending.items():
            if key == "batch":
                self.schedule.set_batch(value)
            elif key == "ceiling":
                self.schedule.set_ceiling(value)
            elif key == "hold":
                self.schedule.hold(value or None)
                value = self.schedule.ceiling
            elif key == "seq_len":
                self.schedule.set_seq_len(value)
            elif key == "release_cache":
                value = ", ".join(release_cache(self.device, expandable=value)) or "nothing to release here"
                self.remedies.append(value)
            elif key == "checkpointing":
                if value == self.checkpointing or getattr(self, "model", None) is None:
                    continue
                X.set_checkpointing(self.model, value)
                self.checkpointing = value
            elif key == "precision":
                if value == self.precision:
                    continue
                M.apply_precision(self.model, value)
                self.precision = value
                if self.cfg.mode == "train":
                    self.scaler = M.LossScaler() if value == "fp16" else None
            shown = "none (lifted)" if value is None else value
            self.bus.emit("control", f"{key} -> {shown} ({who}{': ' + why if why else ''})", gpu=self.cfg.gpu_index,
                          control=key, value=value, who=who, why=why)

    def request_snapshot(self, directory, reason: str) -> None:
        """Save a CUDA allocator snapshot before the next step (the guard asks at alarm time)."""
        self.snapshot_request = (reason, directory)

    def _maybe_snapshot(self) -> None:
        req, self.snapshot_request = self.snapshot_request, None
        if req is not None and self.device.type == "cuda":
            from gpuwatch.workload.memsnap import snapshot_event

            snapshot_event(self.bus, self.device, req, self._baseline_blocks, self.cfg.gpu_index,
                           "allocator snapshot at alarm")

    # -- one step ----------------------------------------------------------------------------------------
    def _split(self, wanted: int) -> tuple[int, int, int]:
        """(effective batch, micro-batch, micro-batches) for a step the schedule wants at `wanted`."""
        ceiling = self.schedule.ceiling
        micro = min(wanted, ceiling) if ceiling else wanted
        if self.cfg.mode == "train" and self.cfg.accumulate and micro < wanted:
            k = math.ceil(wanted / micro)
            return wanted, math.ceil(wanted / k), k
        return micro, micro, 1

    def _step_seq(self, seq: int) -> int:
        """The step's sequence length: under --fragment, random in [seq/4, seq] (odd shapes, allocator holes)."""
        if self.cfg.faults.fragment:
            seq = int(torch.randint(max(1, seq // 4), seq + 1, (1,), generator=self._gen, device=self.device).item())
        return seq

    @staticmethod
    def _attempt(run: Callable[..., Any], *args: Any) -> tuple[Any, str | None]:
        """(run(*args), None), or (None, the OOM's first line) where it ran out of memory; any other error
        propagates. The caller recovers outside the handler (its traceback pins the step's tensors)."""
        try:
            return run(*args), None
        except Exception as e:  # noqa: BLE001 - classified here: only an OOM is caught
            if not M.is_oom(e):
                raise
            return None, X.first_line(e)

    def run_step(self, wanted: int, seq: int, phase: str) -> None:
        """Run one step as the run loop does (OOM recovery, counters, the row appended to the bus)."""
        seq = self._step_seq(seq)
        for _try in range(20):  # reactive rules retry the same step; the schedule's recovery moves on
            batch, micro, k = self._split(wanted)
            before = X.memory(self.device)["torch_allocated_bytes"]
            row, failure = self._attempt(self.timed_step, batch, seq, phase, micro, k)
            if failure is None:
                break
            # recover OUTSIDE the except block: its traceback pins the step's tensors
            if not self._recover_oom(failure, batch, seq, before, micro):
                return
        else:
            return
        self.schedule.done()
        self._step += 1
        self._floor_ooms = self._ooms_in_row = 0
        self.last_ok_batch = micro
        if self._baseline_blocks is None and self.device.type == "cuda" and self.guard is not None:
            from gpuwatch.workload.memsnap import baseline

            self._baseline_blocks = baseline(self.device)
        self._plan_columns(row)
        self.last = row
        self.bus.steps.append(row)
        if row["loss"] is not None and not _finite(row["loss"]) or not _finite(row["max_abs_logit"]):
            self.nonfinite += 1
            self.bus.emit("nonfinite", f"non-finite output at step {self._step} ({self.precision})", "warning",
                          gpu=self.cfg.gpu_index, loss=row["loss"], max_abs_logit=row["max_abs_logit"])
        if self.cfg.integrity_every and self._step % self.cfg.integrity_every == 0:
            self._integrity()

    def _plan_columns(self, row: dict[str, Any]) -> None:
        """The plan of the next step and the largest step planned within the lookahead (predict/ahead.py)
        on a finished step's row; the lookahead is kept for `next_plan` until the next step."""
        self._ends = (self._ends + [row["ts"] / 1e6])[-(A.PACE_STEPS + 1):]
        left_s = self.ends_at - self._ends[-1] if self.ends_at is not None else None
        left_steps = self.cfg.max_steps - self._step if self.cfg.max_steps else None
        self._ahead = A.columns(self.schedule, self._ends, left_s, left_steps)
        last = (left_s is not None and left_s <= 0) or left_steps == 0  # the run's last step: nothing planned
        row.update(**next_step_columns(self.next_plan() if not last else None), **self._ahead)

    def timed_step(self, batch: int, seq: int, phase: str, micro: int | None = None, k: int = 1) -> dict[str, Any]:
        """One timed step at this batch and sequence length: its row, not recorded (an OOM propagates)."""
        dev = self.device
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        ids = M.random_ids(self.fields["vocab_size"], batch, seq, dev, self._gen)
        if self.decoder is not None:  # capture (if any) happens here, outside the timed step
            if self.decoder.needs_build(batch, seq):
                was, self.state = self.state, "compiling"  # the TUI shows it; the compile event records it
                try:
                    self.decoder.prepare(batch, seq)
                finally:
                    self.state = was
        M.synchronize(dev)
        t0 = time.perf_counter()
        mode = self.cfg.mode
        lim = self.cfg.faults.oom_above_tokens
        if lim and (micro or batch) * seq > lim:
            raise torch.OutOfMemoryError(f"CUDA out of memory (simulated: {(micro or batch) * seq} tokens > {lim})")
        if mode == "train" and k > 1:
            loss, max_logit = M.step_train_accumulated(self.model, ids.split(micro or batch), self.optimizer, self.scaler,
                                                       self.tuned.lean)
        elif mode == "train":
            loss, max_logit = M.step_train(self.model, ids, self.optimizer, self.scaler, self.tuned.lean)
        elif self.decoder is not None:
            loss, max_logit = self.decoder.step(ids)
        elif mode == "decode":
            loss, max_logit = M.step_decode(self.model, ids, self.cfg.decode_tokens)
        else:
            loss, max_logit = M.step_prefill(self.model, ids)
        M.synchronize(dev)
        dt = time.perf_counter() - t0
        del ids
        if self.cfg.faults.leak_mib and dev.type == "cuda":
            self._leak.append(torch.ones(int(self.cfg.faults.leak_mib * 2**20), dtype=torch.uint8, device=dev))
        tokens = batch * (self.cfg.decode_tokens if mode == "decode" else seq)
        fl = F.step_flops(self.fields, mode, batch, seq, self.cfg.decode_tokens)
        peak = F.peak_tflops(self.device_name, self.precision)
        tflops = fl / dt / 1e12
        return {"ts": time.time_ns() // 1000, "step": self._step, "gpu": self.cfg.gpu_index, "mode": mode,
                "phase": phase, "precision": self.precision, "batch": batch, "seq_len": seq,
                "step_time_s": dt, "tokens_per_s": tokens / dt, "tflops": tflops,
                "mfu": tflops / peak if peak else None, "loss": loss, "max_abs_logit": max_logit,
                **X.step_memory(dev), "expert_impl": self._impl_label(), "micro_batches": k,
                "checkpointing": self.checkpointing if mode == "train" else None}

    def release_fault_memory(self) -> None:
        """Drop the memory the leak fault (`faults.leak_mib`) has held so far."""
        self._leak.clear()

    def _impl_label(self) -> str | None:
        """What ran the step: the experts implementation, and for the decode engine its path and mode
        (e.g. "dense-bmm+mla-absorbed+fused/graphs", "grouped_mm/eager" after a fall-back)."""
        d = self.decoder
        if self.model is not None:  # the decode engine may have switched it (grouped_mm for graphs)
            self.expert_impl = getattr(self.model.config, "_experts_implementation", None) or "eager"
        if d is None or d.mode is None:
            return self.expert_impl + T.label(self.cfg.tuning)
        if d.mode == "eager":
            return f"{self.expert_impl}{T.label(self.cfg.tuning)}/eager"
        if d.impl == "fast":
            experts = "dense-bmm" if d.detail.get("experts") == "dense bmm" else self.expert_impl
            attention = "mla-absorbed" if d.new_tokens else "mla-sdpa"  # a prefill-only engine: expanded attention
            fused = "+fused" if d.new_tokens and d.detail.get("kernels", "").startswith("fused") else ""
            return f"{experts}+{attention}{fused}{'+compiled' if d.detail.get('compiled') else ''}/{d.mode}"
        return f"{self.expert_impl}{T.label(self.cfg.tuning)}/{d.mode}"

    def _recover_oom(self, message: str, batch: int, seq: int, before: int | None, micro: int | None = None) -> bool:
        """Free what the failed step held; True = retry the same step (a reactive rule decided so)."""
        self.ooms += 1
        gpu = self.cfg.gpu_index
        micro = micro or batch
        self.bus.emit("oom", X.oom_message(micro, seq, self.precision), "error", gpu=gpu,
                      **X.oom_detail(micro=micro, seq=seq, precision=self.precision, error=message, effective_batch=batch,
                                     allocated_before=before, step=self._step, checkpointing=self.checkpointing,
                                     phase=self.schedule.plan()[2] if not self.schedule.finished else None))
        self.release_fault_memory()  # the leak fault's memory is what a real leak fix would release
        if getattr(self, "decoder", None) is not None:
            self.decoder.release()
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        after = X.memory(self.device)["torch_allocated_bytes"]
        react = self.guard.after_oom(self, batch, micro) if self.guard is not None else None
        if react is not None:
            what, n = react
            (self.schedule.set_batch if what == "batch" else self.schedule.set_ceiling)(n)
            self.retries += 1
            decision = f"{self.guard.cfg.rule}: {what} -> {n}, same step retried"
        else:
            decision = self.schedule.oom(micro)
            self.lost_steps += 1
        self.recovered += 1
        self._floor_ooms = self._floor_ooms + 1 if micro <= 1 and react is None else 0
        self._ooms_in_row += 1
        if self._ooms_in_row >= OOM_LOOP and not self._stop.is_set():  # no step ran since: an OOM loop, with or without a guard
            self.unrecovered = (f"{self._ooms_in_row} OOMs in a row and no step ran between them (last at batch {micro}, "
                                f"seq {seq}, {self.precision}): stopped instead of looping")
            self._stop.set()
            self._resume.set()
            decision = "stop: " + self.unrecovered
            self.bus.emit("workload_error", f"workload stopped: {self.unrecovered}", "error", gpu=gpu)
        elif self._floor_ooms >= 2 and self.guard is not None and self.guard.acting and not self.manual:
            # the guard's promise: never an OOM loop. Nothing smaller can run: stop with the summary.
            self.stopped_by = (f"OOM at batch 1 twice in a row ({self.precision}, seq {seq}): nothing smaller to run; "
                               "stopped instead of looping (a leak? see the memory_snapshot event)")
            self._stop.set()
            self._resume.set()
            decision = "stop: " + self.stopped_by
        self.bus.emit("oom_recovered", f"recovered: {decision}", "warning", gpu=gpu,
                      **X.recovered_detail(decision=decision, retried=react is not None,
                                           retry_control=react[0] if react else None,
                                           retry_value=react[1] if react else None, allocated_before=before,
                                           allocated_after=after, **next_step_columns(self.next_plan())))
        return react is not None

    def _integrity(self) -> None:
        """The same input twice must give the same logits (within the precision's tolerance)."""
        diff, tol, same_nonfinite = integrity(self.model, self.fields["vocab_size"], min(128, self.schedule.seq_len),
                                                self.device, self.precision)
        if not (same_nonfinite and diff <= tol):
            self.integrity_failures += 1
            self.bus.emit("integrity_mismatch", f"same input, outputs differ by {diff:.3g} (tol {tol:.3g})",
                          "error", gpu=self.cfg.gpu_index, max_abs_diff=diff, tolerance=tol,
                          nonfinite_pattern_differs=not same_nonfinite)


WHO = ("user", "guard", "schedule", "recovery")


def _finite(x: float | None) -> bool:
    return x is None or x == x and abs(x) != float("inf")
