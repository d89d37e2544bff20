"""The guard's own time per optimizer step on the CPU, for the Hugging Face callback path and the Lightning path
(`gw.step`), with a curriculum so that the planner decides (issue 28, session 47: overhead_ms_p50 2.7-6.4 ms on
the H100, the guard's share 2.1-3.1 % of the wall).

    python benchmarks/guard_step_cost.py [--path hf,lightning] [--steps 120] [--repeats 3] [--phases] [--profile N]

Each repeat is a fresh process in which a tiny model trains `--steps` optimizer steps (per-device batch 8, the
sequence length growing 16 -> 128 tokens, the HF one split in place by `train()`), guarded as on the GPU - the
process sampler, the shipped risk model, the guard on - with a recording replayed as the live GPU (`source=`).
A CPU has no allocator figures, so the steps rows carry simulated ones (what stays allocated + bytes per token x
the largest micro-batch's tokens, under a 12 GiB cap: `SimMemory`): the estimator fits them and the planner
splits the step as the length grows, as it did on the H100.

Printed per path, in ms (median of the repeats and their range): the guard's time per step as the s47 benchmark
reports it (HF: `GpuwatchCallback.step_overhead_s` - `on_step_end`'s record + decide; Lightning: the callback's
`on_train_batch_end`, timed here, plus any decision `gw.step` made in the step before it) at p50, p90 and max, the steps 1.. (the first step's start is
benchmarks/guard_start_cost.py's). `--phases`: the mean ms per step inside each part (main thread only; parts
nest: `decide` holds `before_step`, which holds `estimate`, which holds `window` ...). `--profile N`: cProfile's
N costliest functions (cumulative) of the first repeat's steps.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or by path: its neighbour's model
from guard_start_cost import ROOT, SOURCE, tiny_lm  # noqa: E402 - the recording replayed as the live GPU, the model

BATCH = 8
SEQ0, SEQ1 = 16, 128
GiB = 1 << 30
CAP = 12 * GiB
WEIGHTS = 2 * GiB
PER_TOKEN = 16 << 20  # 8 x 64 tokens: 10 GiB of 12; 8 x 128: 18 GiB - the planner splits as the length grows


def seq_at(i: int, steps: int) -> int:
    """Step i's sequence length: the curriculum, 16 -> 128 tokens in steps of 8."""
    return SEQ0 + (SEQ1 - SEQ0) * i // max(1, steps - 1) // 8 * 8


class SimMemory:
    """The allocator's figures of a steps row, simulated: what stays allocated, and a peak of that + bytes per
    token x the largest forward's tokens since the last row (a forward pre-hook counts them)."""

    def __init__(self) -> None:
        self.tokens = 0

    def hook(self, _module, args, kw):
        ids = kw.get("input_ids") if kw else None
        ids = ids if ids is not None else (args[0] if args else None)
        if ids is not None and getattr(ids, "dim", lambda: 0)() >= 1:
            self.tokens = max(self.tokens, int(ids.numel()))

    def read(self) -> dict:
        peak = WEIGHTS + PER_TOKEN * self.tokens
        self.tokens = 0
        return {"torch_allocated_bytes": WEIGHTS, "torch_reserved_bytes": int(peak * 1.02), "torch_peak_bytes": peak,
                "torch_inactive_split_bytes": 0}


