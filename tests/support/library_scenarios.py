"""The scenarios of the guard-library benchmark (benchmarks/guard_library.py runs them on the H200): the
guard in users' own training loops, unguarded vs guarded, paired, on one GPU under a memory cap. Here, not
in benchmarks/, because the tests run them too: `run(dry=True)` is the CPU dry run (a tiny model,
simulated OOMs: the code paths and the JSON; tests/test_library.py, test_guard_fragment.py).

A small transformers model with random weights (LlamaForCausalLM from a config; no download) trains
on random tokens. The cap (`torch.cuda.set_per_process_memory_fraction`) is calibrated first from two
probe steps after a warm-up: the step's peak as a line in its tokens (intercept: weights, gradients,
optimizer state; slope: bytes per token), the cap set so that a step of 32k tokens peaks at 90 % of it,
so each scenario sits where it means to whatever the card. Scenarios, each run unguarded then guarded
on the same sequence of batches:

- `ramp-loop`: a plain PyTorch loop, batch 16, sequence lengths drifting up with noise until the largest
  step needs about twice the cap. Unguarded = the usual resilient loop (an OOM frees memory and skips
  the batch: a step lost). Guarded = `GuardedLoop` (micro-batches under the guard's ceiling, same
  effective batch; an OOM it did not prevent is retried at half the micro-batch).
- `ramp-hf`: the same model in a Hugging Face Trainer over a dataset sorted by length (the ramp).
  Unguarded = `auto_find_batch_size=True` (accelerate's find_executable_batch_size: after an OOM the
  per-device batch is cut and training restarts); guarded = `GpuwatchCallback` + `train()` (per-device
  batch down, accumulation up, resumed from a checkpoint).
- `healthy`: fixed shape at ~60 % of the cap, where the guard never needs to act: tokens/s guarded /
  unguarded (target >= 0.98), the arms interleaved A B A B.
- `fragment` (tests/support/guard_fragment.py): random sequence lengths 1/4..1 of 0.88 x the fit (the
  longest step's allocated peak ~0.80 of the cap), and each step odd-sized buffers kept alive for three
  steps, cut on a side stream from a freed staging block of 0.1 x the cap: ~0.3 of the cap reserved but
  unallocated, which no step can use, so the long steps OOM unguarded. Guarded: the cache is released
  and the allocator switched to expandable segments. Its `criteria` say whether it showed that.
- `leak`: 1 % of the cap kept every step. Unguarded runs into the OOM; guarded names the leak, calls the
  checkpoint hook and stops before it.

Targets (issue 16): zero OOMs guarded in the ramps and under fragmentation, a clean stop before the
leak's OOM, >= 98 % of unguarded tokens/s in `healthy`. `run` writes one JSON object to `out` (and each
guarded arm's gpuwatch session under `sessions`, default next to `out`).
"""

from __future__ import annotations

import gc
import json
import random
import sys
import time
from pathlib import Path

import torch

from support.guard_fragment import at_failure

GiB = 2**30


# -- the model and the data ---------------------------------------------------------------------------------
def build_model(dry: bool, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    if dry:
        cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512)
    else:
        cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                          num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=8192)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(device), cfg


def lm_loss(model):
    def f(ids):
        return model(input_ids=ids, labels=ids, use_cache=False).loss
    return f


def amp(device):
    return torch.autocast(device.type, dtype=torch.bfloat16)


class SimOOM:
    """--dry-run (CPU): a micro-batch over `tokens` tokens raises the OOM a GPU would."""

    def __init__(self, tokens: int | None):
        self.tokens = tokens

    def check(self, ids):
        if self.tokens and ids.numel() > self.tokens:
            raise torch.OutOfMemoryError(f"CUDA out of memory. (simulated: {ids.numel()} tokens > {self.tokens})")


