"""Where a workload step's GPU time goes (issue 30, "measure first"): for each preset and mode, the workload
built exactly as `gpuwatch stress` builds it (workload/runner.Workload: the model, the optimizer, the decode
engine, the timed step and its FLOP count), warmed up, timed, then profiled with torch.profiler.

  python benchmarks/gpu_profile.py --preset v2-lite --preset v3-slice [--modes train,prefill,decode]
         [--variants baseline,attention=cudnn,...] [--out DIR]
  python benchmarks/gpu_profile.py --preset tiny --device cpu          (the CPU dry run the tests use)

Per (preset, mode, variant) it prints one JSON line and (re)writes DIR/profile.md after each run:
 * the timed steps (no profiler): step time median and range, TFLOP/s and MFU as the step rows compute them
   (workload/flops.step_flops over the peak of the GPU it ran on), `expert_impl` as recorded per step;
 * decode: ms per generated token (the engine's decode phase alone) and the fraction of the HBM bandwidth
   bound (bench_decode.decode_bytes: weights + touched experts + the latent cache / 4.8 TB/s);
 * power, SM clock, temperature and clock-event reasons sampled by NVML every 50 ms while timed;
 * the profiled steps: the top kernels, GPU time by category (router/topk, permutation/scatter/gather,
   expert GEMMs, dense GEMMs, attention, elementwise/norms/upcasts, optimizer, memcpy, other) and the
   idle/launch gaps (the unprofiled steps' median time - the union of the profiled step's kernel intervals),
   and the forward time by module (scopes).
Variants are `workload.tuning` switches (KEY=VALUE joined by '+'; "baseline" = none): each runs the same
shapes, so one device call tells which pay. An OOM halves the batch (down to 1) and says so.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from gpuwatch.telemetry.bus import Bus  # noqa: E402
from gpuwatch.workload import model as M  # noqa: E402
from gpuwatch.workload.presets import config_fields, defaults, parse_overrides  # noqa: E402
from gpuwatch.workload.runner import Workload, WorkloadConfig  # noqa: E402

MODES = ("train", "prefill", "decode")
# (category, pattern) in order: the first that matches a kernel's (or, on a CPU, an aten op's) name wins
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("memcpy", r"^memcpy|^memset"),
    ("optimizer", r"multi_tensor_apply|fused_adam|adamw|_foreach|fused_sgd|sgd|aten::_fused_adam"),
    ("attention", r"flash|fmha|attention|attn|cudnn|flex|cutlassf|cutlassb|fwd_kernel|bwd_kernel"),
    ("expert GEMMs (grouped_mm)", r"grouped|groupproblemshape|ptrarray|group_gemm"),
    ("router/topk", r"topk|sigmoid|gatherTopK|bitonic|_route"),
    ("permutation/scatter/gather", r"index|scatter|gather|sort|radix|histc|histogram|cumsum|scan|nonzero|"
                                   r"repeat_interleave|masked|embedding|bincount|unique|one_hot|where|searchsorted"),
    ("dense GEMMs", r"gemm|nvjet|xmma|cutlass|cublas|gemv|splitk|matmul|dot_kernel|aten::(mm|addmm|bmm|linear|baddbmm)$"),
    ("elementwise/norms/upcasts", r"elementwise|reduce|norm|softmax|silu|copy|cat|cast|rsqrt|pow|mean|triton|loss|nll|"
                                  r"fill|mul|add|unrolled|cross_entropy|sum|neg|exp|div|sub|clamp|abs|max|view_as|"
                                  r"rotary|rope|complex|polar|stack|zero|empty|split|chunk|transpose|contiguous|cos|sin"),
)
OTHER = "other"
SCOPES = ("attention", "router", "experts", "mlp", "lm_head")


def category(name: str) -> str:
    for cat, pat in CATEGORIES:
        if re.search(pat, name, re.IGNORECASE):
            return cat
    return OTHER


# -- NVML while timed --------------------------------------------------------------------------------------
class Meter:
    """Power, SM clock, temperature, clock-event reasons and utilization every 50 ms (nothing without NVML)."""

    def __init__(self, index: int | None) -> None:
        self.rows: list[tuple] = []
        self._stop = threading.Event()
        self._th: threading.Thread | None = None
        self._nv = None
        if index is None:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nv, self._h = pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:  # noqa: BLE001 - no driver: a CPU run
            self._nv = None

    def __enter__(self):
        self.rows = []
        self._stop.clear()
        if self._nv is not None:
            self._th = threading.Thread(target=self._run, daemon=True)
            self._th.start()
        return self

    def _reasons(self) -> int:
        nv = self._nv
        fn = (getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
              or getattr(nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None))
        try:
            return int(fn(self._h)) if fn else 0
        except Exception:  # noqa: BLE001 - optional: the power and clocks matter more
            return 0

    def _read(self) -> tuple:
        nv, h = self._nv, self._h
        return (nv.nvmlDeviceGetPowerUsage(h) / 1000, nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
                nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU), self._reasons(),
                nv.nvmlDeviceGetUtilizationRates(h).gpu)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.rows.append(self._read())
            except Exception:  # noqa: BLE001
                pass

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._th:
            self._th.join()

    def summary(self) -> dict:
        if not self.rows:
            return {"power_w": None, "power_max_w": None, "sm_clock_mhz": None, "sm_clock_min_mhz": None,
                    "temp_max_c": None, "clock_event_reasons": None, "gpu_util_pct": None}
        p, c, t, r, u = zip(*self.rows)
        limit = None
        try:
            limit = self._nv.nvmlDeviceGetEnforcedPowerLimit(self._h) / 1000
        except Exception:  # noqa: BLE001
            pass
        reasons = 0
        for x in r:
            reasons |= x
        return {"power_w": round(statistics.mean(p), 1), "power_max_w": round(max(p), 1), "power_limit_w": limit,
                "sm_clock_mhz": round(statistics.mean(c)), "sm_clock_min_mhz": min(c), "temp_max_c": max(t),
                "clock_event_reasons": hex(reasons), "gpu_util_pct": round(statistics.mean(u), 1), "nvml_samples": len(p)}


# -- the profile's tables ------------------------------------------------------------------------------------
def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def _scope_of(ev) -> str | None:
    while ev is not None:
        if ev.name.startswith("gw."):
            return ev.name[3:]
        ev = ev.cpu_parent
    return None


def kernel_rows(prof, cuda: bool) -> tuple[list[tuple[str, float, float]], dict[str, float]]:
    """([(name, start us, duration us)] of every kernel/memcpy (a CPU: every aten op's self time), and the
    GPU time launched inside each gw.* scope (a CPU: the scope's CPU time))."""
    events = prof.events()
    rows, scopes = [], dict.fromkeys(SCOPES, 0.0)
    for e in events:
        if e.name.startswith(("gw.", "ProfilerStep")) or getattr(e, "is_user_annotation", False):
            if not cuda and e.name.startswith("gw.") and e.device_type == torch.autograd.DeviceType.CPU:
                inner = _scope_of(e.cpu_parent)
                if inner is None:  # the outermost scope: nested ones are inside its time
                    scopes[e.name[3:]] = scopes.get(e.name[3:], 0.0) + e.cpu_time_total
            continue
        if cuda:
            if e.device_type == torch.autograd.DeviceType.CUDA:
                rows.append((e.name, e.time_range.start, e.time_range.elapsed_us()))
            elif e.kernels:
                s = _scope_of(e)
                if s is not None:
                    scopes[s] = scopes.get(s, 0.0) + sum(k.duration for k in e.kernels)
        elif e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("aten::") and e.self_cpu_time_total > 0:
            rows.append((e.name, e.time_range.start, e.self_cpu_time_total))
    return rows, scopes


def tables(rows: list[tuple[str, float, float]], scopes: dict[str, float], wall_s: float, steps: int,
           cuda: bool, top: int = 15, step_ms: float | None = None) -> dict:
    """Per step: the categories (ms and share of the step), the idle/launch gap, the top kernels. The step is
    the unprofiled steps' median (`step_ms`: the profiler's own CPU cost would widen the gaps) where given,
    else the profiled step's wall time."""
    per = {}
    for name, _, d in rows:
        key = name[:160]
        c = per.setdefault(key, [0.0, 0])
        c[0] += d
        c[1] += 1
    busy_us = _union_us([(s, s + d) for _, s, d in rows]) if cuda else sum(d for _, _, d in rows)
    prof_ms = 1e3 * wall_s / steps
    wall_ms = step_ms or prof_ms
    cats = {c: 0.0 for c, _ in CATEGORIES} | {OTHER: 0.0}
    for name, (us, _) in per.items():
        cats[category(name)] += us
    cats = {c: round(us / 1e3 / steps, 3) for c, us in cats.items()}
    kernel_ms = busy_us / 1e3 / steps
    gap = max(0.0, wall_ms - kernel_ms)
    ranked = sorted(per.items(), key=lambda kv: -kv[1][0])[:top]
    return {"wall_ms": round(wall_ms, 3), "profiled_wall_ms": round(prof_ms, 3), "kernel_ms": round(kernel_ms, 3),
            "gap_ms": round(gap, 3),
            "gap_frac": round(gap / wall_ms, 4) if wall_ms else None,
            "categories_ms": cats, "categories_frac": {c: round(v / wall_ms, 4) if wall_ms else None for c, v in cats.items()},
            "scopes_ms": {s: round(v / 1e3 / steps, 3) for s, v in scopes.items()},
            "kernels_per_step": round(sum(c for _, c in per.values()) / steps, 1),
            "top_kernels": [{"name": n, "ms": round(us / 1e3 / steps, 3), "calls": c // steps if c >= steps else c,
                             "share": round(us / 1e3 / steps / wall_ms, 4) if wall_ms else None, "category": category(n)}
                            for n, (us, c) in ranked]}


class Scopes:
    """record_function ranges around the model's modules' forwards (attention, router, experts, shared
    experts / dense MLP, lm_head) while profiling, removed after: the forward's time by module."""

    def __init__(self, model) -> None:
        self.mods = [(model.lm_head, "lm_head")]
        for layer in model.model.layers:
            self.mods.append((layer.self_attn, "attention"))
            mlp = layer.mlp
            if hasattr(mlp, "experts"):
                self.mods += [(mlp.gate, "router"), (mlp.experts, "experts"), (mlp.shared_experts, "mlp")]
            else:
                self.mods.append((mlp, "mlp"))

    def __enter__(self):
        for mod, name in self.mods:
            orig = mod.forward

            def wrapped(*a, _orig=orig, _name=name, **k):
                with torch.profiler.record_function("gw." + _name):
                    return _orig(*a, **k)
            mod.forward = wrapped
        return self

    def __exit__(self, *exc) -> None:
        for mod, _ in self.mods:
            mod.__dict__.pop("forward", None)


# -- one (preset, mode, variant) -----------------------------------------------------------------------------
def decode_phase(w: Workload, ids) -> float | None:
    """Seconds of the decode engine's token loop alone (the prompt's prefill timed apart), or None (eager)."""
    from bench_decode import eager_phases, engine_phases

    d = w.decoder
    if d is None or d.mode in (None, "eager"):
        return eager_phases(w.model, ids, w.cfg.decode_tokens, w.device)[1]
    return engine_phases(d, ids, w.device)[1]


def measure(w: Workload, batch: int, seq: int, a, cuda: bool) -> dict:
    """Warm up, time `a.steps` steps (rows as the runner makes them), then profile `a.profile_steps`."""
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    for _ in range(a.warmup):
        w.timed_step(batch, seq, "profile")
    warm_s = time.perf_counter() - t0
    with Meter(0 if cuda else None) as meter:
        rows = [w.timed_step(batch, seq, "profile") for _ in range(a.steps)]
    out = {"warmup_s": round(warm_s, 2), **step_stats(rows), **meter.summary()}
    if w.cfg.mode == "decode":
        out.update(decode_stats(w, batch, seq))
    if not a.profile_steps:
        out["profile"] = None
        return out
    acts = [ProfilerActivity.CUDA, ProfilerActivity.CPU] if cuda else [ProfilerActivity.CPU]
    scoped = a.scopes and "compile" not in parse_variant(a.variant)  # a compiled module: no wrapper around forward
    with Scopes(w.model) if scoped else _null(), profile(activities=acts) as prof:
        M.synchronize(w.device)
        t1 = time.perf_counter()
        for _ in range(a.profile_steps):
            w.timed_step(batch, seq, "profile")
        M.synchronize(w.device)
        wall = time.perf_counter() - t1
    krows, scopes = kernel_rows(prof, cuda)
    out["profile"] = tables(krows, scopes, wall, a.profile_steps, cuda, a.top, out["step_ms"] if cuda else None)
    return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def step_stats(rows: list[dict]) -> dict:
    t = [r["step_time_s"] for r in rows]
    mfu = [r["mfu"] for r in rows if r.get("mfu") is not None]
    tf = [r["tflops"] for r in rows]
    last = rows[-1]
    return {"steps": len(rows), "step_ms": round(1e3 * statistics.median(t), 3), "step_ms_min": round(1e3 * min(t), 3),
            "step_ms_max": round(1e3 * max(t), 3), "tflops": round(statistics.median(tf), 2),
            "mfu": round(statistics.median(mfu), 4) if mfu else None, "mfu_min": round(min(mfu), 4) if mfu else None,
            "mfu_max": round(max(mfu), 4) if mfu else None, "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in rows), 1),
            "expert_impl": last.get("expert_impl"), "torch_peak_gib": round(last["torch_peak_bytes"] / 2**30, 2)
            if last.get("torch_peak_bytes") else None}


def decode_stats(w: Workload, batch: int, seq: int) -> dict:
    from bench_decode import decode_bytes

    new = w.cfg.decode_tokens
    gen = torch.Generator(device=w.device).manual_seed(1)
    ids = M.random_ids(w.fields["vocab_size"], batch, seq, w.device, gen)
    ph = [decode_phase(w, ids) for _ in range(3)]
    ms = 1e3 * statistics.median(ph) / new
    bound = decode_bytes(w.fields, batch, seq + new // 2, seq + new, w.precision)
    return {"decode_ms_per_token": round(ms, 3), "bound_ms_per_token": bound["min_time_ms"],
            "bandwidth_fraction": round(bound["min_time_ms"] / ms, 4) if ms else None,
            "experts_touched": bound["experts_touched_per_moe_layer"]}


def _for_variant(a, variant: str):
    """The run's settings: a switch is timed (variant_warmup, variant_steps) and profiled only if asked."""
    b = argparse.Namespace(**vars(a))
    b.variant = variant
    if variant != "baseline":
        b.warmup, b.steps, b.profile_steps = a.variant_warmup, a.variant_steps, a.variant_profile_steps
        if "compile" in parse_variant(variant):
            b.warmup = max(b.warmup, 2)  # the compile happens in the first steps (forward, then backward)
    return b


def relevant(variant: str, mode: str, vmodes: set[str]) -> bool:
    """Whether a variant runs in `mode`: the baseline everywhere, a switch in --variant-modes, the optimizer in train only."""
    if variant == "baseline":
        return True
    return mode in vmodes and (mode == "train" or "optimizer" not in parse_variant(variant))


def plan_runs(modes: list[str], variants: list[str], vmodes: set[str], batches: Callable[[str], list[int]],
              sweep: bool = False) -> list[tuple[str, str, int | None]]:
    """(mode, variant, batch) in order: every baseline first (each mode at each of its batches), then each
    switch in the modes it belongs to, at the first batch (None: where its baseline ran) or, `sweep`, at each."""
    runs = [(m, "baseline", b) for m in modes for b in batches(m)]
    runs += [(m, v, b) for v in variants if v != "baseline" for m in modes if relevant(v, m, vmodes)
             for b in (batches(m) if sweep else [None])]
    return runs


def parse_variant(text: str) -> dict[str, str]:
    if text in ("", "baseline"):
        return {}
    out = {}
    for part in text.split("+"):
        k, sep, v = part.partition("=")
        if not sep:
            raise SystemExit(f"bad variant part {part!r}: use KEY=VALUE joined by '+'")
        out[k.strip()] = v.strip()
    return out


def run_one(model, preset: str, mode: str, variant: str, batch: int, seq: int, a, fields_over) -> dict:
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    base = {"preset": preset, "mode": mode, "variant": variant, "seq_len": seq,
            "new_tokens": a.new_tokens if mode == "decode" else 0, "precision": a.precision}
    while True:
        w = None
        try:
            cfg = WorkloadConfig(preset=preset, mode=mode, precision=a.precision, batch=batch, seq_len=seq,
                                 device=str(dev), gpu_index=0 if cuda else None, overrides=fields_over,
                                 integrity_every=0, decode_tokens=a.new_tokens, graphs=a.graphs,
                                 **({"tuning": parse_variant(variant)} if "tuning" in WorkloadConfig.__dataclass_fields__ else {}))
            w = Workload(Bus(), cfg, model=model)
            w.build()
            return {**base, "batch": batch, **measure(w, batch, seq, _for_variant(a, variant), cuda)}
        except Exception as e:  # noqa: BLE001 - an OOM halves the batch; anything else is reported
            err = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
            oom = M.is_oom(e)
        finally:
            if w is not None:
                w.tuned.revert()  # the model is reused by the next run
                if "compile" in parse_variant(variant):
                    torch._dynamo.reset()
                if w.decoder is not None:
                    w.decoder.release()
                if w.optimizer is not None:
                    w.optimizer.zero_grad(set_to_none=True)
                    w.optimizer.state.clear()
            del w
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        if not oom or batch <= 1:
            return {**base, "batch": batch, "error": err}
        print(f"# {preset} {mode} {variant}: OOM at batch {batch}, halving", file=sys.stderr, flush=True)
        base.setdefault("oom_at_batch", []).append(batch)
        batch //= 2


# -- output --------------------------------------------------------------------------------------------------
def _pct(x) -> str:
    return "" if x is None else f"{100 * x:.1f} %"


def _speedup(base: dict, r: dict) -> str:
    """The step time of the baseline at the same preset, mode and batch over this run's (x1.25 = 25 % faster)."""
    b = base.get((r["preset"], r["mode"], r["batch"]))
    return f"x{b / r['step_ms']:.2f}" if b and r["variant"] != "baseline" and r["step_ms"] else ""


def markdown(results: list[dict], header: str) -> str:
    lines = [f"# gpu_profile: {header}", "",
             "| preset | mode | variant | batch | step ms (min-max) | TFLOP/s | MFU | decode ms/token (bound) | "
             "power W (max) | SM MHz (min) | vs baseline | expert_impl |", "|" + "---|" * 12]
    base = {(r["preset"], r["mode"], r["batch"]): r["step_ms"] for r in results
            if r["variant"] == "baseline" and "error" not in r}
    for r in results:
        if "error" in r:
            lines.append(f"| {r['preset']} | {r['mode']} | {r['variant']} | {r['batch']} | error: {r['error'][:120]} "
                         "| | | | | | | |")
            continue
        dec = (f"{r['decode_ms_per_token']} ({r['bound_ms_per_token']}: {_pct(r['bandwidth_fraction'])})"
               if "decode_ms_per_token" in r else "")
        lines.append(f"| {r['preset']} | {r['mode']} | {r['variant']} | {r['batch']} | {r['step_ms']} "
                     f"({r['step_ms_min']}-{r['step_ms_max']}) | {r['tflops']} | {_pct(r['mfu'])} | {dec} | "
                     f"{r['power_w'] or ''} ({r['power_max_w'] or ''}) | {r['sm_clock_mhz'] or ''} "
                     f"({r['sm_clock_min_mhz'] or ''}) | {_speedup(base, r)} | {r['expert_impl']} |")
    for r in results:
        if "error" in r or not r.get("profile"):
            continue
        p = r["profile"]
        lines += ["", f"## {r['preset']} {r['mode']} {r['variant']} (batch {r['batch']} x {r['seq_len']}"
                  + (f" + {r['new_tokens']} tokens" if r["new_tokens"] else "") + ")", "",
                  f"step {p['wall_ms']} ms (median unprofiled; {p['profiled_wall_ms']} ms under the profiler), kernels "
                  f"{p['kernel_ms']} ms, idle/launch gaps {p['gap_ms']} ms ({_pct(p['gap_frac'])}), "
                  f"{p['kernels_per_step']} kernels a step", "",
                  "| category | ms/step | share of the step |", "|---|---|---|"]
        for c, ms in sorted(p["categories_ms"].items(), key=lambda kv: -kv[1]):
            lines.append(f"| {c} | {ms} | {_pct(p['categories_frac'][c])} |")
        lines.append(f"| idle/launch gaps | {p['gap_ms']} | {_pct(p['gap_frac'])} |")
        if any(p["scopes_ms"].values()):
            lines += ["", "forward by module (ms/step): " + ", ".join(f"{k} {v}" for k, v in p["scopes_ms"].items())]
        lines += ["", "| kernel | ms/step | calls | share | category |", "|---|---|---|---|---|"]
        for k in p["top_kernels"]:
            name = k["name"].replace("|", "/")[:110]
            lines.append(f"| `{name}` | {k['ms']} | {k['calls']} | {_pct(k['share'])} | {k['category']} |")
    return "\n".join(lines) + "\n"


def _batches(spec: list[str]) -> dict[str, list[int]]:
    """`["prefill=16", "prefill=64", "decode=32"]` -> {"prefill": [16, 64], "decode": [32]} (the baseline runs
    at each; the switches at the first, or where its baseline ran after an OOM)."""
    out: dict[str, list[int]] = {}
    for item in spec:
        m, _, b = item.partition("=")
        if m not in MODES or not b.isdigit() or int(b) < 1:
            raise SystemExit(f"bad --batch {item!r}: use MODE=N, e.g. decode=32")
        out.setdefault(m, []).append(int(b))
    return out


def args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", action="append", help="repeatable (default: v2-lite and v3-slice)")
    ap.add_argument("--modes", default="train,prefill,decode")
    ap.add_argument("--variants", default="baseline", help="comma-separated; each KEY=VALUE+KEY=VALUE or baseline")
    ap.add_argument("--variant-modes", default="train,prefill", help="modes the non-baseline variants run in")
    ap.add_argument("--batch", action="append", default=[], help="MODE=N, repeatable: a batch sweep (default: the "
                    "preset's batch; decode 32)")
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None, help="decode (default 128 on a GPU, 8 on a CPU)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--profile-steps", type=int, default=1)
    ap.add_argument("--variant-warmup", type=int, default=1)
    ap.add_argument("--variant-steps", type=int, default=2)
    ap.add_argument("--variant-profile-steps", type=int, default=0, help="profile the switches too (default: timed only)")
    ap.add_argument("--sweep-variants", action="store_true", help="run the switches at every --batch too")
    ap.add_argument("--preset-budget-s", type=float, default=None, help="start no run of a preset after this many "
                    "seconds of it")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--precision", default=None)
    ap.add_argument("--graphs", default="auto")
    ap.add_argument("--set", action="append", default=[], help="a config override, KEY=VALUE (repeatable)")
    ap.add_argument("--no-scopes", dest="scopes", action="store_false")
    ap.add_argument("--budget-s", type=float, default=None, help="start no run after this many seconds")
    ap.add_argument("--out", type=Path, default=None, help="profile.md and profile.jsonl go here")
    a = ap.parse_args(argv)
    a.device = str(M.resolve_device(a.device))
    cuda = a.device.startswith("cuda")
    a.precision = a.precision or ("bf16" if cuda else "fp32")
    a.new_tokens = a.new_tokens or (128 if cuda else 8)
    a.preset = a.preset or ["v2-lite", "v3-slice"]
    return a


def main(argv=None) -> list[dict]:
    a = args(argv)
    t_start = time.monotonic()
    over = parse_overrides(a.set)
    batches = _batches(a.batch)
    modes = [m for m in a.modes.split(",") if m]
    variants = [v for v in a.variants.split(",") if v] or ["baseline"]
    vmodes = set(a.variant_modes.split(","))
    dev = torch.device(a.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    header = (f"{name}, torch {torch.__version__}, {a.precision}, warm-up {a.warmup}, {a.steps} timed steps, "
              f"{a.profile_steps} profiled")
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    for preset in a.preset:
        if a.budget_s and time.monotonic() - t_start > a.budget_s:
            print(f"# budget spent: {preset} not run", file=sys.stderr, flush=True)
            continue
        t_preset = time.monotonic()
        b0, s0 = defaults(preset)
        seq = a.seq_len or s0
        model, build_s = M.build_model(config_fields(preset, over), dev, a.precision)
        print(f"# {preset} built in {build_s:.1f} s", file=sys.stderr, flush=True)
        ok_batch: dict[str, int] = {}

        def default(m: str, b0: int = b0) -> list[int]:
            return batches.get(m) or [32 if m == "decode" and dev.type == "cuda" else b0]
        for mode, variant, batch in plan_runs(modes, variants, vmodes, default, a.sweep_variants):
            if (a.budget_s and time.monotonic() - t_start > a.budget_s
                    or a.preset_budget_s and time.monotonic() - t_preset > a.preset_budget_s):
                print(f"# budget spent: {preset} {mode} {variant} not run", file=sys.stderr, flush=True)
                continue
            batch = batch or ok_batch.get(mode) or default(mode)[0]
            t0 = time.monotonic()
            r = run_one(model, preset, mode, variant, batch, seq, a, over)
            r["run_s"] = round(time.monotonic() - t0, 1)
            if variant == "baseline" and "error" not in r:
                ok_batch.setdefault(mode, r["batch"])  # the switches run where the baseline ran (after an OOM: its batch)
            results.append(r)
            print(json.dumps(r), flush=True)
            if a.out:
                (a.out / "profile.md").write_text(markdown(results, header))
                with (a.out / "profile.jsonl").open("a") as f:
                    f.write(json.dumps(r) + "\n")
        del model
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return results


if __name__ == "__main__":
    main()