class Phases:
    """ms per part of the guard's step, on the training thread only: wraps class or module functions."""

    NAMES: list[tuple[str, str, str]] = [  # (part, module, attribute "Class.method" or "function")
        ("record", "gpuwatch.integrations.loop", "GuardedLoop._record"),
        ("mem_read", "gpuwatch.integrations.loop", "GuardedLoop._mem"),
        ("blocks_read", "gpuwatch.workload.mechanics", "blocks"),
        ("decide", "gpuwatch.integrations.loop", "GuardedLoop.decide"),
        ("rescore_smaller", "gpuwatch.integrations.loop", "GuardedLoop._rescore_smaller_plan"),
        ("before_step", "gpuwatch.control.guard", "Guard.before_step"),
        ("rescore", "gpuwatch.predict.scorer", "LiveScorer.rescore"),
        ("estimate", "gpuwatch.predict.scorer", "LiveScorer.estimate"),
        ("window", "gpuwatch.recording.source", "LiveSource.window"),
        ("catch_up", "gpuwatch.recording.source", "LiveSource._catch_up"),
        ("plans_estimate", "gpuwatch.predict.plans", "estimate"),
        ("fit_steps", "gpuwatch.predict.plans", "fit_steps"),
        ("plans_arrays", "gpuwatch.predict.plans", "_arrays"),
        ("plans_limits", "gpuwatch.predict.plans", "limits"),
        ("plans_failed_shapes", "gpuwatch.predict.plans", "failed_shapes"),
        ("fit_at", "gpuwatch.predict.peak", "StepFit.at"),
        ("pace_step_time", "gpuwatch.control.pace", "StepTimes.step_time"),
        ("to_frame", "gpuwatch.recording.writer", "to_frame"),
        ("planner", "gpuwatch.control.planner", "Planner.decide"),
        ("still_kept", "gpuwatch.control.guard", "Guard._still_kept"),
        ("policy", "gpuwatch.control.policy", "Policy.decide"),
        ("features", "gpuwatch.predict.scorer", "features"),
        ("apply_pending", "gpuwatch.integrations.loop", "GuardedLoop._apply_pending"),
        ("next_plan", "gpuwatch.integrations.loop", "GuardedLoop.next_plan"),
        ("guard_view", "gpuwatch.integrations.loop", "GuardedLoop.guard_view"),
        ("emit", "gpuwatch.telemetry.bus", "Bus.emit"),
    ]

    def __init__(self) -> None:
        self.main = threading.get_ident()
        self.ms: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.on = True

    def install(self) -> None:
        import importlib

        for part, mod, attr in self.NAMES:
            m = importlib.import_module(mod)
            owner, name = (getattr(m, attr.split(".")[0]), attr.split(".")[1]) if "." in attr else (m, attr)
            fn = getattr(owner, name) if "." in attr else getattr(m, name)
            setattr(owner, name, self._wrap(part, fn))

    def _wrap(self, part: str, fn):
        ph = self

        def timed(*a, **kw):
            if not ph.on or threading.get_ident() != ph.main:
                return fn(*a, **kw)
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                ph.ms[part] = ph.ms.get(part, 0.0) + 1e3 * (time.perf_counter() - t)
                ph.calls[part] = ph.calls.get(part, 0) + 1
        timed.__wrapped__ = fn
        return timed


def _curriculum(steps: int):
    import torch

    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (BATCH, seq_at(i, steps)), generator=gen) for i in range(steps)]


def run_hf(record_dir: str, steps: int, profile: bool, phases: Phases | None) -> dict:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    from gpuwatch.integrations.hf import GpuwatchCallback, train
    from gpuwatch.workload import mechanics

    hf_logging.set_verbosity_error()
    data = [{"input_ids": x, "labels": x} for b in _curriculum(steps) for x in b]
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=64, vocab_size=64, n_positions=SEQ1))
    sim = SimMemory()
    model.register_forward_pre_hook(sim.hook, with_kwargs=True)
    mechanics.memory = lambda _device: sim.read()  # what GuardedLoop's steps row reads
    args = TrainingArguments(output_dir=str(Path(record_dir) / "out"), per_device_train_batch_size=BATCH, max_steps=steps,
                             learning_rate=0.1, optim="sgd", report_to=[], save_strategy="no", use_cpu=True,
                             disable_tqdm=True, include_num_input_tokens_seen=True, logging_steps=10,
                             train_sampling_strategy="sequential", lr_scheduler_type="constant")
    gw = GpuwatchCallback(record_dir=record_dir, name="hf", source=str(SOURCE), gpu_index=0, memory_limit=CAP)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[gw])
    prof = _profiled(gw, "on_step_end", profile)
    t = time.perf_counter()
    train(trainer)
    wall = time.perf_counter() - t
    return _done(gw.loop, gw.step_overhead_s, wall, prof)


def run_lightning(record_dir: str, steps: int, profile: bool, phases: Phases | None) -> dict:
    import lightning as L
    import torch

    from gpuwatch.integrations.lightning import GpuwatchLightningCallback
    from gpuwatch.workload import mechanics

    sim = SimMemory()
    mechanics.memory = lambda _device: sim.read()  # what GuardedLoop's steps row reads
    batches = _curriculum(steps)

    class DS(torch.utils.data.Dataset):  # one item a step: the step's batch, of its length
        def __len__(self):
            return steps

        def __getitem__(self, i):
            return (batches[i],)

    gw = GpuwatchLightningCallback(record_dir=record_dir, name="pl", source=str(SOURCE), gpu_index=0, memory_limit=CAP)
    gw.base_batch = BATCH
    over: list[float] = []
    orig = gw.on_train_batch_end
    in_step = [0.0, False]  # the guard's time in `gw.step` since the last step's end (its decision on the batch in
    # hand, session 49 on), and whether the step's end is running

    def end(*a, **kw):
        t0 = time.perf_counter()
        in_step[1] = True
        try:
            orig(*a, **kw)
        finally:
            in_step[1] = False
        over.append(time.perf_counter() - t0 + in_step[0])
        in_step[0] = 0.0
    gw.on_train_batch_end = end
    from gpuwatch.integrations.loop import GuardedLoop

    dec = GuardedLoop.decide  # where gw.step decides in the step too (session 49 on), that time is the guard's as well

    def decide(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return dec(self, *a, **kw)
        finally:
            if not in_step[1]:
                in_step[0] += time.perf_counter() - t0
    GuardedLoop.decide = decide
    prof = _profiled(gw, "on_train_batch_end", profile)
    dl = torch.utils.data.DataLoader(DS(), batch_size=None, collate_fn=lambda x: (x[0],))
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=record_dir, callbacks=[gw])
    t = time.perf_counter()
    def seen(ids) -> None:
        sim.tokens = max(sim.tokens, int(ids.numel()))

    trainer.fit(tiny_lm(gw, seen), train_dataloaders=dl)
    wall = time.perf_counter() - t
    return _done(gw.loop, over, wall, prof)