# -- calibration -----------------------------------------------------------------------------------------------
def calibrate(model, device, vocab: int, dry: bool) -> dict:
    """The step's absolute peak as a line in its tokens, `peak = fixed + per_token x tokens`, from two
    probe steps after a warm-up step (which allocates AdamW's state, so the probes do not count it)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if device.type != "cuda":
        return {"fixed": 0, "per_token": 1, "opt": opt}
    peaks = []
    for b, s in ((4, 256), (4, 256), (4, 1024)):
        ids = torch.randint(0, vocab, (b, s), device=device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with amp(device):
            loss = lm_loss(model)(ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        peaks.append((b * s, torch.cuda.max_memory_allocated()))
        del ids, loss
    (t1, p1), (t2, p2) = peaks[1], peaks[2]
    per_token = max(1, (p2 - p1) // (t2 - t1))
    return {"fixed": max(0, p1 - per_token * t1), "per_token": per_token, "opt": opt}


def set_cap(device, cap: int | None) -> None:
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.set_per_process_memory_fraction(1.0 if cap is None else min(1.0, cap / total), index)


def free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# -- arms -------------------------------------------------------------------------------------------------------
def mem_now(device) -> dict:
    if device.type != "cuda":
        return {"allocated_before": None, "reserved_before": None}
    return {"allocated_before": torch.cuda.memory_allocated(device), "reserved_before": torch.cuda.memory_reserved(device)}


def shapes_seen(batches) -> list[int]:
    """For each step, the most tokens of any step before it (0 for the first)."""
    out, most = [], 0
    for b in batches:
        out.append(most)
        most = max(most, int(b.numel()))
    return out


def oom_row(i: int, ids, seen: int, cap, **kw) -> dict:
    """One OOM's diagnostic row: the step, its plan, whether its shape was larger than any before it."""
    b, s = int(ids.shape[0]), int(ids.shape[1])
    return {"step": i, "batch": b, "seq_len": s, "tokens": b * s, "largest_seen_tokens": seen,
            "larger_than_seen": b * s > seen, "limit_bytes": cap, **kw}


def guard_figures(d: dict | None) -> dict:
    """The guard's last decision before the failing step (Guard.last_decision): its risk and parts."""
    if not d:
        return {"guard": None}
    keys = ("plan", "scored_plan", "rescored", "fresh", "risk", "peak_cross_p", "next_peak_est_frac",
            "predicted_peak_bytes", "usable_limit_bytes", "mem_used_frac", "torch_reserved_gap_frac", "frag_frac",
            "action", "value", "why", "why_none", "cooldown_left_s")
    return {"guard": {k: d.get(k) for k in keys}}


def plain_loop(model, opt, batches, device, sim: SimOOM, extra=None, cap=None) -> dict:
    """The usual loop: bf16 autocast, AdamW; an OOM frees memory and skips the batch (a step lost)."""
    ooms = lost = tokens = done = 0
    rows = []
    seen = shapes_seen(batches)
    t0 = time.perf_counter()
    for i, ids in enumerate(batches):
        ids = ids.to(device)
        failed: dict | None = None
        before = mem_now(device)
        try:
            if extra:
                extra(i)
            sim.check(ids)
            with amp(device):
                loss = lm_loss(model)(ids)
            loss.backward()
            opt.step()
            float(loss.detach())  # the loss logged each step, as most loops do (and as GuardedLoop does)
        except torch.OutOfMemoryError as e:
            failed = at_failure(device, e)  # allocated / reserved at the failure, read in its handler
        opt.zero_grad(set_to_none=True)
        loss = None
        if failed:  # outside the handler: its traceback pins the step's tensors
            ooms += 1
            lost += 1
            rows.append(oom_row(i, ids, seen[i], cap, micro_batches=1, **before, **failed))
            free(device)
            continue
        done += 1
        tokens += ids.numel()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return {"ooms": ooms, "steps_lost": lost, "steps": done, "tokens": tokens, "seconds": round(dt, 3),
            "tokens_per_s": round(tokens / dt, 1), "effective_batch": sorted({int(b.shape[0]) for b in batches}),
            "oom_rows": rows}


