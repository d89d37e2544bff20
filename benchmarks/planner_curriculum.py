"""The planner on the H200 (issue 28): an ordinary Hugging Face `Trainer` fine-tune nobody on the project
wrote the guard for - a random-weight Llama-style model (~0.33 B parameters), bf16, per-device batch 16,
a length curriculum from 256 to 4,096 tokens in sequential order, under a memory cap - run in arms:

- `unguarded`: the Trainer alone;
- `planner`: `GpuwatchCallback` + `gpuwatch.integrations.hf.train`, the guard planning (the default: the
  Trainer's step split in place, so a smaller micro-batch needs no restart);
- `planner-restart`: the same with `GpuwatchCallback(split=False)`: each change of the per-device batch a
  checkpoint and a resumed run (what `planner` was until session 46);
- `threshold`: the same with `GuardConfig(plan=False)` (the risk threshold and the 15 s give-back timer);
- `static`: a cautious static per-device batch (`--static-batch`, default 4) x accumulation, the same effective batch;
- `autofind`: `TrainingArguments(auto_find_batch_size=True)` (accelerate's find_executable_batch_size);
- `observe`: the static configuration with `GpuwatchCallback` in observe mode (it records and scores, never acts):
  beside `static`, what watching alone costs a step at the same configuration;
- `planner-nocap` / `unguarded-nocap`: no cap, fewer steps: what the guard costs where it need not act;
- `lightning-planner` / `lightning-unguarded` / `lightning-static`: the same model in a Lightning `Trainer`,
  `--epochs` epochs, each a curriculum of `--steps`/`--epochs` steps from `--min-seq` to `--lightning-max-seq`
  (per-device batch `--batch`, bf16-mixed). The planner arm's training_step is `gw.step(...)`
  (integrations/lightning.py): the micro-batch changes in the step, at any optimizer step.
  `lightning-observe`: the static configuration with the callback in observe mode (beside `lightning-static`,
  what watching alone costs). `lightning-planner-epoch`: without `gw.step` - Lightning changes the per-device batch only between epochs,
  so inside the first epoch activation checkpointing is the one remedy the guard has (what
  `lightning-planner` was until session 46). Static: `--static-batch` x accumulation.
Each arm runs in its own process (a fresh CUDA context and cap) with a time limit and prints one JSON line:
steps done, OOMs (including any after a give-back), restarts, effective batches seen, tokens/s, the
guard's actions by kind, the plans it chose, and every arm's `step_log` (`StepLog`): each optimizer step's micro-batches,
wall time and length, and on CUDA the caching allocator's segment allocations and frees (cudaMalloc /
cudaFree) and retries in it - so a guarded and a static arm compare step by step, at a new length and at a
repeat, and what the allocator did differently shows.

    python benchmarks/planner_curriculum.py --out results/ [--arms planner,unguarded,...] [--steps 150]
    python benchmarks/planner_curriculum.py --dry-run   # CPU, tiny: the code paths only
An arm named `planner#2` is a repeat of `planner` (its own session and Trainer folder).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ARMS = ("planner", "unguarded", "threshold", "static", "autofind", "planner-nocap", "unguarded-nocap")
# also: `planner-restart` (split=False)
# not in the default set: `planner-nocap-1hz`, the planner with the risk scored at 1 Hz instead of 5 (what the
# scorer thread costs the steps where the guard need not act)
LIGHTNING_ARMS = ("lightning-planner", "lightning-unguarded", "lightning-static")  # also: lightning-planner-epoch


def lengths(steps: int, lo: int, hi: int) -> list[int]:
    return [int(round((lo + (hi - lo) * i / max(1, steps - 1)) / 64) * 64) or 64 for i in range(steps)]


class StepLog:
    """Each optimizer step's wall time (from the last step's end), its sequence length, its micro-batches and, on
    CUDA, the allocator's counters over it: segments allocated (cudaMalloc) and freed (cudaFree, which waits for
    the device) and allocation retries (a malloc that failed, freed the cache and tried again). `summary()`: the
    steps by kind (a shape's first run, a later visit, a repeat: s47's Lightning arms paid ~0.15 s at a shape's
    first run only) and the totals. Every arm logs alike (one `memory_stats()` a
    step, ~0.1 ms)."""

    KEYS = ("num_device_alloc", "num_device_free", "num_alloc_retries")

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.t: float | None = None
        self.rows: list[list] = []  # [step, dt_ms, seq_len, mallocs, frees, retries, micro-batches]
        self.last = self._counters()

    def _counters(self) -> tuple[int, ...]:
        if not self.cuda:
            return (0, 0, 0)
        import torch

        st = torch.cuda.memory_stats()
        return tuple(int(st.get(k, 0)) for k in self.KEYS)

    def start(self, now: float) -> None:
        self.t = now

    def end(self, step: int, seq_len: int, now: float, k: int = 1) -> None:
        c = self._counters()
        if self.t is not None:
            self.rows.append([step, round(1e3 * (now - self.t), 2), int(seq_len), *(x - y for x, y in zip(c, self.last)),
                              int(k)])
        self.t, self.last = now, c

    def summary(self) -> dict:
        """Per kind of step - a (micro-batches, length) shape's first run, a later visit after other shapes, a
        repeat of the last step's shape - the count, median ms and total ms, keyed "kind k=K"; and the allocator's
        totals, at first runs apart. The first step (the arm's warm-up) is left out."""
        from step_costs import shape_kinds  # its neighbour: the same classification of a recorded session's steps

        kinds: dict[str, list[list]] = {}
        for r, kind in zip(self.rows, shape_kinds([(r[6], r[2]) for r in self.rows])):
            kinds.setdefault(f"{kind or 'warm-up'} k={r[6]}", []).append(r)
        rows = self.rows[1:]
        first = [r for k, rs in kinds.items() if k.startswith("first") for r in rs]

        def med(xs):
            xs = sorted(xs)
            return xs[len(xs) // 2] if xs else None

        return {"steps": len(rows), "ms_total": round(sum(r[1] for r in rows), 1),
                "by_kind": {k: [len(rs), med([r[1] for r in rs]), round(sum(r[1] for r in rs), 1)]
                            for k, rs in sorted(kinds.items()) if not k.startswith("warm-up")},
                "cuda_mallocs": sum(r[3] for r in rows), "cuda_frees": sum(r[4] for r in rows),
                "alloc_retries": sum(r[5] for r in rows), "cuda_mallocs_at_first_runs": sum(r[3] for r in first),
                "cuda_frees_at_first_runs": sum(r[4] for r in first)}

    def result(self) -> dict:
        return {"step_summary": self.summary(), "step_log": self.rows}


def build(a: argparse.Namespace, max_seq: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if a.dry_run:
        cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=max_seq)
    else:
        cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=20,
                          num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=max_seq)
    return cfg, LlamaForCausalLM(cfg)


def lightning_module(model, gw=None):
    """The Lightning arms' LightningModule around the transformers model, and their padding collate; with
    `gw`, training_step runs through `gw.step` (the micro-batch split in the step)."""
    import lightning as L
    import torch

    def collate(rows):
        n = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), n, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = r
        return ids

    class LM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def loss_of(self, ids):
            return self.model(input_ids=ids, labels=ids).loss

        def training_step(self, ids, i):
            return gw.step(self, ids, self.loss_of) if gw is not None else self.loss_of(ids)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return LM, collate


