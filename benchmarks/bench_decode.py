"""Decode and small-batch prefill: eager (today's step_decode/step_prefill) vs DecodeEngine (static KV
cache + CUDA graphs), issue #10.

  python benchmarks/bench_decode.py [--preset v2-lite] [--precision bf16] [--out decode.json]

For each case (v2-lite decode at batch 32, prompt 512, 16 new tokens; prefill at batch 1, 4, 8) and each
arm it reports: tokens/s of the whole step (what the runner records: batch x new tokens / step time, the
prefill of the prompt included), the decode phase alone (ms per one-token step, its tokens/s), GPU
utilization and power (NVML, sampled every 50 ms in a thread during the timed region), this process's
CPU % of one core, compile/capture seconds; and for decode the memory-bandwidth bound of one token step
(bytes it must read / 4.8 TB/s) and the fraction of it reached. Prints a table and writes JSON.
On a CPU (dry run: --preset tiny --device cpu) the fast arm falls back to eager and says so; NVML
columns are null.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
import torch  # noqa: E402

from gpuwatch.workload import model as M  # noqa: E402
from gpuwatch.workload.presets import config_fields  # noqa: E402

HBM_BYTES_PER_S = 4.8e12  # H200 HBM3e
BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "tf32": 4}


class GpuMeter:
    """NVML utilization and power sampled every 50 ms while running (None without NVML)."""

    def __init__(self, index: int) -> None:
        self.util: list[int] = []
        self.power: list[float] = []
        self._stop = threading.Event()
        self._th: threading.Thread | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nv, self._h = pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:  # noqa: BLE001 - no driver here: a CPU dry run
            self._nv = None

    def __enter__(self):
        self.util, self.power = [], []
        self._stop.clear()
        if self._nv is not None:
            self._th = threading.Thread(target=self._run, daemon=True)
            self._th.start()
        self._c0, self._t0 = sum(psutil.Process().cpu_times()[:2]), time.monotonic()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.util.append(self._nv.nvmlDeviceGetUtilizationRates(self._h).gpu)
                self.power.append(self._nv.nvmlDeviceGetPowerUsage(self._h) / 1000)
            except Exception:  # noqa: BLE001
                pass

    def __exit__(self, *exc) -> None:
        self.cpu_pct = 100 * (sum(psutil.Process().cpu_times()[:2]) - self._c0) / (time.monotonic() - self._t0)
        self._stop.set()
        if self._th:
            self._th.join()

    def summary(self) -> dict:
        # NVML's utilization is averaged over its own window (1/6 s to 1 s): drop the first 1 s of samples
        u = self.util[20:] or self.util
        return {"gpu_util_pct": round(statistics.mean(u), 1) if u else None,
                "gpu_util_p10_pct": round(sorted(u)[len(u) // 10], 1) if u else None,
                "power_w": round(statistics.mean(self.power), 1) if self.power else None,
                "power_max_w": round(max(self.power), 1) if self.power else None,
                "proc_cpu_pct": round(self.cpu_pct, 1)}


def decode_bytes(c: dict, batch: int, context: int, max_len: int, precision: str) -> dict:
    """Bytes one one-token decode step must read from HBM at least, and what transformers' MLA moves."""
    from gpuwatch.workload.flops import _attn_params, _layer_counts

    b = BYTES[precision]
    h, layers = c["hidden_size"], c["num_hidden_layers"]
    dense, moe = _layer_counts(c)
    n, k = c["n_routed_experts"], c["num_experts_per_tok"]
    expert = 3 * h * c["moe_intermediate_size"]
    # with top-k of n experts for each of `batch` tokens, an expert is untouched with probability
    # (1 - k/n)^batch (uniform routing): at 64 experts, top-6, batch 32, ~61 of 64 are read
    touched = n * (1 - (1 - k / n) ** batch)
    weights = (layers * _attn_params(c) + dense * 3 * h * c["intermediate_size"]
               + moe * ((touched + c["n_shared_experts"]) * expert) + c["vocab_size"] * h) * b
    router = moe * n * h * 4  # fp32 router weights
    latent = c["kv_lora_rank"] + c["qk_rope_head_dim"]
    kv_min = layers * batch * context * latent * b  # the latent cache of the tokens seen so far
    heads = c["num_attention_heads"]
    expanded = layers * batch * heads * max_len * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"] + c["v_head_dim"]) * b
    # transformers expands the whole static cache into per-head K and V every step: read latent + write
    # and read back the expanded K/V (and the logits: batch x vocab fp32, small)
    impl = weights + router + layers * batch * max_len * latent * b + 2 * expanded
    # fastpath with dense experts reads every expert, and the latent cache over its static length, twice
    dense_all = (weights + moe * (n - touched) * expert * b + router + 2 * layers * batch * max_len * latent * b)
    return {"experts_touched_per_moe_layer": round(touched, 1), "weight_bytes": int(weights + router),
            "kv_latent_bytes": int(kv_min), "min_bytes": int(weights + router + kv_min),
            "min_time_ms": round(1e3 * (weights + router + kv_min) / HBM_BYTES_PER_S, 3),
            "transformers_mla_bytes": int(impl),
            "transformers_mla_time_ms": round(1e3 * impl / HBM_BYTES_PER_S, 3),
            "fast_dense_bytes": int(dense_all), "fast_dense_time_ms": round(1e3 * dense_all / HBM_BYTES_PER_S, 3)}