def guarded_loop(model, opt, batches, device, sim: SimOOM, sessions: Path, name: str, cap: int | None,
                 extra=None, checkpoint=None, guard="on") -> dict:
    from gpuwatch.integrations import GuardedLoop

    tokens = 0
    calls = []

    def loss_fn(mb):
        sim.check(mb)
        with amp(device):
            return lm_loss(model)(mb)
    g = GuardedLoop(model, opt, record_dir=sessions, name=name, guard=guard, memory_limit=cap, precision="bf16",
                    sampler="thread" if device.type != "cuda" else "process",
                    allow_bf16=False, checkpoint=lambda step: calls.append(step) or (checkpoint(step) if checkpoint else None))
    seen = shapes_seen(batches)
    oom_rows, acted = [], []
    with g:
        t0 = time.perf_counter()
        for i, ids in enumerate(g.wrap(batches)):
            if extra:
                extra(i)
            n_ev = len(g.bus.events)
            if g.step(ids.to(device), loss_fn) is not None:
                tokens += ids.numel()
            for e in g.bus.events.latest(len(g.bus.events) - n_ev) if len(g.bus.events) > n_ev else []:
                if e.kind == "oom":
                    dd = e.detail
                    oom_rows.append(oom_row(i, ids, seen[i], cap, micro_batch=dd.get("batch"),
                                            micro_batches=dd.get("micro_batches"), allocated_before=dd.get("allocated_before"),
                                            reserved_before=dd.get("reserved_before"), error=dd.get("error"),
                                            **guard_figures(dd.get("guard_decision"))))
                elif e.kind in ("guard_action", "guard_unable", "guard_remedy", "oom_recovered"):
                    acted.append({"step": i, "kind": e.kind, "action": e.detail.get("action"),
                                  "value": e.detail.get("value"), "message": e.message[:240]})
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        bus = g.bus
    rows = bus.steps.latest(len(bus.steps))
    evs = bus.events.latest(len(bus.events))
    kinds = [e.kind for e in evs]
    over = sorted(g.step_overhead_s)
    return {"ooms": g.ooms, "steps_lost": len(batches) - g.steps if not g.stopped else None, "steps": g.steps,
            "tokens": tokens, "seconds": round(dt, 3), "tokens_per_s": round(tokens / dt, 1),
            "effective_batch": sorted({r["batch"] for r in rows}), "micro_batches_max": max((r["micro_batches"] for r in rows), default=0),
            "guard_actions": kinds.count("guard_action"), "guard_unable": kinds.count("guard_unable"),
            "remedies": g.remedies, "stopped": g.stopped, "checkpoint_calls": calls,
            "actions": acted[:60], "oom_rows": oom_rows,
            "overhead_ms_p50": round(1e3 * over[len(over) // 2], 3) if over else None,
            "overhead_ms_p99": round(1e3 * over[int(len(over) * 0.99)], 3) if over else None,
            "session": str(g.session_dir)}


def reset(model, state, opt) -> None:
    model.load_state_dict(state)
    opt.state.clear()


# -- scenarios --------------------------------------------------------------------------------------------------
def ramp_batches(n: int, batch: int, s0: int, s1: int, vocab: int, seed: int) -> list[torch.Tensor]:
    r = random.Random(seed)
    out = []
    for i in range(n):
        s = int((s0 + (s1 - s0) * i / max(1, n - 1)) * r.uniform(0.8, 1.0))
        out.append(torch.randint(0, vocab, (batch, max(8, s))))
    return out


def scenario_ramp_loop(ctx) -> dict:
    d, model, opt, state = ctx["device"], ctx["model"], ctx["opt"], ctx["state"]
    fit = ctx["fit_tokens"]  # tokens of one step that fit the cap
    batch = 16
    n = ctx["steps"]
    s1 = int(2 * fit / batch)  # the largest step needs ~2x the cap's activations
    batches = ramp_batches(n, batch, max(16, s1 // 8), s1, ctx["vocab"], 1)
    out = {"batch": batch, "seq_len_range": [int(batches[0].shape[1]), int(batches[-1].shape[1])], "steps": n}
    set_cap(d, ctx["cap"])
    reset(model, state, opt)
    out["unguarded"] = plain_loop(model, opt, batches, d, ctx["sim"], cap=ctx["cap"])
    free(d)
    reset(model, state, opt)
    out["guarded"] = guarded_loop(model, opt, batches, d, ctx["sim"], ctx["sessions"], "ramp-loop", ctx["cap"])
    free(d)
    return out


def scenario_healthy(ctx) -> dict:
    d, model, opt, state = ctx["device"], ctx["model"], ctx["opt"], ctx["state"]
    batch = 8
    s = max(16, int(0.6 * ctx["fit_tokens"] / batch))
    batches = [torch.randint(0, ctx["vocab"], (batch, s)) for _ in range(ctx["healthy_steps"])]
    set_cap(d, ctx["cap"])
    arms = {"unguarded": [], "guarded": []}
    rounds = 1 if ctx["dry"] else 2
    for rnd in range(rounds):  # interleaved: A B A B
        reset(model, state, opt)
        plain_loop(model, opt, batches[:3], d, SimOOM(None))  # warm-up (kernels, allocator)
        arms["unguarded"].append(plain_loop(model, opt, batches, d, SimOOM(None)))
        free(d)
        reset(model, state, opt)
        arms["guarded"].append(guarded_loop(model, opt, batches, d, SimOOM(None), ctx["sessions"], f"healthy-{rnd}", ctx["cap"]))
        free(d)
    u = sum(a["tokens_per_s"] for a in arms["unguarded"]) / rounds
    g = sum(a["tokens_per_s"] for a in arms["guarded"]) / rounds
    return {"batch": batch, "seq_len": s, "steps": len(batches), "unguarded": arms["unguarded"], "guarded": arms["guarded"],
            "tokens_per_s_ratio": round(g / u, 4), "guard_acted": sum(a["guard_actions"] for a in arms["guarded"])}


def scenario_fragment(ctx) -> dict:
    from support.guard_fragment import scenario_fragment as fragment  # calibrated on calls 25/28

    return fragment(ctx, sys.modules[__name__])


def scenario_leak(ctx) -> dict:
    d, model, opt, state = ctx["device"], ctx["model"], ctx["opt"], ctx["state"]
    batch = 8
    s = max(16, int(0.4 * ctx["fit_tokens"] / batch))
    batches = [torch.randint(0, ctx["vocab"], (batch, s)) for _ in range(ctx["leak_steps"])]
    per_step = max(1, int(0.01 * ctx["cap"])) if ctx["cap"] else ctx["sim_leak"].budget // 12
    leaked: list = []

    def leak(i):
        leaked.append(torch.ones(per_step, dtype=torch.uint8, device=d))
        ctx["sim_leak"].leaked = len(leaked) * per_step
    out = {"batch": batch, "seq_len": s, "leak_bytes_per_step": per_step}
    set_cap(d, ctx["cap"])
    for arm in ("unguarded", "guarded"):
        reset(model, state, opt)
        leaked.clear()
        free(d)
        if arm == "unguarded":
            res = plain_loop_until_oom(model, opt, batches, d, ctx["sim_leak"], leak)
        else:
            res = guarded_loop(model, opt, batches, d, ctx["sim_leak"], ctx["sessions"], "leak", ctx["cap"], extra=leak,
                               checkpoint=lambda step: None)
            res["clean_stop_before_oom"] = bool(res["stopped"]) and res["ooms"] == 0
        out[arm] = res
        leaked.clear()
        free(d)
    return out


class SimLeak(SimOOM):
    """--dry-run: the leaked bytes plus the step's tokens over a budget raise the OOM."""

    def __init__(self, budget: int | None):
        super().__init__(None)
        self.budget, self.leaked = budget, 0

    def check(self, ids):
        if self.budget and self.leaked + ids.numel() > self.budget:
            raise torch.OutOfMemoryError("CUDA out of memory. (simulated leak)")


def plain_loop_until_oom(model, opt, batches, device, sim, leak) -> dict:
    """A leak's first OOM ends an unguarded run (retrying only fails again)."""
    steps = 0
    t0 = time.perf_counter()
    oom = False
    rows = []
    for i, ids in enumerate(batches):
        before = mem_now(device)
        try:
            leak(i)
            sim.check(ids)
            with amp(device):
                loss = lm_loss(model)(ids.to(device))
            loss.backward()
            opt.step()
        except torch.OutOfMemoryError:
            oom = True
        opt.zero_grad(set_to_none=True)
        loss = None
        if oom:
            rows.append(oom_row(i, ids, int(ids.numel()) if i else 0, None, micro_batches=1, **before))
            break
        steps += 1
    return {"ooms": int(oom), "steps": steps, "seconds": round(time.perf_counter() - t0, 3), "oom_rows": rows}


def pad_collate(rows: list[dict]) -> dict:
    """Pad to the batch's longest row (a cut batch may straddle two lengths): labels -100 there."""
    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    labels = torch.full((len(rows), n), -100, dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for i, r in enumerate(rows):
        k = len(r["input_ids"])
        ids[i, :k], labels[i, :k], mask[i, :k] = r["input_ids"], r["labels"], 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def scenario_ramp_hf(ctx) -> dict:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from gpuwatch.integrations.hf import GpuwatchCallback, train

    d, model, state = ctx["device"], ctx["model"], ctx["state"]
    batch = 16
    n = ctx["hf_steps"]
    s1 = int(2 * ctx["fit_tokens"] / batch)
    r = random.Random(3)
    lens = sorted(max(8, int((s1 // 8 + (s1 - s1 // 8) * i / max(1, n - 1)) * r.uniform(0.8, 1.0))) for i in range(n))
    data = []
    for s in lens:  # one batch's rows share a length (sorted, sequential): the ramp
        for _ in range(batch):
            x = torch.randint(0, ctx["vocab"], (s,))
            data.append({"input_ids": x, "labels": x})
    sim = ctx["sim"]
    oom_count = [0]
    unguarded_rows: list = []
    largest = [0]

    class SimTrainer(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            ids = inputs["input_ids"]
            before = mem_now(d)
            try:
                sim.check(ids)
                out = super().training_step(model, inputs, num_items_in_batch)
            except torch.OutOfMemoryError:
                oom_count[0] += 1  # every OOM, real or simulated, whoever recovers from it
                unguarded_rows.append(oom_row(self.state.global_step, ids, largest[0], ctx["cap"],
                                              micro_batches=self.args.gradient_accumulation_steps, **before))
                raise
            largest[0] = max(largest[0], int(ids.numel()))
            return out

    class Count(TrainerCallback):
        def __init__(self):
            self.samples, self.steps, self.t0 = 0, 0, time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.steps += 1
    out = {"batch": batch, "seq_len_range": [lens[0], lens[-1]], "steps": n}
    set_cap(d, ctx["cap"])
    for arm in ("unguarded", "guarded"):
        model.load_state_dict(state)
        free(d)
        args = TrainingArguments(output_dir=str(ctx["sessions"] / f"hf-{arm}"), per_device_train_batch_size=batch,
                                 gradient_accumulation_steps=1, max_steps=n, learning_rate=1e-4, bf16=d.type == "cuda",
                                 train_sampling_strategy="sequential", report_to=[], save_strategy="no", logging_steps=1,
                                 use_cpu=d.type != "cuda", include_num_input_tokens_seen=True, seed=0, disable_tqdm=True,
                                 auto_find_batch_size=arm == "unguarded", save_total_limit=1)
        count = Count()
        cbs = [count]
        unguarded_rows.clear()
        largest[0] = 0
        gw = None
        if arm == "guarded":
            gw = GpuwatchCallback(record_dir=ctx["sessions"], name="ramp-hf", memory_limit=ctx["cap"],
                                  sampler="thread" if d.type != "cuda" else "process")
            cbs.append(gw)
        trainer = SimTrainer(model=model, args=args, train_dataset=data, callbacks=cbs, data_collator=pad_collate)
        t0 = time.perf_counter()
        crashed = None
        oom_count[0] = 0
        try:
            if gw is not None:
                train(trainer)
            else:
                trainer.train()
        except (torch.OutOfMemoryError, RuntimeError) as e:  # the run died
            crashed = str(e).splitlines()[0][:200]
        dt = time.perf_counter() - t0
        tokens = trainer.state.num_input_tokens_seen or 0
        res = {"steps_run": count.steps, "global_step": trainer.state.global_step, "seconds": round(dt, 3),
               "tokens_per_s": round(tokens / dt, 1), "crashed": crashed,
               "final_per_device_batch": trainer.args.per_device_train_batch_size if gw else trainer._train_batch_size,
               "final_accumulation": trainer.args.gradient_accumulation_steps}
        res["effective_batch"] = res["final_per_device_batch"] * res["final_accumulation"]
        res["steps_redone"] = max(0, count.steps - trainer.state.global_step)
        if gw is not None:
            bus = gw.loop.bus
            evs = bus.events.latest(len(bus.events))
            kinds = [e.kind for e in evs]
            res["oom_rows"] = [dict(row, **guard_figures(e.detail.get("guard_decision")))
                               for row, e in zip(unguarded_rows, [e for e in evs if e.kind == "oom"])]
            res["actions"] = [{"step": e.detail.get("step"), "kind": e.kind,
                               "action": e.detail.get("action"), "value": e.detail.get("value"),
                               "message": e.message[:240]} for e in evs
                              if e.kind in ("guard_action", "guard_remedy", "oom_recovered", "control")][:60]
            res.update(ooms=oom_count[0], restarts=gw.restarts,
                       effective_batch_per_step=sorted(set(gw.effective)), guard_actions=kinds.count("guard_action"),
                       session=str(gw.loop.session_dir))
        else:
            res["oom_rows"] = list(unguarded_rows)
            res.update(ooms=oom_count[0], note="auto_find_batch_size: each OOM cuts the per-device batch (x0.9) and "
                       "restarts training from its first step; the effective batch shrinks with it")
        out[arm] = res
        del trainer
        free(d)
    return out


def run(out: Path | str, sessions: Path | str | None = None, dry: bool = False, only: list[str] | None = None,
        steps: int | None = None, budget_s: float = 200.0) -> dict:
    """Every scenario (or those in `only`), each written to `out` as it ends (what ran so far survives a
    timeout); the guarded arms' sessions go under `sessions` (default: beside `out`). `dry`: the CPU, a tiny
    model, simulated OOMs. Returns the result, its `targets` included."""
    device = torch.device("cuda" if torch.cuda.is_available() and not dry else "cpu")
    out_path = Path(out)
    sessions = Path(sessions) if sessions else out_path.parent / (out_path.stem + "-sessions")
    sessions.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    model, cfg = build_model(dry, device)
    cal = calibrate(model, device, cfg.vocab_size, dry)
    opt = cal.pop("opt")
    if device.type == "cuda":
        fit_tokens = 32 * 1024  # a step of this many tokens peaks at ~90 % of the cap
        cap = int((cal["fixed"] + fit_tokens * cal["per_token"]) / 0.9)
        sim = sim_frag = SimOOM(None)
        sim_leak = SimLeak(None)
    else:
        fit_tokens, cap = 512, None
        sim, sim_frag, sim_leak = SimOOM(fit_tokens), SimOOM(int(fit_tokens * 0.75)), SimLeak(4096)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ctx = {"device": device, "model": model, "opt": opt, "state": state, "vocab": cfg.vocab_size, "cap": cap,
           "calibration": cal,
           "fit_tokens": fit_tokens, "sessions": sessions, "sim": sim, "sim_frag": sim_frag, "sim_leak": sim_leak,
           "steps": steps or (8 if dry else 60), "healthy_steps": 4 if dry else 40, "leak_steps": 20 if dry else 400,
           "hf_steps": 4 if dry else 30, "dry": dry}
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU", "dry_run": dry,
              "torch": torch.__version__, "model": {"hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers,
                                                   "vocab": cfg.vocab_size,
                                                   "params": sum(p.numel() for p in model.parameters())},
              "calibration": {"peak_intercept_bytes": cal["fixed"], "peak_bytes_per_token": cal["per_token"],
                              "cap_bytes": cap, "fit_tokens": fit_tokens}, "scenarios": {}}
    _run_scenarios(ctx, result, out_path, only, budget_s, t_all)
    s = result["scenarios"]
    result["targets"] = {
        "ramp_loop_zero_ooms": s.get("ramp-loop", {}).get("guarded", {}).get("ooms") == 0,
        "ramp_hf_zero_ooms": s.get("ramp-hf", {}).get("guarded", {}).get("ooms") == 0,
        "fragment_zero_ooms": s.get("fragment", {}).get("guarded", {}).get("ooms") == 0,  # criteria: "shown"
        "leak_clean_stop": bool(s.get("leak", {}).get("guarded", {}).get("clean_stop_before_oom")),
        "healthy_ratio_ge_0.98": (s.get("healthy", {}).get("tokens_per_s_ratio") or 0) >= 0.98,
    }
    result["wall_s"] = round(time.perf_counter() - t_all, 1)
    out_path.write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result["targets"]))
    return result


SCENARIOS = {"ramp-loop": scenario_ramp_loop, "ramp-hf": scenario_ramp_hf, "healthy": scenario_healthy,
             "leak": scenario_leak, "fragment": scenario_fragment}


def _run_scenarios(ctx: dict, result: dict, out_path: Path, only, budget_s: float, t_all: float) -> None:
    for name, fn in SCENARIOS.items():
        if only and name not in only:
            continue
        if time.perf_counter() - t_all > budget_s:
            result["scenarios"][name] = {"skipped": f"time budget {budget_s:g} s spent"}
            continue
        t0 = time.perf_counter()
        try:
            result["scenarios"][name] = fn(ctx)
        except Exception as e:  # noqa: BLE001 - one scenario's failure is a result, the others still run
            import traceback

            result["scenarios"][name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        result["scenarios"][name]["wall_s"] = round(time.perf_counter() - t0, 1)
        print(f"{name}: {json.dumps(result['scenarios'][name], default=str)[:600]}", flush=True)
        out_path.write_text(json.dumps(result, indent=1, default=str))  # what ran so far survives a timeout