def lightning_counter(lens: list[int], per_epoch: int, deadline: float, log: StepLog, k_of=lambda: 1):
    """A Lightning callback that logs each optimizer step's end (`log`, with `k_of()`: the micro-batches the step
    ran; and `ends`: (step, when) for the steady rate, as the HF arms') and stops the fit past `deadline`
    (`cut[0]`). Returns (callback, ends, cut)."""
    import lightning as L

    steps_seen, cut = [0], [False]
    ends: list[tuple[int, float]] = []

    class Count(L.Callback):
        def on_train_start(self, trainer, pl_module):
            log.start(time.perf_counter())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step != steps_seen[0]:
                now = time.perf_counter()
                ends.append((trainer.global_step, now))
                log.end(trainer.global_step, lens[(trainer.global_step - 1) % per_epoch], now, k_of())
            steps_seen[0] = trainer.global_step
            if time.perf_counter() > deadline:
                cut[0] = True
                trainer.should_stop = True

    return Count(), ends, cut


def run_lightning_arm(label: str, a: argparse.Namespace) -> dict:
    arm = label.split("#")[0]  # "planner#2": a repeat of the planner arm
    import lightning as L
    import torch

    from gpuwatch.control.policy import GuardConfig
    from gpuwatch.integrations.batches import chunks
    from gpuwatch.integrations.lightning import GpuwatchLightningCallback

    dry = a.dry_run
    dev_ok = torch.cuda.is_available() and not dry
    per_epoch = max(2, a.steps // a.epochs)
    lens = lengths(per_epoch, a.min_seq, a.lightning_max_seq)
    cfg, model = build(a, a.lightning_max_seq)
    params = sum(p.numel() for p in model.parameters())
    B = a.batch
    gen = torch.Generator().manual_seed(1)
    data = [torch.randint(0, cfg.vocab_size, (s,), generator=gen) for s in lens for _ in range(B)]
    cap = int(a.cap_gib * 2**30) if dev_ok else None
    guarded = arm.startswith("lightning-planner") or arm == "lightning-observe"
    if cap and not guarded:
        torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0).total_memory, 0)

    log = StepLog(dev_ok)
    static = arm in ("lightning-static", "lightning-observe")
    per_dev, accum = (a.static_batch, B // a.static_batch) if static else (B, 1)
    gw = None

    def k_of() -> int:  # the micro-batches the step ran: the accumulation, and gw.step's split within each batch
        return accum * chunks(per_dev, gw.micro if gw is not None else None)

    count, ends, cut = lightning_counter(lens, per_epoch, time.perf_counter() + a.arm_timeout - 25.0, log, k_of)
    cbs = [count]
    if guarded:
        gw = GpuwatchLightningCallback(record_dir=Path(a.out) / "sessions", name=label.replace("#", "-"),
                                       guard_config=GuardConfig(mode="observe" if static else "on"), memory_limit=cap,
                                       sampler="thread" if dry else "process",
                                       **({"source": a.source} if dry and a.source else {}))
        cbs.append(gw)
    LM, collate = lightning_module(model, gw if arm == "lightning-planner" else None)
    if gw is not None:
        loader = gw.dataloader(data, batch_size=per_dev, collate_fn=collate)
    else:
        loader = torch.utils.data.DataLoader(data, batch_size=per_dev, collate_fn=collate, shuffle=False)
    trainer = L.Trainer(max_epochs=a.epochs, accelerator="gpu" if dev_ok else "cpu", devices=1,
                        precision="bf16-mixed" if dev_ok else "32-true", accumulate_grad_batches=accum, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(Path(a.work) / f"pl-{label}"), callbacks=cbs,
                        reload_dataloaders_every_n_epochs=1)
    t0 = time.perf_counter()
    died = None
    try:
        trainer.fit(LM(), train_dataloaders=loader)
    except torch.OutOfMemoryError as e:
        died = str(e).splitlines()[0][:200]
    except RuntimeError as e:
        died = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    wall = time.perf_counter() - t0
    done = trainer.global_step
    tokens = sum(B * lens[i % per_epoch] for i in range(done))
    res = {"arm": label, "params": params, "steps": per_epoch * a.epochs, "steps_done": done,
           "completed": done >= per_epoch * a.epochs and died is None, "died": died, "wall_s": round(wall, 1),
           "tokens_per_s": round(tokens / wall, 1) if wall > 0 else None, "cut_at_deadline": cut[0],
           "cap_gib": None if cap is None else a.cap_gib, "max_seq": a.lightning_max_seq, "epochs": a.epochs,
           "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if dev_ok else None,
           "ooms": 1 if died and "memory" in died.lower() else 0, "restarts": 0,
           # from the first optimizer step's end to the last's: the one-time costs (CUDA's warm-up, a guarded arm's
           # session start in on_train_start) left out, as the HF arms' tokens_per_s_after_first
           "tokens_per_s_after_first": (round(sum(B * lens[(g - 1) % per_epoch] for g, _t in ends[1:])
                                             / (ends[-1][1] - ends[0][1]), 1) if len(ends) >= 2 else None),
           **log.result()}
    if gw is not None:
        res.update(effective_batch_min=min(gw.effective), effective_batch_max=max(gw.effective))
        res.update(_guard_events(Path(a.out) / "sessions" / label.replace("#", "-")))
        res["ooms"] += res.get("oom_events", 0)
    return res


def run_arm(label: str, a: argparse.Namespace) -> dict:
    arm = label.split("#")[0]  # "planner#2": a repeat of the planner arm
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from gpuwatch.control.policy import GuardConfig
    from gpuwatch.integrations.batches import chunks
    from gpuwatch.integrations.hf import GpuwatchCallback, train

    dry = a.dry_run
    dev_ok = torch.cuda.is_available() and not dry
    steps = a.steps if "nocap" not in arm else a.nocap_steps
    lens = lengths(steps, a.min_seq, a.max_seq)
    cfg, model = build(a, a.max_seq)
    params = sum(p.numel() for p in model.parameters())
    B = a.batch
    gen = torch.Generator().manual_seed(1)
    data = [{"input_ids": torch.randint(0, cfg.vocab_size, (s,), generator=gen)} for s in lens for _ in range(B)]

    def collate(rows):  # dynamic padding (a batch that straddles two lengths: autofind's smaller batches)
        n = max(len(r["input_ids"]) for r in rows)
        ids = torch.zeros(len(rows), n, dtype=torch.long)
        labels = torch.full((len(rows), n), -100, dtype=torch.long)
        mask = torch.zeros(len(rows), n, dtype=torch.long)
        for i, r in enumerate(rows):
            x = r["input_ids"]
            ids[i, :len(x)], labels[i, :len(x)], mask[i, :len(x)] = x, x, 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    cap = None if "nocap" in arm or not dev_ok else int(a.cap_gib * 2**30)
    guarded = arm.startswith("planner") or arm in ("threshold", "observe")
    if cap and not guarded:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(cap / total, 0)
    per_dev, accum = (a.static_batch, B // a.static_batch) if arm in ("static", "observe") else (B, 1)
    out_dir = Path(a.work) / f"trainer-{label}"  # checkpoints (GBs): never under --out
    args = TrainingArguments(output_dir=str(out_dir), per_device_train_batch_size=per_dev,
                             gradient_accumulation_steps=accum, max_steps=steps, learning_rate=1e-4,
                             lr_scheduler_type="constant", train_sampling_strategy="sequential", report_to=[],
                             save_strategy="no", logging_steps=1, include_num_input_tokens_seen=True, seed=0,
                             disable_tqdm=True, bf16=dev_ok, use_cpu=not dev_ok, dataloader_num_workers=0,
                             auto_find_batch_size=(arm == "autofind"), save_only_model=False)
    eff: list[int] = []
    ends: list[float] = []  # each step's end (perf_counter)
    log = StepLog(dev_ok)
    first_begin: list[float] = []
    begins = [0]
    deadline = time.perf_counter() + a.arm_timeout - 25.0  # the arm's own figures before the parent's limit
    cut = [False]

    class Count(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            begins[0] += 1
            log.start(time.perf_counter())

        def on_step_begin(self, args, state, control, **kw):
            if not first_begin:
                first_begin.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            ends.append(time.perf_counter())
            # split in the step: each per-device batch as micro-batches of gw.micro
            k = args.gradient_accumulation_steps * chunks(args.per_device_train_batch_size, gw.micro if gw else None)
            log.end(state.global_step, lens[min(state.global_step, steps) - 1], ends[-1], k)
            eff.append(args.per_device_train_batch_size * args.gradient_accumulation_steps)
            if time.perf_counter() > deadline:
                cut[0] = True
                control.should_training_stop = True

    cbs = [Count()]
    gw = None
    if guarded:
        gc = (GuardConfig(mode="on", plan=False) if arm == "threshold" else GuardConfig(mode="observe") if arm == "observe"
              else GuardConfig(mode="on"))
        gw = GpuwatchCallback(record_dir=Path(a.out) / "sessions", name=label.replace("#", "-"), guard_config=gc,
                              memory_limit=cap, sampler="thread" if dry else "process", split=arm != "planner-restart",
                              **({"score_hz": 1.0} if arm.endswith("-1hz") else {}),
                              **({"source": a.source} if dry and a.source else {}))
        cbs.append(gw)
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collate, callbacks=cbs)
    t0 = time.perf_counter()
    died = None
    try:
        train(trainer) if gw is not None else trainer.train()
    except torch.OutOfMemoryError as e:
        died = str(e).splitlines()[0][:200]
    except RuntimeError as e:
        died = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    wall = time.perf_counter() - t0
    done = trainer.state.global_step
    tokens = sum(B * lens[i] for i in range(min(done, steps)))
    res = {"arm": label, "params": params, "steps": steps, "steps_done": done, "completed": done >= steps and died is None,
           "died": died, "wall_s": round(wall, 1), "tokens_per_s": round(tokens / wall, 1) if wall > 0 else None,
           "effective_batch_min": min(eff) if eff else None, "effective_batch_max": max(eff) if eff else None,
           "train_begins": begins[0], "cut_at_deadline": cut[0], "cap_gib": None if cap is None else a.cap_gib,
           # the steady rate: from the first step's end to the last's (the arms' one-time costs - CUDA's warm-up in the
           # first step, and for a guarded arm the callback's start: its recorder, sampler process and risk model,
           # before the first step - left out; `first_step_begin_s` says what the start took)
           "tokens_per_s_after_first": (round(sum(B * lens[i] for i in range(1, min(len(ends), steps)))
                                             / (ends[min(len(ends), steps) - 1] - ends[0]), 1)
                                        if min(len(ends), steps) >= 2 and ends[-1] > ends[0] else None),
           "first_step_begin_s": round(first_begin[0] - t0, 2) if first_begin else None,
           "max_seq": a.max_seq, "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if dev_ok else None,
           **log.result()}
    if gw is not None:
        res.update(ooms=gw.ooms, restarts=gw.restarts, restart_costs_s=[round(x, 2) for x in gw.restart_costs])
        over = sorted(gw.step_overhead_s)
        if over:  # gpuwatch's own time inside the steps (the guard, the bookkeeping), against the run's wall time
            res.update(overhead_ms_p50=round(1e3 * over[len(over) // 2], 3), overhead_ms_max=round(1e3 * over[-1], 3),
                       overhead_share=round(sum(over) / wall, 5) if wall > 0 else None)
        res.update(_guard_events(Path(a.out) / "sessions" / label.replace("#", "-")))
    else:
        res.update(ooms=(1 if died and "memory" in died.lower() else 0) + max(0, begins[0] - 1) * (arm == "autofind"),
                   restarts=max(0, begins[0] - 1))
    return res


def _guard_events(session: Path) -> dict:
    from gpuwatch.recording.reader import open_recording

    try:
        rec = open_recording(session)
    except Exception as e:  # noqa: BLE001 - the arm's figures stand without the session's
        return {"session_error": str(e)[:200]}
    ev = rec.events
    kinds = ev["kind"].to_list()
    acts: dict[str, int] = {}
    controls: dict[str, int] = {}  # the workload's own changes: "split" (in the step), "restart", "epoch_batch"...
    plans = []
    for k, d in zip(kinds, ev["detail"].to_list()):
        if k == "control":
            c = json.loads(d or "{}").get("control", "?")
            controls[c] = controls.get(c, 0) + 1
        if k != "guard_action":
            continue
        det = json.loads(d or "{}")
        acts[det.get("action", "?")] = acts.get(det.get("action", "?"), 0) + 1
        if det.get("action") == "plan":
            c = det.get("chosen") or {}
            plans.append({k2: c.get(k2) for k2 in ("micro_batch", "checkpointing", "seq_len", "peak_frac", "restart")})
    ck = rec.steps["checkpointing"].to_list() if "checkpointing" in rec.steps.columns else []
    # the guard resets torch's peak counter every step, so the process's own figure at the end is the last step's:
    # the run's peak is the highest of the recorded steps'
    pk = rec.steps["torch_peak_bytes"].max() if "torch_peak_bytes" in rec.steps.columns else None
    out = {} if pk is None else {"peak_allocated_gib": round(float(pk) / 2**30, 2)}
    return out | {"guard_actions": acts, "controls": controls, "plans": plans[:20], "oom_events": kinds.count("oom"),
            "steps_with_checkpointing": sum(1 for x in ck if x), "session": str(session)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/planner")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--work", default="/tmp/gw-planner", help="the Trainers' output (checkpoints)")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--nocap-steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--static-batch", type=int, default=4)
    ap.add_argument("--min-seq", type=int, default=256)
    ap.add_argument("--max-seq", type=int, default=4096)
    ap.add_argument("--cap-gib", type=float, default=34.0)
    ap.add_argument("--arm-timeout", type=float, default=150.0)
    ap.add_argument("--epochs", type=int, default=3, help="the Lightning arms: epochs, each a curriculum")
    ap.add_argument("--lightning-max-seq", type=int, default=1536, help="the Lightning arms' longest length: "
                    "16 x 1,536 needs checkpointing under the cap, 8 x 1,536 does not")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model, 6 steps: the code paths")
    ap.add_argument("--source", default=None, help="dry run: a recording replayed as the live telemetry")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.dry_run:
        a.steps, a.nocap_steps, a.max_seq, a.min_seq, a.batch, a.static_batch = 6, 4, 64, 16, 4, 2
        a.lightning_max_seq, a.epochs = 48, 2
    Path(a.out).mkdir(parents=True, exist_ok=True)
    if a.one:
        print(json.dumps(run_lightning_arm(a.one, a) if a.one.startswith("lightning") else run_arm(a.one, a)), flush=True)
        return 0
    results = []
    for arm in a.arms.split(","):
        cmd = [sys.executable, __file__, "--one", arm, *sys.argv[1:]]
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.arm_timeout, env=os.environ)
            line = next((x for x in reversed(p.stdout.splitlines()) if x.startswith("{")), None)
            r = json.loads(line) if line else {"arm": arm, "error": (p.stderr or "")[-600:], "rc": p.returncode}
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            r = {"arm": arm, "error": f"timed out after {a.arm_timeout:g} s", "stdout_tail": out[-300:]}
        r["arm_wall_s"] = round(time.perf_counter() - t0, 1)
        results.append(r)
        print(json.dumps(r), flush=True)
        (Path(a.out) / "planner_curriculum.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