def sync(dev) -> None:
    M.synchronize(dev)


def eager_phases(model, ids, new_tokens, dev) -> tuple[float, float]:
    """step_decode's work with a sync between the prompt and the tokens: (prefill s, decode s)."""
    kw = M._cache_kw(model)
    with torch.inference_mode():
        sync(dev)
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        sync(dev)
        t1 = time.perf_counter()
        for _ in range(new_tokens):
            past = getattr(out, "cache", None) or out.past_key_values
            out = model(input_ids=out.logits[:, -1:].argmax(-1), use_cache=True, **{kw: past})
        out.logits.float().abs().max().item()
        return t1 - t0, time.perf_counter() - t1


def eager_tokens(model, ids, new_tokens):
    """step_decode's loop, keeping each argmax: (tokens (batch, new), max |logit| of the last step)."""
    toks, last = M.decode_eager(model, ids, new_tokens, keep_tokens=True)
    return toks, last.abs().max().item()


def engine_phases(eng, ids, dev) -> tuple[float, float]:
    st = eng._st
    with torch.inference_mode():
        eng._reset()
        st["ids"].copy_(ids)
        sync(dev)
        t0 = time.perf_counter()
        st["g_prefill"].replay() if st.get("g_prefill") is not None else eng._prefill_body()
        sync(dev)
        t1 = time.perf_counter()
        g = st.get("g_decode")
        for _ in range(eng.new_tokens):
            g.replay() if g is not None else eng._decode_body()
        st["logits"].abs().max().item()
        return t1 - t0, time.perf_counter() - t1


# arms: eager = step_decode/step_prefill (transformers, dynamic cache, no graphs: the baseline);
# hf = DecodeEngine over transformers' forward and StaticCache with CUDA graphs (call 5's "graphs" arm);
# fast = DecodeEngine with fastpath.FastDeepseek (absorbed MLA, experts chosen by `auto`), graphs;
# fast-dense / fast-module = the same with the experts implementation forced; fast-nocompile = fast without
# torch.compile of the one-token step (call 11's fast arm); fast-unfused = fast with torch ops only (no
# Triton kernels: calls 13-14's fast arm).
ARMS = ("eager", "hf", "fast", "fast-nocompile", "fast-dense", "fast-module", "fast-unfused")


