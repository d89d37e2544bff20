"""Load schedules: what batch and sequence length each step runs, and what happens after an OOM.
Pure Python (no torch) so it is tested on its own."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

SWEEP_LEVELS = (1, 8, 32, 64, 128)


@dataclass
class Schedule:
    kind: str  # steady | soak | sweep | ramp | long
    batch: int
    seq_len: int
    max_batch: int | None = None
    per_level: int = 6  # steps per sweep/ramp level (the first 2 are warm-up)
    warmup_steps: int = 30  # soak: steps at 50 % before the 110 % overload
    long_seq: int = 8192
    step: int = 0
    finished: bool = False
    edges: list[int] = field(default_factory=list)  # ramp: last batch that ran before each OOM
    oom_levels: list[int] = field(default_factory=list)  # sweep: batches that ran out of memory
    ceiling: int | None = None  # a batch ceiling (user or guard) that every kind of schedule respects
    accumulates: bool = False  # a train step over the ceiling runs micro-batches of it (the batch is kept)
    _level: int = 0
    _in_level: int = 0
    _base: int = 0
    _last_ok: int = 0
    _last_eff: int = 0

    def __post_init__(self) -> None:
        self._base = self.batch
        if self.kind == "sweep":
            top = self.max_batch or SWEEP_LEVELS[-1]
            self.levels = [b for b in SWEEP_LEVELS if b <= top] if not self.max_batch else _pow2(top)
        if self.kind == "ramp":
            self._ramp_start = max(1, self.batch // 4)
            self.batch = self._ramp_start
        if self.kind == "long":  # one long sequence; a control can raise the batch
            self.batch = 1

    def plan(self) -> tuple[int, int, str] | None:
        """(batch, seq_len, phase) of the next step, the batch at most the ceiling; None when finished."""
        p = self.wanted()
        if p is None or self.ceiling is None:
            return p
        return min(p[0], self.ceiling), p[1], p[2]

    def wanted(self) -> tuple[int, int, str] | None:
        """What the schedule itself wants next, before the ceiling (train mode accumulates up to it)."""
        if self.finished:
            return None
        k = self.kind
        if k == "soak":
            if self.step < self.warmup_steps:
                return max(1, round(0.5 * self._base)), self.seq_len, "warmup"
            return max(1, round(1.1 * self._base)), self.seq_len, "overload"
        if k == "sweep":
            b = self.levels[self._level]
            return b, self.seq_len, f"sweep b={b}" + (" warmup" if self._in_level < 2 else "")
        if k == "ramp":
            return self.batch, self.seq_len, f"ramp b={self.batch}"
        if k == "long":
            return self.batch, max(self.seq_len, self.long_seq), "long"
        return self.batch, self.seq_len, "steady"

    def ahead(self, n: int) -> list[tuple[int, int]]:
        """(batch, seq_len) of the next `n` steps if each of them runs, the ceiling applied (a train step
        over the ceiling runs micro-batches of the ceiling): what the schedule already knows of the steps to
        come. A copy walks forward; this schedule is left as it is."""
        s = copy.deepcopy(self)
        out: list[tuple[int, int]] = []
        for _ in range(max(0, int(n))):
            p = s.plan()
            if p is None:
                break
            out.append((p[0], p[1]))
            s.done()
        return out

    def done(self) -> None:
        """A step finished without failure."""
        self.step += 1
        self._last_ok = min(self.batch, self.ceiling) if self.ceiling else self.batch  # what one step held
        self._last_eff = self.batch  # the batch it ran (accumulated to, over the ceiling)
        if self.kind in ("sweep", "ramp"):
            self._in_level += 1
            if self._in_level >= self.per_level:
                self._next_level()

    def _next_level(self) -> None:
        self._in_level = 0
        if self.kind == "sweep":
            self._level += 1
            self.finished = self._level >= len(self.levels)
        elif self.accumulates and self.ceiling is not None and self.batch >= self.ceiling:
            pass  # a ramp that accumulates stays where it is at or over the ceiling: its steps keep it as their
            # effective batch in micro-batches of the ceiling (H200: the planner's 20 as 2 x 10 fell to 10 at the
            # next level when the ramp was cut to the ceiling); it climbs again once the ceiling is lifted
        else:
            nxt = max(self.batch + 1, int(self.batch * 1.25))
            nxt = min(nxt, self.max_batch) if self.max_batch else nxt
            self.batch = min(nxt, self.ceiling) if self.ceiling else nxt  # a ramp stops climbing at the ceiling

    def oom(self, b: int) -> str:
        """A step at batch `b` ran out of memory: decide how to carry on; returns what was decided."""
        self.step += 1
        if self.kind == "sweep":
            self.oom_levels.append(b)
            self._in_level = 0
            self._level += 1
            self.finished = self._level >= len(self.levels)
            return f"sweep: batch {b} does not fit; next level"
        if self.kind == "ramp":
            self.edges.append(self._last_ok)
            if b <= self._ramp_start and self._ramp_start > 1:  # the start itself does not fit: restarting
                self._ramp_start = max(1, b // 2)                # there would fail forever (call 29: 995 OOMs)
                self.batch, self._in_level = self._ramp_start, 0
                return f"ramp: OOM at batch {b}, its start; restarting lower, at {self._ramp_start}"
            self.batch, self._in_level = self._ramp_start, 0
            return f"ramp: OOM at batch {b}; restarting the ramp at {self._ramp_start}"
        if self.kind == "soak":
            self._base = max(1, int(self._base * 0.9))
            return f"soak: base batch lowered to {self._base}"
        self.batch = max(1, b // 2)
        self._base = self.batch
        return f"batch halved to {self.batch}"

    def set_batch(self, b: int) -> None:
        """A control (user or reactive rule) sets the batch the schedule works from. Sweep levels are
        fixed (a ceiling limits them instead); a ramp continues upwards from here."""
        self.batch = self._base = max(1, b)

    def set_ceiling(self, b: int | None) -> None:
        self.ceiling = None if b is None else max(1, int(b))

    def hold(self, batch: int | None = None) -> None:
        """Refuse the next step up: the schedule stays at `batch` (default: the last batch that ran),
        a ramp goes back to it if it had already stepped past, and the ceiling is set to it."""
        b = batch or self._last_ok or self.batch
        if self.kind == "ramp":  # (one that accumulates goes back to the batch that ran, in micro-batches of b)
            self.batch = min(self.batch, self._last_eff if self.accumulates and self._last_eff else b)
        self.set_ceiling(b)

    def set_seq_len(self, s: int) -> None:
        self.seq_len = max(1, s)

    # -- resume: export the state, or rebuild it by replaying what was recorded ---------------------------
    def state(self) -> dict:
        """Everything the next step depends on (JSON-able): for the CI summary and for tests."""
        out = {"kind": self.kind, "step": self.step, "batch": self.batch, "seq_len": self.seq_len,
               "ceiling": self.ceiling, "finished": self.finished, "edges": list(self.edges),
               "oom_levels": list(self.oom_levels), "level": self._level, "in_level": self._in_level,
               "base": self._base, "last_ok": self._last_ok,
               **({"ramp_start": self._ramp_start} if self.kind == "ramp" else {})}
        p = self.wanted()
        out["phase"] = p[2] if p else None
        return out

    def restore(self, state: dict) -> None:
        """Put back what `state()` exported (same kind of schedule, built from the same flags)."""
        if state.get("kind") != self.kind:
            raise ValueError(f"schedule state of a {state.get('kind')!r} schedule, this one is {self.kind!r}")
        self.step, self.batch, self.seq_len = int(state["step"]), int(state["batch"]), int(state["seq_len"])
        self.ceiling, self.finished = state.get("ceiling"), bool(state.get("finished"))
        self.edges, self.oom_levels = list(state.get("edges") or []), list(state.get("oom_levels") or [])
        self._level, self._in_level = int(state.get("level", 0)), int(state.get("in_level", 0))
        self._base, self._last_ok = int(state.get("base", self.batch)), int(state.get("last_ok", 0))
        if self.kind == "ramp" and state.get("ramp_start"):
            self._ramp_start = int(state["ramp_start"])

    def replay(self, history) -> None:
        """Rebuild the state of an interrupted run from its recorded history, in time order: ("done",)
        for each step that ran, ("oom", micro_batch) for an OOM the schedule recovered from, and the
        controls that were applied (("batch", n), ("ceiling", n | None), ("hold", n), ("seq_len", n)).
        The schedule is pure, so the same calls give the same state as the run had."""
        for op, *arg in history:
            v = arg[0] if arg else None
            if op == "done":
                self.done()
            elif op == "oom":
                self.oom(int(v or self.batch))
            elif op == "batch":
                self.set_batch(int(v))
            elif op == "ceiling":
                self.set_ceiling(v)
            elif op == "hold":
                self.hold(int(v) if v else None)
            elif op == "seq_len":
                self.set_seq_len(int(v))


def _pow2(top: int) -> list[int]:
    out, b = [], 1
    while b < top:
        out.append(b)
        b *= 2
    return out + [top]