def _profiled(gw, hook: str, on: bool) -> cProfile.Profile | None:
    """cProfile around every call of the callback's `hook` after the first step (the guard's per-step work)."""
    if not on:
        return None
    prof = cProfile.Profile()
    fn = getattr(gw, hook)
    n = [0]

    def wrapped(*a, **kw):
        n[0] += 1
        if n[0] == 1:
            return fn(*a, **kw)
        prof.enable()
        try:
            return fn(*a, **kw)
        finally:
            prof.disable()
    setattr(gw, hook, wrapped)
    return prof


def _done(loop, over_s: list[float], wall: float, prof) -> dict:
    from gpuwatch.recording.reader import open_recording

    rec = open_recording(loop.session_dir)
    ev = rec.events
    kinds = ev["kind"].to_list()
    ms = [1e3 * x for x in over_s[1:]]  # the first step's is the start's (guard_start_cost.py)
    q = statistics.quantiles(ms, n=10) if len(ms) >= 10 else [max(ms)] * 9
    out = {"steps": rec.steps.height, "p50": statistics.median(ms), "p90": q[8], "max": max(ms),
           "total_s": sum(over_s), "wall_s": wall, "share": sum(over_s) / wall,
           "argmax_step": 1 + ms.index(max(ms)), "plans": kinds.count("guard_plan"),
           "guard_actions": kinds.count("guard_action"), "controls": kinds.count("control"),
           "micro_batches": rec.steps["micro_batches"].to_list(),
           "by_quarter_p50": [statistics.median(ms[i * len(ms) // 4:(i + 1) * len(ms) // 4]) for i in range(4)]}
    if prof is not None:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(int(os.environ.get("GW_PROFILE_N", "40")))
        out["profile"] = s.getvalue()
    return out


RUNS = {"hf": run_hf, "lightning": run_lightning}


def one(name: str, steps: int, profile: bool, phases_on: bool) -> dict:
    phases = Phases() if phases_on else None
    if phases:
        phases.install()
    with tempfile.TemporaryDirectory() as d:
        out = RUNS[name](d, steps, profile, phases)
    if phases:
        n = max(1, out["steps"])
        out["phases_ms_per_step"] = {k: round(v / n, 3) for k, v in sorted(phases.ms.items(), key=lambda kv: -kv[1])}
        out["phase_calls"] = phases.calls
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", default="hf,lightning")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--phases", action="store_true", help="mean ms per step in each part (adds the timers' own cost)")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile's N costliest functions (first repeat)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--one", choices=sorted(RUNS), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.steps, a.profile > 0, a.phases)))
        return
    pypath = os.pathsep.join([str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    out: dict[str, list[dict]] = {}
    for name in a.path.split(","):
        for r in range(a.repeats):
            cmd = [sys.executable, __file__, "--one", name, "--steps", str(a.steps)]
            cmd += ["--phases"] if a.phases else []
            cmd += ["--profile", str(a.profile)] if a.profile and r == 0 else []
            p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": pypath,
                                                                                   "GW_PROFILE_N": str(a.profile or 40)})
            if p.returncode != 0:
                sys.exit(f"{name}: {p.stderr[-3000:]}")
            out.setdefault(name, []).append(json.loads(p.stdout.strip().splitlines()[-1]))
        runs = out[name]
        cells = []
        for k in ("p50", "p90", "max"):
            v = [x[k] for x in runs]
            cells.append(f"{k} {statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})")
        sh = [100 * x["share"] for x in runs]
        print(f"{name:9s} guard ms/step, median (range) of {len(runs)}: " + "; ".join(cells)
              + f"; share of wall {statistics.median(sh):.1f}% ({min(sh):.1f}-{max(sh):.1f}); "
              f"plans {[x['plans'] + x['guard_actions'] for x in runs]}, argmax steps {[x['argmax_step'] for x in runs]}")
        if a.phases:
            keys = list(runs[0]["phases_ms_per_step"])
            print("  phases, mean ms/step (median of repeats): " + ", ".join(
                f"{k} {statistics.median(x['phases_ms_per_step'].get(k, 0.0) for x in runs):.3f}" for k in keys))
        if a.profile:
            print(runs[0]["profile"])
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
