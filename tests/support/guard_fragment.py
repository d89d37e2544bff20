"""The library benchmark's fragmentation scenario (`benchmarks/guard_library.py --only fragment`; its other
scenarios are tests/support/library_scenarios.py, here because the tests run them too).

Calibrated from the H200's calls 25 and 28 (benchmarks/results/guard-library-call25.json,
guard-library-fragment-call28.json: peak = 2.745 GB + 781,709 B x tokens, cap 31.51 GB): the old scenario's
longest step (0.85 x 32k tokens) peaked at 0.77 of the cap with ~0.45 GB of odd buffers beside it, and the
caching allocator fitted everything: 0 OOMs unguarded twice. Best fit puts small buffers into the smallest
free block, so buffers of a few MiB beside a step's activations never pin much.

Now each step, on a CUDA stream of its own (the pool's streams in turn), a staging block of STAGE_FRAC of
the cap (a prefetched batch, an async metric gather) is allocated and freed, and then the step's six
odd-sized buffers (1-48 MiB, kept three steps) are allocated on that stream: a freed block serves only its
own stream, so they are cut from the staging block, and each live generation keeps a whole staging segment
reserved (~3.1 GB) for ~0.15 GB allocated. Three generations: ~0.30 of the cap reserved but unallocated
that `empty_cache` cannot give back and the training step (another stream) cannot use. The longest step
peaks at 0.09 + SMAX_FIT x 0.81 = 0.80 of the cap allocated (0.82 with the buffers: it fits), 1.1 with the
pinned segments (it does not): on the call-25 calibration 16 of the 60 steps need more than the cap
(steps with a peak above ~0.67). Expandable segments (the guard's remedy) unmap the free pages of a
segment, so the new generations pin ~20 MiB each; the old ones are released as their buffers die.

On the CPU (--dry-run) there are no streams: the buffers are kept as before and the simulated OOM decides.
"""

from __future__ import annotations

import random

import torch

SMAX_FIT = 0.88  # the longest sequence: this share of the calibrated fit (32k tokens) over the batch
STAGE_FRAC = 0.10  # each step's staging block, a share of the cap
HOLD_STEPS = 3  # the odd-sized buffers live this many steps
FRAG_GAP_MIN = 0.05  # a failure counts as fragmentation when reserved - allocated at it is >= this of the cap


class Pins:
    """The per-step side-stream staging block and the odd-sized buffers cut from it (see the module)."""

    def __init__(self, device: torch.device, cap: int | None):
        self.device, self.cap = device, cap
        self.held: list[list[torch.Tensor]] = []
        self.mib = 2**20 if device.type == "cuda" else 2**10

    def __call__(self, i: int) -> None:
        rr = random.Random(1000 + i)
        sizes = [rr.randint(1, 48) * self.mib + rr.randint(0, 4095) for _ in range(6)]
        if len(self.held) >= HOLD_STEPS:  # the oldest generation dies first: its segment is whole again
            self.held.pop(0)
        if self.device.type != "cuda" or not self.cap:
            self.held.append([torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes])
            return
        side = torch.cuda.Stream(self.device)
        with torch.cuda.stream(side):
            stage = torch.empty(int(STAGE_FRAC * self.cap), dtype=torch.uint8, device=self.device)
            del stage
            self.held.append([torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes])

    def clear(self) -> None:
        self.held.clear()

    def held_bytes(self) -> int:
        return sum(t.numel() for g in self.held for t in g)


def at_failure(device: torch.device, err: BaseException) -> dict:
    """torch's figures at an OOM, read in its handler: allocated, reserved, their gap, the message."""
    row = {"error": str(err).splitlines()[0][:300]}
    if device.type == "cuda":
        a, r = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        row.update(allocated_at_failure=a, reserved_at_failure=r, reserved_gap_at_failure=r - a)
    return row


def scenario_fragment(ctx, lib) -> dict:
    """Unguarded then guarded on the same random lengths (1/4..1 of SMAX_FIT x fit) and the same buffers;
    `lib` is support.library_scenarios (its loops). Its `criteria` say whether the scenario showed the remedy."""
    d, model, opt, state = ctx["device"], ctx["model"], ctx["opt"], ctx["state"]
    batch = 8
    smax = max(16, int(SMAX_FIT * ctx["fit_tokens"] / batch))
    r = random.Random(2)
    batches = [torch.randint(0, ctx["vocab"], (batch, r.randint(smax // 4, smax))) for _ in range(ctx["steps"])]
    pins = Pins(d, ctx["cap"])
    cal = ctx.get("calibration") or {}
    out = {"batch": batch, "seq_len_range": [smax // 4, smax], "steps": len(batches),
           "stage_bytes": int(STAGE_FRAC * ctx["cap"]) if ctx["cap"] else None, "hold_steps": HOLD_STEPS,
           "side_streams": d.type == "cuda" and bool(ctx["cap"])}
    if ctx["cap"] and cal.get("per_token"):
        peak = cal["fixed"] + cal["per_token"] * batch * smax
        out["longest_step_peak_frac"] = round(peak / ctx["cap"], 3)  # allocated, the buffers aside
        out["longest_step_with_pins_frac"] = round((peak + HOLD_STEPS * STAGE_FRAC * ctx["cap"]) / ctx["cap"], 3)
    lib.set_cap(d, ctx["cap"])
    for arm in ("unguarded", "guarded"):
        lib.reset(model, state, opt)
        pins.clear()
        lib.free(d)
        if arm == "unguarded":
            out[arm] = lib.plain_loop(model, opt, batches, d, ctx["sim_frag"], extra=pins, cap=ctx["cap"])
        else:
            out[arm] = lib.guarded_loop(model, opt, batches, d, ctx["sim_frag"], ctx["sessions"], "fragment",
                                        ctx["cap"], extra=pins)
        pins.clear()
        lib.free(d)
    out["criteria"] = criteria(out, ctx["cap"])
    return out


def criteria(out: dict, cap: int | None) -> dict:
    """What the scenario must show: unguarded OOMs with reserved-but-unallocated memory at them, none guarded,
    the guard's release of the cache and switch to expandable segments, and the throughput it kept."""
    u, g = out["unguarded"], out["guarded"]
    gaps = [row.get("reserved_gap_at_failure") for row in u.get("oom_rows", [])]
    frag = [x for x in gaps if x is not None and cap and x >= FRAG_GAP_MIN * cap]
    released = [a for a in g.get("actions", []) if a.get("action") == "release_cache"]
    c = {"unguarded_ooms": u["ooms"], "unguarded_fragmentation_ooms": len(frag),
         "reserved_gap_at_failure_frac": [round(x / cap, 3) for x in gaps if x is not None] if cap else [],
         "guarded_ooms": g["ooms"], "guard_release_cache_steps": [a["step"] for a in released],
         "expandable_segments": any("expandable segments" in str(x) for x in g.get("remedies", [])),
         "guard_lowered_ceiling": sum(a.get("action") == "lower_ceiling" for a in g.get("actions", [])),
         "tokens_per_s_ratio": round(g["tokens_per_s"] / u["tokens_per_s"], 4) if u.get("tokens_per_s") else None,
         "tokens_ratio": round(g["tokens"] / u["tokens"], 4) if u.get("tokens") else None}
    c["shown"] = bool(c["unguarded_ooms"] > 0 and c["unguarded_fragmentation_ooms"] > 0 and c["guarded_ooms"] == 0
                      and released and c["expandable_segments"])
    return c
