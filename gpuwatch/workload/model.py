"""Building the DeepSeek model from a config (random weights, no download) and running one step of
each mode. torch and transformers are imported here only."""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
from typing import Any, Callable

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from gpuwatch.workload import mechanics
from gpuwatch.workload.graphs import BuildCache, free, side_stream

DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(spec: str = "auto") -> torch.device:
    from gpuwatch.errors import UsageError

    if spec == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(spec)
    except RuntimeError:
        raise UsageError(f"bad --device {spec!r}: use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {spec}: no CUDA GPU is available to torch here")
        if (dev.index or 0) >= torch.cuda.device_count():
            raise UsageError(f"--device {spec}: only {torch.cuda.device_count()} GPU(s)")
        if dev.index is None:
            dev = torch.device("cuda:0")
    return dev


def apply_precision(model: torch.nn.Module, precision: str) -> None:
    """Cast the weights (fp32/tf32 keep fp32 weights; tf32 lets matmuls use TF32 tensor cores)."""
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.allow_tf32 = precision == "tf32"
    model.to(DTYPES[precision])


class BuildCancelled(Exception):
    """`build_model`'s `cancelled()` said stop while the model was being built."""


@contextlib.contextmanager
def _cancellable(cancelled: Callable[[], bool] | None):
    """While this thread builds, every parameter it registers asks `cancelled()` and ends the build there
    (a large preset takes tens of seconds, and a stop at --duration used to wait for all of it). A torch-wide
    registration hook that acts on this thread only."""
    if cancelled is None:
        yield
        return
    me = threading.get_ident()

    def check(_module, _name, _param):
        if threading.get_ident() == me and cancelled():
            raise BuildCancelled("stopped during the build")

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(check)
    try:
        yield
    finally:
        handle.remove()


def build_model(fields: dict[str, Any], device: torch.device, precision: str, seed: int = 0,
                cancelled: Callable[[], bool] | None = None):
    """DeepseekV3ForCausalLM with random weights, built directly on `device` in the target dtype. Raises
    BuildCancelled as soon as `cancelled()` is true (checked at every parameter the build registers)."""
    torch.manual_seed(seed)
    config = DeepseekV3Config(**fields)
    t0 = time.perf_counter()
    old = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[precision])
    try:
        with torch.device(device), _cancellable(cancelled):
            model = DeepseekV3ForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    apply_precision(model, precision)
    model.eval()
    return model, time.perf_counter() - t0


def random_ids(vocab: int, batch: int, seq: int, device: torch.device, gen: torch.Generator | None = None):
    return torch.randint(0, vocab, (batch, seq), device=device, generator=gen)


class LossScaler:
    """Dynamic loss scaling for fp16 training (halve on overflow and skip the step; double after
    `growth_interval` good steps). Works on fp16 weights, which torch's GradScaler refuses to unscale."""

    def __init__(self, scale: float = 2.0**14, growth_interval: int = 200) -> None:
        self.scale, self.growth_interval, self._good = scale, growth_interval, 0

    def unscale_and_check(self, params: list[torch.nn.Parameter]) -> bool:
        grads = [p.grad for p in params if p.grad is not None]
        finite = all(bool(torch.isfinite(g).all()) for g in grads)
        if not finite:
            self.scale /= 2
            self._good = 0
            return False
        torch._foreach_mul_(grads, 1.0 / self.scale)
        self._good += 1
        if self._good % self.growth_interval == 0:
            self.scale *= 2
        return True


def step_prefill(model, ids):
    with torch.inference_mode():
        out = model(input_ids=ids, logits_to_keep=1, use_cache=False)
        return None, out.logits.float().abs().max().item()