def run_arm(arm: str, model, fields, batch, prompt, new, dev, seconds, meter, events, graphs, min_steps=3,
            phase_reps=3) -> dict:
    gen = torch.Generator(device=dev).manual_seed(0)
    ids = M.random_ids(fields["vocab_size"], batch, prompt, dev, gen)
    res: dict = {"arm": arm, "batch": batch, "prompt_len": prompt, "new_tokens": new}
    if arm == "eager":
        step = (lambda: M.step_decode(model, ids, new)) if new else (lambda: M.step_prefill(model, ids))
        res["mode"], res["compile_s"] = "eager", 0.0
    else:
        moe = {"fast-dense": "dense", "fast-module": "module"}.get(arm, "auto")
        eng = M.DecodeEngine(model, batch, prompt, new, dev, lambda k, m, **d: events.append(m), graphs=graphs,
                             fast=arm != "hf", moe=moe, compile=False if arm in ("hf", "fast-nocompile") else None,
                             fused=False if arm == "fast-unfused" else None)
        eng.prepare(batch, prompt)
        res["mode"], res["compile_s"], res["impl"] = eng.mode, round(eng.compile_s, 2), eng.impl
        res["detail"] = {k: v for k, v in eng.detail.items() if k in ("attention", "experts", "compiled",
                                                                      "torch_compile_s", "kernels")}
        step = lambda: eng.step(ids)  # noqa: E731
    step()  # warm-up (and, for eager, the allocator's first touch)
    sync(dev)
    times = []
    with meter:
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end or len(times) < min_steps:
            t0 = time.perf_counter()
            step()
            sync(dev)
            times.append(time.perf_counter() - t0)
    st = statistics.median(times)
    tokens = batch * (new if new else prompt)
    res.update(steps=len(times), step_s=round(st, 5), tokens_per_s=round(tokens / st, 1), **meter.summary())
    if new and arm != "eager" and res["mode"] != "eager":  # the engine must decode what eager decodes
        eng.record_tokens = True
        _, fast_max = eng.step(ids)
        ref_tokens, ref_max = eager_tokens(model, ids, new)
        res["check"] = {"tokens_agree_frac": round((eng.tokens == ref_tokens).float().mean().item(), 4),
                        "max_abs_logit_fast": round(fast_max, 4), "max_abs_logit_eager": round(ref_max, 4)}
        eng.record_tokens = False
    if new:  # the decode phase alone, timed apart from the prompt
        ph = [eager_phases(model, ids, new, dev) if arm == "eager" or res["mode"] == "eager"
              else engine_phases(eng, ids, dev) for _ in range(phase_reps)]
        pre, dec = statistics.median(p[0] for p in ph), statistics.median(p[1] for p in ph)
        res.update(prefill_s=round(pre, 5), decode_ms_per_token=round(1e3 * dec / new, 3),
                   decode_tokens_per_s=round(batch * new / dec, 1))
    return res


