"""The guard's one-time cost on the training thread, on the CPU: the session's start, the first guarded step
and the close, for the Lightning callback, the Hugging Face callback and `GuardedLoop` (issue 28, session 47).

    python benchmarks/guard_start_cost.py [--repeats 5] [--only lightning,hf,loop] [--json out.json]

Each repeat is a fresh process (the costs are one-time: scikit-learn's import, the sampler's spawn), in which a
tiny model trains 8 steps unguarded (a warm-up, not counted), 8 steps unguarded (timed) and 8 steps guarded
(timed), the guarded run like the GPU's: the process sampler, the shipped risk model, the guard on - with a
recording replayed as the live telemetry (`source=`), so that there is a GPU to score and guard. Printed, in ms
(median and range over the repeats):
- start: the callback's train-start hook (`on_train_start` / `on_train_begin`; HF's decides the first step
  there), `GuardedLoop.start()`;
- first: the guard's own time in the first optimizer step (Lightning: `on_train_batch_start` + `_end`; HF:
  `on_step_begin` + `on_step_end`; the loop: `step_overhead_s[0]`, its decision and its row);
- close: `on_train_end` / `close()` (every row flushed, the session compacted);
- extra: the guarded run's wall minus the unguarded one's (what the run paid in all, here).
Run it at two commits to compare; say the machine (a 2-core dev box shares its cores with the sampler's process
and the model's load, which a GPU host does not).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "recordings" / "sample-h200-ramp-train"  # replayed as the live GPU (tests/conftest.py's RAMP)
STEPS = 8
PHASES = ("start", "first", "close", "extra")


class Timer:
    """Milliseconds spent in an object's hooks, per phase (wraps the instance's bound methods)."""

    def __init__(self) -> None:
        self.ms = {p: 0.0 for p in PHASES}
        self.step = 0  # optimizer steps ended

    def wrap(self, obj, name: str, phase) -> None:
        fn = getattr(obj, name)

        def timed(*a, **kw):
            ph = phase() if callable(phase) else phase
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                if ph is not None:
                    self.ms[ph] += 1e3 * (time.perf_counter() - t)
        setattr(obj, name, timed)

    def first(self):
        return "first" if self.step == 0 else None


def tiny_lm(gw=None, on_batch=None):
    """A tiny Lightning language model over ids of 64 tokens (also benchmarks/guard_step_cost.py's): its step through
    `gw.step` when guarded (`gw`: the callback), whole otherwise; `on_batch(ids)` sees each (micro-)batch."""
    import lightning as L
    import torch

    class LM(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Embedding(64, 64), torch.nn.Linear(64, 64))

        def loss_of(self, batch):
            ids = batch[0]
            if on_batch is not None:
                on_batch(ids)
            logits = self.net(ids[:, :-1])
            return torch.nn.functional.cross_entropy(logits.reshape(-1, 64), ids[:, 1:].reshape(-1))

        def training_step(self, batch, i):
            return gw.step(self, batch, self.loss_of) if gw is not None else self.loss_of(batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return LM()


def run_lightning(record_dir: str) -> dict[str, float]:
    import lightning as L
    import torch

    from gpuwatch.integrations.lightning import GpuwatchLightningCallback

    ds = torch.utils.data.TensorDataset(torch.randint(0, 64, (8 * STEPS, 64), generator=torch.Generator().manual_seed(1)))

    def fit(gw) -> float:
        trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=record_dir,
                            callbacks=[gw] if gw is not None else [], reload_dataloaders_every_n_epochs=1)
        dl = gw.dataloader(ds, batch_size=8) if gw is not None else torch.utils.data.DataLoader(ds, batch_size=8)
        t = time.perf_counter()
        trainer.fit(tiny_lm(gw), train_dataloaders=dl)
        return time.perf_counter() - t

    fit(None)
    plain = fit(None)
    gw = GpuwatchLightningCallback(record_dir=record_dir, name="pl", source=str(SOURCE), gpu_index=0)
    tm = Timer()
    tm.wrap(gw, "on_train_start", "start")
    tm.wrap(gw, "on_train_batch_start", tm.first)
    tm.wrap(gw, "on_train_batch_end", tm.first)
    tm.wrap(gw, "on_before_backward", tm.first)
    tm.wrap(gw, "on_train_end", "close")
    orig_end = gw.on_train_batch_end

    def end(trainer, *a, **kw):
        orig_end(trainer, *a, **kw)
        tm.step = trainer.global_step
    gw.on_train_batch_end = end
    guarded = fit(gw)
    return _done(tm, guarded, plain, gw.loop)


def run_hf(record_dir: str) -> dict[str, float]:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    from gpuwatch.integrations.hf import GpuwatchCallback, train

    hf_logging.set_verbosity_error()
    data = [{"input_ids": x, "labels": x} for x in torch.randint(0, 64, (8 * STEPS, 32), generator=torch.Generator().manual_seed(1))]

    def fit(gw, name: str) -> float:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=64, vocab_size=64, n_positions=32))
        args = TrainingArguments(output_dir=str(Path(record_dir) / name), per_device_train_batch_size=8, max_steps=STEPS,
                                 learning_rate=0.1, optim="sgd", report_to=[], save_strategy="no", use_cpu=True,
                                 disable_tqdm=True, include_num_input_tokens_seen=True, logging_steps=100)
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[gw] if gw is not None else [])
        t = time.perf_counter()
        train(trainer) if gw is not None else trainer.train()
        return time.perf_counter() - t

    fit(None, "warm")
    plain = fit(None, "plain")
    gw = GpuwatchCallback(record_dir=record_dir, name="hf", source=str(SOURCE), gpu_index=0)
    tm = Timer()
    tm.wrap(gw, "on_train_begin", "start")
    tm.wrap(gw, "on_step_begin", tm.first)
    tm.wrap(gw, "on_step_end", tm.first)
    tm.wrap(gw, "on_train_end", "close")

    orig = gw.on_step_end

    def end(args, state, control, **kw):
        out = orig(args, state, control, **kw)
        tm.step = state.global_step
        return out
    gw.on_step_end = end
    guarded = fit(gw, "guarded")
    return _done(tm, guarded, plain, gw.loop)


def run_loop(record_dir: str) -> dict[str, float]:
    import torch

    from gpuwatch.integrations.loop import GuardedLoop

    batches = list(torch.randint(0, 64, (STEPS, 8, 64), generator=torch.Generator().manual_seed(1)))

    def fit(guarded: bool) -> tuple[float, Timer, GuardedLoop | None]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(64, 64), torch.nn.Linear(64, 64))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def loss(b):
            return torch.nn.functional.cross_entropy(model(b[:, :-1]).reshape(-1, 64), b[:, 1:].reshape(-1))
        tm = Timer()
        t = time.perf_counter()
        if not guarded:
            for b in batches:
                loss(b).backward()
                opt.step()
                opt.zero_grad()
            return time.perf_counter() - t, tm, None
        g = GuardedLoop(model, opt, record_dir=record_dir, name="loop", source=str(SOURCE), gpu_index=0)
        t1 = time.perf_counter()
        g.start()
        tm.ms["start"] = 1e3 * (time.perf_counter() - t1)
        for b in g.wrap(batches):
            g.step(b, loss)
        tm.ms["first"] = 1e3 * g.step_overhead_s[0]
        t1 = time.perf_counter()
        g.close()
        tm.ms["close"] = 1e3 * (time.perf_counter() - t1)
        return time.perf_counter() - t, tm, g

    fit(False)
    plain, _, _ = fit(False)
    guarded, tm, g = fit(True)
    return _done(tm, guarded, plain, g)


def _done(tm: Timer, guarded_s: float, plain_s: float, loop) -> dict[str, float]:
    """The phases, and a check that the session recorded what it should (every step's row)."""
    from gpuwatch.recording.reader import open_recording

    rec = open_recording(loop.session_dir)
    assert rec.steps.height == STEPS, f"{rec.steps.height} steps rows of {STEPS}"
    return {**tm.ms, "extra": 1e3 * (guarded_s - plain_s), "plain_ms": 1e3 * plain_s, "guarded_ms": 1e3 * guarded_s,
            "steps_rows": rec.steps.height, "risk_rows": rec.risk.height}


RUNS = {"lightning": run_lightning, "hf": run_hf, "loop": run_loop}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", default="lightning,hf,loop")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--one", choices=sorted(RUNS), help=argparse.SUPPRESS)  # a repeat, in its own process
    a = ap.parse_args()
    if a.one:
        with tempfile.TemporaryDirectory() as d:
            print(json.dumps(RUNS[a.one](d)))
        return
    out: dict[str, list[dict]] = {}
    # this tree's gpuwatch (an old commit's) first, then whatever was on the path (a device's carried wheels)
    PYPATH = os.pathsep.join([str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    for name in a.only.split(","):
        for _ in range(a.repeats):
            r = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True, cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": PYPATH})
            if r.returncode != 0:
                sys.exit(f"{name}: {r.stderr[-3000:]}")
            out.setdefault(name, []).append(json.loads(r.stdout.strip().splitlines()[-1]))
        runs = out[name]
        cells = []
        for p in PHASES:
            v = [x[p] for x in runs]
            cells.append(f"{p} {statistics.median(v):.0f} ({min(v):.0f}-{max(v):.0f})")
        print(f"{name:9s} ms, median (range) of {len(runs)}: " + "; ".join(cells)
              + f"; risk rows {min(x['risk_rows'] for x in runs)}-{max(x['risk_rows'] for x in runs)}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