def _cache_kw(model) -> str:
    """transformers renamed `past_key_values` to `cache` (5.2x); accept both."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def decode_eager(model, ids, new_tokens: int, keep_tokens: bool = False):
    """Prefill the prompt with transformers' dynamic KV cache, then generate `new_tokens` greedily.
    Returns (the generated tokens (batch, new) if `keep_tokens` else None, the last logits (batch, vocab)).
    The reference the fast decode path is checked against (tests, bench_decode)."""
    kw = _cache_kw(model)
    toks = []
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        for _ in range(new_tokens):
            past = getattr(out, "cache", None) or out.past_key_values
            nxt = out.logits[:, -1:].argmax(-1)
            out = model(input_ids=nxt, use_cache=True, **{kw: past})
            if keep_tokens:
                toks.append(out.logits[:, -1].argmax(-1))
        return (torch.stack(toks, 1) if keep_tokens and toks else None), out.logits[:, -1].float()


def step_decode(model, ids, new_tokens: int):
    """Prefill the prompt with a KV cache, then generate `new_tokens` tokens greedily."""
    _, last = decode_eager(model, ids, new_tokens)
    return None, last.abs().max().item()


def _max_abs_logit(logits, lean: bool) -> float:
    """max |logit|; `lean` (workload/tuning.py) without the fp32 copy of all the logits (the same value)."""
    if lean:
        from gpuwatch.workload.tuning import max_abs

        return max_abs(logits)
    return logits.detach().float().abs().max().item()


def step_train(model, ids, optimizer, scaler: LossScaler | None, lean: bool = False):
    """Forward + backward + optimizer step. Returns (loss, max |logit|); a non-finite loss skips the update."""
    model.train()
    try:
        out = model(input_ids=ids, labels=ids, use_cache=False)
        loss = out.loss
        max_logit = _max_abs_logit(out.logits, lean)
        del out
        value = loss.item()
        if not torch.isfinite(loss):
            return value, max_logit
        (loss * scaler.scale if scaler else loss).backward()
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if scaler is None or scaler.unscale_and_check(params):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return value, max_logit
    finally:
        model.eval()


def step_train_accumulated(model, chunks, optimizer, scaler, lean: bool = False) -> tuple[float, float]:
    """One optimizer step over micro-batches: each micro-batch's loss / k is backpropagated, the
    gradients add up, one update at the end (the same update as the whole batch, up to rounding)."""
    model.train()
    try:
        k = len(chunks)
        losses, max_logit = [], 0.0
        for ids in chunks:
            out = model(input_ids=ids, labels=ids, use_cache=False)
            loss = out.loss
            max_logit = max(max_logit, _max_abs_logit(out.logits, lean))
            del out
            losses.append(loss.item())
            if not torch.isfinite(loss):
                optimizer.zero_grad(set_to_none=True)
                return losses[-1], max_logit
            ((loss / k) * (scaler.scale if scaler else 1.0)).backward()
            del loss
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if scaler is None or scaler.unscale_and_check(params):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return sum(losses) / k, max_logit
    finally:
        model.eval()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


is_oom = mechanics.is_oom  # the one OOM check (workload/mechanics.py); kept under this name for the model's callers


# -- fast decode: gpuwatch's own step over the model's modules, captured as CUDA graphs ---------------------
#
# Eager decode (step_decode) launches every kernel of every layer from Python for each token, and
# transformers' MLA re-expands the whole latent cache every token: on the H200 v2-lite at batch 32 ran at
# 50-64 % GPU utilization with the process at 100 % of a core. DecodeEngine builds fastpath.FastDeepseek
# (a latent KV cache sized for prompt + new tokens, absorbed attention, dense experts; the position is a
# device tensor, so nothing needs a host value) and captures the one-token step - forward, greedy argmax,
# write of the next input - as one CUDA graph, so a token costs one graph launch. Small prefills
# (<= `prefill_graph_tokens` tokens, the launch-bound regime) are captured too. What cannot be built falls
# back - the fast step without graphs, transformers' forward over a StaticCache, then eager - and says so.


def _static_cache(model, max_len: int):
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=max_len)


def _forward(model, ids, cache, **kw):
    return model(input_ids=ids, use_cache=True, **{_cache_kw(model): cache}, **kw)


class DecodeEngine:
    """Decode (prompt + `new_tokens` greedy tokens) or, with new_tokens=0, prefill, the fast way.

    `step(ids)` returns (None, max |logit| of the last token's logits), like step_decode/step_prefill.
    `prepare(batch, prompt_len)` (called by step) (re)builds the cache and (re)captures the graphs when the
    batch, prompt length, weights' dtype or storage changed; its seconds are in `compile_s` (0.0 when
    nothing had to be done), so a caller can keep them out of a step's time. `mode` says how it runs:
    "graphs" (CUDA graphs), "static" (the same step launched op by op: `graphs=False`, or a capture that
    failed) or "eager" (step_decode/step_prefill: a CPU by default, or nothing else could be built); `impl`
    says what: "fast" (fastpath.FastDeepseek) or "transformers" (its forward over a StaticCache: `fast=False`
    or a model layout the fast path does not know). `moe`: the fast step's experts ("auto", "dense",
    "module"); `compile`: torch.compile the step (off by default: measured slower). Phases and fall-backs
    go to `on_event("compile", message, **detail)`.
    """

    def __init__(self, model, batch: int, prompt_len: int, new_tokens: int, device, on_event=None,
                 graphs: bool | None = None, prefill_graph_tokens: int = 4096, record_tokens: bool = False,
                 fast: bool = True, moe: str = "auto", compile: bool | None = None,
                 fused: bool | None = None, keep: int = 1) -> None:
        self.model, self.new_tokens = model, int(new_tokens)
        self._builds = BuildCache(keep)  # the builds held (keep=1: the batch running only)
        # the fast step's fused Triton kernels (workload/kernels.py): None = where they can run (CUDA + Triton);
        # False: never (asked, or a build with them failed); `_plan_fused`: the plan being built
        self.want_fused, self._asked_fused = fused, fused
        self._plan_fused = False
        self.want_fast, self.moe = fast, moe  # fastpath.FastDeepseek (absorbed MLA, dense experts) or transformers'
        self.impl: str | None = None  # "fast" or "transformers": what the last build runs
        self.detail: dict[str, Any] = {}
        self.device = torch.device(device)
        self.on_event = on_event or (lambda kind, message, **detail: None)
        self.want_graphs = self.device.type == "cuda" if graphs is None else bool(graphs)
        # torch.compile of the fast path's one-token step: off unless asked. Measured on the H200 (v2-lite,
        # batch 32, docs/BENCHMARKS.md call 12): 48-55 s to compile and 22.6 ms a token against 14.0 uncompiled
        # - inductor turns the in-place writes into the latent cache into whole-buffer copies. A failure falls
        # back, and says so.
        self.want_compile = False if compile is None else bool(compile)
        self._compile_failed = False
        self.prefill_graph_tokens = prefill_graph_tokens
        self.record_tokens = record_tokens
        self.mode = "eager" if self.device.type != "cuda" and graphs is None else None
        self._forced_eager = self.mode == "eager"  # for good: a CPU, a failed capture, unstable shapes
        self.compile_s = 0.0  # seconds the last prepare() spent (0.0 when it reused what it had)
        self.captures = 0
        self.tokens: torch.Tensor | None = None  # (batch, new_tokens) when record_tokens
        self._key: tuple | None = None
        self._st: dict[str, Any] = {}
        self._steps_since_capture = 0
        self._thrash = 0
        self._said_eager = False
        self._said_unsupported = False
        self.batch, self.prompt_len = batch, prompt_len

    # -- what to (re)build -------------------------------------------------------------------------------
    def _build_key(self, batch: int, prompt_len: int) -> tuple:
        """What a build depends on: the shape, and the weights' dtype and storage (a precision change)."""
        p = self.model.get_input_embeddings().weight
        return (batch, prompt_len, self.new_tokens, p.dtype, p.data_ptr())

    def prepare(self, batch: int, prompt_len: int) -> float:
        self.compile_s = 0.0
        self.batch, self.prompt_len = batch, prompt_len
        if self._forced_eager:
            self._say_eager("CPU: no CUDA graphs, decode runs eager (dynamic cache)" if self.device.type != "cuda"
                            else "decode runs eager")
            return 0.0
        key = self._build_key(batch, prompt_len)
        if key == self._key:
            return 0.0
        held = self._builds.get(key)
        if held is not None:  # a recent batch's build, kept (keep > 1): nothing to capture
            self._use(key, *held)
            return 0.0
        if self._key is not None and self._steps_since_capture < 2:
            self._thrash += 1
            if self._thrash >= 3:  # e.g. the fragment fault: a new prompt length every step
                self.release()
                self.mode, self._forced_eager = "eager", True
                self.on_event("compile", "decode: shapes change every step, re-capturing would cost more than "
                              "it saves; falling back to eager", fallback="eager", reason="shapes unstable")
                return 0.0
        else:
            self._thrash = 0
        t0 = time.perf_counter()
        # builds over other weights (a precision change: new dtype or storage) would pin the old weights
        self._builds.drop_where(lambda k: k[3:] != key[3:])
        self._builds.make_room()  # keep=1: the last batch's graphs, pools and cache are freed before this build
        self._st, self._key = {}, None
        plans, fused = self._build_plans()
        failures: list[str] = []
        for graphs, fast, fz in plans:
            self.want_graphs, self.want_fast, self._plan_fused = graphs, fast, fz
            try:
                self._build(batch, prompt_len)
                if fused and fast and not fz:  # the fast step works only without the kernels: off for good
                    self.want_fused = False
                break
            except Exception as e:  # noqa: BLE001 - an OOM goes to the caller's recovery; anything else: next plan
                free(self._st)  # what this attempt built
                if is_oom(e):
                    self.release()  # and every build held: the caller's recovery wants the memory back
                    raise
                why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
                failures.append(f"{self._plan_name(graphs, fast, fz)}: {why}")
        else:
            self.mode, self._forced_eager = "eager", True
            self.on_event("compile", f"decode: could not build the step ({'; '.join(failures)}); falling back to "
                          "eager", fallback="eager", reason="; ".join(failures))
            return 0.0
        if failures:
            now = self._plan_name(self.want_graphs, self.want_fast, self._plan_fused)
            self.on_event("compile", f"decode: could not build the step ({'; '.join(failures)}); running {now} "
                          "instead", fallback=("transformers" if not self.want_fast else "static"
                                      if plans[0][0] and not self.want_graphs else "unfused"),
                          reason="; ".join(failures))
        self._key = key
        self._builds.put(key, self._st, (self.mode, self.impl, dict(self.detail)))
        self._steps_since_capture = 0
        self.captures += 1
        self.compile_s = time.perf_counter() - t0
        what = {"graphs": "captured CUDA graphs", "static": "built a static cache (no graphs)",
                "eager": "compute-bound prefill, runs eager (no graph)"}[self.mode]
        how = (f" ({self.detail['attention']}, experts: {self.detail['experts']}"
               + (f", kernels: {self.detail['kernels']}" if self.new_tokens and self.detail.get("kernels") else "")
               + (f", torch.compile {self.detail['torch_compile_s']:.1f} s" if self.detail.get("compiled") else "")
               + ")" if self.impl == "fast" and self.mode != "eager" else "")
        self.on_event("compile", f"decode: {what} for batch {batch} x {prompt_len} (+{self.new_tokens} tokens) "
                      f"in {self.compile_s:.2f} s{how}", mode=self.mode, batch=batch, prompt_len=prompt_len,
                      new_tokens=self.new_tokens, seconds=self.compile_s, impl=self.impl,
                      prefill_graph=self._st.get("g_prefill") is not None,
                      **{k: v for k, v in self.detail.items() if k in ("attention", "experts", "compiled",
                                                                      "torch_compile_s", "kernels")})
        return self.compile_s

    def _build_plans(self) -> tuple[list[tuple[bool, bool, bool]], bool]:
        """(graphs, fast, fused) to try in order, and whether the fused kernels are wanted at all."""
        # what to try, in order: as asked; the fast step without its fused kernels (a Triton that cannot
        # compile them); without graphs (with the kernels, then without); transformers' forward (with graphs
        # if asked); then eager. What failed is not tried again on a rebuild ("for good"): the flags keep
        # the plan that worked.
        from gpuwatch.workload import kernels

        compiling = self.want_compile and not self._compile_failed  # torch.compile traces torch ops only
        fused = bool(self.want_fast and self.want_fused is not False and not compiling
                     and kernels.usable(self.device) is None)
        plans = [(self.want_graphs, self.want_fast, fused)]
        if fused:
            plans.append((self.want_graphs, True, False))
        if self.want_graphs and self.want_fast:
            plans += [(False, True, True)] if fused else []
            plans.append((False, True, False))
        if self.want_fast:
            plans.append((self.want_graphs, False, False))
        return plans, fused

    def _say_eager(self, message: str) -> None:
        if not self._said_eager:
            self._said_eager = True
            self.on_event("compile", message, fallback="eager")

    def release(self) -> None:
        """Drop every build held - caches, buffers and graphs (their memory returns to torch's allocator);
        the next step rebuilds what it needs. Call it in OOM recovery."""
        self._builds.clear()
        free(self._st)  # a build not (yet) held
        self._st, self._key = {}, None

    @property
    def held_builds(self) -> int:
        """How many builds (static cache + graphs of one batch and prompt length) the engine holds."""
        return len(self._builds)

    def _use(self, key: tuple, entry: dict[str, Any], state: tuple) -> None:
        """Run a held build from the next step on (no capture: compile_s stays 0)."""
        self._st, self._key = entry, key
        self.mode, self.impl, detail = state
        self.detail = dict(detail)

    def _build(self, batch: int, prompt_len: int) -> None:
        m, dev, st = self.model, self.device, self._st
        cfg = m.config
        graph_prefill = batch * prompt_len <= self.prefill_graph_tokens
        if not self.new_tokens and not (graph_prefill and self.want_graphs):
            self.mode = "eager"  # a large prefill is compute-bound: step_prefill, no cache to fill
            return
        if getattr(cfg, "_experts_implementation", "eager") == "eager" and self.want_graphs:
            m.set_experts_implementation("grouped_mm")  # the eager expert loop syncs on nonzero()
        with torch.inference_mode():
            st["fast"] = self._fast(batch, prompt_len + self.new_tokens)
            if st["fast"] is None:
                st["cache"] = _static_cache(m, prompt_len + self.new_tokens)
            elif self.want_compile and self.new_tokens and not self._compile_failed:
                self._compile_decode(batch, prompt_len)
            st["ids"] = torch.zeros(batch, prompt_len, dtype=torch.long, device=dev)
            st["tok"] = torch.zeros(batch, 1, dtype=torch.long, device=dev)
            st["logits"] = torch.zeros(batch, 1, cfg.vocab_size, dtype=torch.float32, device=dev)
            st["out"] = torch.zeros(batch, max(1, self.new_tokens), dtype=torch.long, device=dev)
            if not self.want_graphs:
                self._reset()  # one run here, so a kernel this dtype/device lacks fails now (fall-back), not mid-step
                self._prefill_body()
                if self.new_tokens:
                    self._decode_body()
                self.mode = "static"
                return
            with self._on_side_stream():
                for _ in range(2):  # warm-up outside capture: lazy cache allocation, cuBLAS handles, autotuning
                    self._reset()
                    self._prefill_body()
                    if self.new_tokens:
                        self._decode_body()
            synchronize(dev)
            st["g_prefill"] = self._capture(self._prefill_body) if graph_prefill else None
            st["g_decode"] = self._capture(self._decode_body) if self.new_tokens else None
            synchronize(dev)
        self.mode = "graphs"

    @staticmethod
    def _plan_name(graphs: bool, fast: bool, fused: bool = False) -> str:
        return (("gpuwatch's step" + (" with fused kernels" if fused else "") if fast else "transformers' forward")
                + (" in CUDA graphs" if graphs else " without graphs"))

    def needs_build(self, batch: int, prompt_len: int) -> bool:
        """Whether prepare() would (re)build - the runner shows the workload as compiling only then."""
        if self._forced_eager:
            return False
        key = self._build_key(batch, prompt_len)
        return key != self._key and key not in self._builds

    def _fast(self, batch: int, max_len: int):
        """fastpath.FastDeepseek for this shape, or None (asked not to, or the model's layout is unknown:
        then transformers' forward over its StaticCache runs, and an event says why, once)."""
        self.impl, self.detail = "transformers", {"attention": "transformers (latents re-expanded each token)",
                                                  "experts": getattr(self.model.config, "_experts_implementation", None)
                                                  or "eager"}
        if not self.want_fast:
            return None
        from gpuwatch.workload.fastpath import FastDeepseek, Unsupported

        try:
            from gpuwatch.workload import kernels

            compiling = self.want_compile and not self._compile_failed  # torch.compile traces torch ops only
            why = ("asked" if self._asked_fused is False else kernels.usable(self.device)
                   or "the fused kernels failed to build (see the compile events)")
            fast = FastDeepseek(self.model, batch, max_len, moe=self.moe, fused=self._plan_fused,
                                for_compile=compiling, unfused_why=why)
        except Unsupported as e:
            if not self._said_unsupported:
                self._said_unsupported = True
                self.on_event("compile", f"decode: fast path unavailable ({e}); using transformers' forward",
                              fallback="transformers", reason=str(e))
            return None
        self.impl, self.detail = "fast", fast.describe(decode=self.new_tokens > 0)
        return fast

    def _compile_decode(self, batch: int, prompt_len: int) -> None:
        """torch.compile FastDeepseek.decode (fullgraph, static shapes) and run it once, so the compile
        happens here (inside prepare(): the "compiling" phase), not in a timed step. On failure the
        uncompiled step is used from then on."""
        st = self._st
        fast = st["fast"]
        t0 = time.perf_counter()
        try:
            import torch._dynamo

            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            fn = torch.compile(fast.decode, fullgraph=True, dynamic=False)
            fast.prefill(torch.zeros(batch, prompt_len, dtype=torch.long, device=self.device))
            fn(torch.zeros(batch, 1, dtype=torch.long, device=self.device))
            fast.reset()
        except Exception as e:  # noqa: BLE001 - no compiler, an unsupported op, ...: run uncompiled
            if is_oom(e):
                raise
            self._compile_failed = True
            fast.for_compile = False  # eager from here: the matmuls write in place again (no copies)
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
            self.on_event("compile", f"decode: torch.compile failed ({why}); the step runs uncompiled",
                          fallback="uncompiled", reason=why)
            return
        st["decode_fn"] = fn
        self.detail["compiled"] = True
        self.detail["torch_compile_s"] = round(time.perf_counter() - t0, 2)

    def _reset(self) -> None:
        st = self._st
        if st.get("fast") is not None:
            st["fast"].reset()
        else:
            st["cache"].reset()

    @contextlib.contextmanager
    def _on_side_stream(self):
        """The warm-up runs on the device's one side stream (`side_stream`), ordered after what the
        current stream queued and before what it queues next; off CUDA, where it is."""
        if self.device.type != "cuda":
            yield
            return
        stream, current = side_stream(self.device), torch.cuda.current_stream(self.device)
        stream.wait_stream(current)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            yield
        current.wait_stream(stream)

    def _capture(self, body):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device), torch.cuda.graph(g, stream=side_stream(self.device),
                                                              capture_error_mode="thread_local"):
            body()
        return g

    # -- the two bodies (what a graph holds) ---------------------------------------------------------------
    def _prefill_body(self) -> None:
        st = self._st
        if st.get("fast") is not None:
            logits = st["fast"].prefill(st["ids"])
        else:
            logits = _forward(self.model, st["ids"], st["cache"], logits_to_keep=1).logits[:, -1:]
        st["logits"].copy_(logits)
        st["tok"].copy_(logits.argmax(-1))

    def _decode_body(self) -> None:
        st = self._st
        if st.get("decode_fn") is not None:
            logits = st["decode_fn"](st["tok"])
        elif st.get("fast") is not None:
            logits = st["fast"].decode(st["tok"])
        else:
            logits = _forward(self.model, st["tok"], st["cache"]).logits[:, -1:]
        st["logits"].copy_(logits)
        st["tok"].copy_(logits.argmax(-1))

    # -- one step ----------------------------------------------------------------------------------------------
    def step(self, ids) -> tuple[None, float]:
        batch, prompt_len = ids.shape
        self.prepare(batch, prompt_len)
        if self.mode == "eager":
            return step_decode(self.model, ids, self.new_tokens) if self.new_tokens else step_prefill(self.model, ids)
        st = self._st
        self._steps_since_capture += 1
        with torch.inference_mode():
            self._reset()
            st["ids"].copy_(ids)
            if st.get("g_prefill") is not None:
                st["g_prefill"].replay()
            else:
                self._prefill_body()
            g = st.get("g_decode")
            for i in range(self.new_tokens):
                g.replay() if g is not None else self._decode_body()
                if self.record_tokens:
                    st["out"][:, i].copy_(st["tok"][:, 0])
            if self.record_tokens:
                self.tokens = st["out"][:, :self.new_tokens].clone()
            return None, st["logits"].abs().max().item()