def kernel_profile(model, fields, batch, prompt, dev, moe="auto", fast=True, compile=False, top=18, new=8,
                   fused=None) -> dict:
    """Where one decode token's GPU time goes: the one-token body run eagerly (same kernels as the graph)
    under torch.profiler, CUDA time summed by kernel name."""
    from torch.profiler import ProfilerActivity, profile

    eng = M.DecodeEngine(model, batch, prompt, new, dev, graphs=False, fast=fast, moe=moe, compile=compile,
                         fused=fused)
    gen = torch.Generator(device=dev).manual_seed(0)
    ids = M.random_ids(fields["vocab_size"], batch, prompt, dev, gen)
    eng.step(ids)
    with torch.inference_mode():
        eng._reset()
        eng._st["ids"].copy_(ids)
        eng._prefill_body()
        eng._decode_body()
        sync(dev)
        cuda = dev.type == "cuda"
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            for _ in range(4):
                eng._decode_body()
            sync(dev)
    rows = []
    for e in prof.key_averages():
        t = ((getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)) if cuda
             else e.self_cpu_time_total)
        if t and e.key and not e.key.startswith("ProfilerStep"):
            rows.append((e.key[:90], t / 4, e.count // 4))
    rows.sort(key=lambda r: -r[1])
    kernels = [r for r in rows if not r[0].startswith(("cuda", "Memcpy", "Memset"))] if cuda else rows
    total = sum(r[1] for r in kernels)
    return {"impl": eng.impl, "moe": (eng._st.get("fast").moe if eng._st.get("fast") is not None else None),
            "kernels": eng.detail.get("kernels"),
            "gpu_us_per_token": round(total, 1), "kernels_per_token": sum(r[2] for r in kernels),
            "top": [{"kernel": k, "us": round(t, 1), "share": round(t / total, 3), "calls": c} for k, t, c in kernels[:top]]}


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="v2-lite")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--decode", default="32x512+16", help="BATCHxPROMPT+NEW[,...]")
    ap.add_argument("--prefill", default="1x512,4x512,8x512", help="BATCHxPROMPT[,...] ('' for none)")
    ap.add_argument("--late", default="", help="BATCHxPROMPT+NEW[,...] decode cases run after the prefill ones")
    ap.add_argument("--seconds", type=float, default=6.0, help="timed region per arm")
    ap.add_argument("--budget", type=float, default=200.0, help="skip cases that would start after this (s)")
    ap.add_argument("--graphs", type=int, default=None, help="0: fast arm = static cache without graphs")
    ap.add_argument("--arms", default="eager,hf,fast", help=f"comma list of {ARMS}")
    ap.add_argument("--eager-reps", type=int, default=3, help="min timed steps and phase reps of the eager arm")
    ap.add_argument("--profile", default="", help="BATCHxPROMPT[+NEW]: per-kernel profile of one decode token")
    ap.add_argument("--profile-arms", default="transformers,fast-dense,fast-module,fast-compiled")
    ap.add_argument("--out", type=Path)
    return ap.parse_args()


def _cases(a) -> list[tuple[int, int, int]]:
    """(batch, prompt, new tokens) of every case, in order: --decode, --prefill (new = 0), --late."""
    cases = []
    for spec in filter(None, a.decode.split(",")):
        bp, new = spec.split("+")
        b, p = map(int, bp.split("x"))
        cases.append((b, p, int(new)))
    for spec in filter(None, a.prefill.split(",")):
        b, p = map(int, spec.split("x"))
        cases.append((b, p, 0))
    for spec in filter(None, a.late.split(",")):
        bp, new = spec.split("+")
        b, p = map(int, bp.split("x"))
        cases.append((b, p, int(new)))
    return cases


def _case(a, model, fields, dev, meter, events: list, b: int, p: int, new: int) -> dict:
    """One case: every arm, then the speed-ups against eager and the fraction of the bandwidth bound."""
    case = {"kind": "decode" if new else "prefill", "batch": b, "prompt_len": p, "new_tokens": new}
    if new:
        case["bandwidth"] = decode_bytes(fields, b, p + new // 2, p + new, a.precision)
    for arm in a.arms.split(","):
        if arm not in ARMS:
            raise SystemExit(f"unknown arm {arm!r}")
        reps = a.eager_reps if arm == "eager" else 3
        try:
            case[arm] = run_arm(arm, model, fields, b, p, new, dev, a.seconds, meter, events,
                                None if a.graphs is None else bool(a.graphs), min_steps=reps, phase_reps=reps)
        except Exception as e:  # noqa: BLE001 - report and go on to the next arm/case
            case[arm] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            if M.is_oom(e) and dev.type == "cuda":
                torch.cuda.empty_cache()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    e = case.get("eager", {})
    for arm in ARMS[1:]:
        f = case.get(arm, {})
        if "tokens_per_s" in e and "tokens_per_s" in f:
            case.setdefault("speedup_step", {})[arm] = round(f["tokens_per_s"] / e["tokens_per_s"], 2)
            if new:
                case.setdefault("speedup_decode_phase", {})[arm] = round(
                    f["decode_tokens_per_s"] / e["decode_tokens_per_s"], 2)
    if new:
        for arm in ARMS:
            if "decode_ms_per_token" in case.get(arm, {}):
                case[arm]["bandwidth_fraction"] = round(
                    case["bandwidth"]["min_time_ms"] / case[arm]["decode_ms_per_token"], 3)
    return case


def _profiles(a, model, fields, dev) -> dict:
    """--profile: the per-kernel profile of one decode token for each of --profile-arms, printed too."""
    bp, _, pn = a.profile.partition("+")
    b, p = map(int, bp.split("x"))
    prof = {}
    kinds = {"transformers": {"fast": False}, "fast-dense": {"moe": "dense"}, "fast-module": {"moe": "module"},
             "fast-compiled": {"moe": "dense", "compile": True}, "fast-unfused": {"moe": "dense", "fused": False}}
    for name in a.profile_arms.split(","):
        kw = kinds[name]
        try:
            prof[name] = kernel_profile(model, fields, b, p, dev, new=int(pn or 8), **kw)
        except Exception as e:  # noqa: BLE001
            prof[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    for name, pr in prof.items():
        print(f"-- profile {name} {a.profile}: {pr.get('gpu_us_per_token')} us GPU per token, "
              f"{pr.get('kernels_per_token')} kernels", file=sys.stderr)
        for k in pr.get("top", [])[:10]:
            print(f"   {k['us']:>9.1f} us {100 * k['share']:5.1f} % x{k['calls']:<4} {k['kernel']}", file=sys.stderr)
    return prof


def main() -> None:
    a = _args()
    t_start = time.monotonic()
    dev = M.resolve_device(a.device)
    fields = config_fields(a.preset)
    model, build_s = M.build_model(fields, dev, a.precision)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    result = {"preset": a.preset, "precision": a.precision, "device": name, "build_s": round(build_s, 2),
              "torch": torch.__version__, "experts_impl": getattr(model.config, "_experts_implementation", None),
              "cases": [], "events": [], "skipped": []}
    try:
        import transformers

        result["transformers"] = transformers.__version__
    except ImportError:
        pass
    meter = GpuMeter((dev.index or 0) if dev.type == "cuda" else 0)

    def save() -> None:
        result["elapsed_s"] = round(time.monotonic() - t_start, 1)
        if a.out:
            a.out.write_text(json.dumps(result, indent=1))

    for b, p, new in _cases(a):
        if time.monotonic() - t_start > a.budget:
            result["skipped"].append(f"{b}x{p}+{new}: over the {a.budget:.0f} s budget")
            continue
        result["cases"].append(_case(a, model, fields, dev, meter, result["events"], b, p, new))
        save()
    if a.profile:
        result["profile"] = _profiles(a, model, fields, dev)
        save()
    print(table(result), file=sys.stderr)
    save()
    print(json.dumps(result, indent=1))


def table(r: dict) -> str:
    head = f"{r['preset']} {r['precision']} on {r['device']} (build {r['build_s']} s, experts: {r['experts_impl']})"
    cols = ("case", "arm", "mode", "tok/s step", "dec ms/tok", "dec tok/s", "GPU %", "W", "CPU %", "compile s", "BW frac")
    rows = [cols]
    for c in r["cases"]:
        label = f"{c['kind']} {c['batch']}x{c['prompt_len']}" + (f"+{c['new_tokens']}" if c["new_tokens"] else "")
        for arm in ARMS:
            if arm not in c:
                continue
            x = c.get(arm, {})
            if "error" in x:
                rows.append((label, arm, "ERROR " + x["error"][:60], "", "", "", "", "", "", "", ""))
                continue
            rows.append((label, arm, x.get("mode"), x.get("tokens_per_s"), x.get("decode_ms_per_token", ""),
                         x.get("decode_tokens_per_s", ""), x.get("gpu_util_pct"), x.get("power_w"),
                         x.get("proc_cpu_pct"), x.get("compile_s"), x.get("bandwidth_fraction", "")))
        extra = f"speedup step vs eager {c.get('speedup_step')}"
        if c["new_tokens"]:
            bw = c["bandwidth"]
            extra += (f", decode phase {c.get('speedup_decode_phase')}; bound {bw['min_time_ms']} ms/token "
                      f"({bw['experts_touched_per_moe_layer']} experts/layer touched; transformers' MLA moves "
                      f"{bw['transformers_mla_bytes'] / 1e9:.1f} GB = {bw['transformers_mla_time_ms']} ms)")
        rows.append((extra,))
    w = [max(len(str(r_[i])) for r_ in rows if len(r_) > 1) for i in range(len(cols))]
    out = [head]
    for r_ in rows:
        out.append("  " + r_[0] if len(r_) == 1 else "  ".join(str(v).ljust(w[i]) for i, v in enumerate(r_)))
    return "\n".join(out)


if __name__ == "__main__":
    main()
