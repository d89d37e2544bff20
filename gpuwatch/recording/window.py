"""What a source hands the scorer: one GPU's window of telemetry (`Window`) and what is known of the GPU and
its workload (`GpuMeta`) - the same live, in replay, in follow and over a recording in training."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from gpuwatch.recording.frames import epoch_us, f64, of_gpu


@dataclass(frozen=True)
class GpuMeta:
    index: int
    name: str
    mem_total_bytes: int | None = None
    power_limit_w: float | None = None
    temp_slowdown_c: int | None = None
    mem_limit_bytes: int | None = None  # a workload's --gpu-memory-limit on this GPU (NVML does not know it)
    pid: int | None = None  # the process whose workload runs on this GPU: its own memory is in gpu_procs
    # that workload's description (meta.json's config.workloads entry; not part of the GPU's identity)
    workload: dict[str, Any] | None = field(default=None, hash=False, compare=False)

    @property
    def effective_limit_bytes(self) -> int | None:
        """What an OOM is measured against: the workload's cap where one is set, else the card."""
        caps = [v for v in (self.mem_total_bytes, self.mem_limit_bytes) if v]
        return min(caps) if caps else None


@dataclass(frozen=True)
class Window:
    """The last `seconds` of one GPU, identical live, in replay, in follow and over a recording in
    training: samples in the samples schema (this GPU's rows, `ts` as Datetime(us, UTC), time order),
    the GPU's last steps (steps schema) and its recent events (events schema; GPU-less events too)."""

    gpu: int | None
    end_us: int  # the moment the window is taken at (the cursor); rows are at or before it
    interval_s: float  # the sampling interval the session was recorded with
    samples: pl.DataFrame
    steps: pl.DataFrame
    events: pl.DataFrame
    meta: GpuMeta | None = None
    # the workload process's own memory per sample row and whether the row listed processes
    # (frames.own_used), where the source computed it once for the whole recording; else None
    own: tuple[np.ndarray, np.ndarray] | None = None
    # replay, before the GPU's first step row: the step the workload was about to run (recorded.first_plan);
    # live, the workload says it (the scorer's plan)
    first_plan: dict[str, Any] | None = None
    # replay, training and `score`: the window's rows as views of numpy columns its source converted once
    # for the whole recording (`WindowArrays`); live, None (the feature function converts the frames)
    arrays: WindowArrays | None = field(default=None, compare=False, repr=False)

    @property
    def cols(self) -> WindowArrays | None:
        """`arrays` where they are of this window's own frames (a window copied with other frames,
        dataclasses.replace, is read from its frames)."""
        a = self.arrays
        if a is None or a.frames[0] is not self.samples or a.frames[1] is not self.steps or a.frames[2] is not self.events:
            return None
        return a


_SERIALS = itertools.count()


class Columns:
    """One GPU's rows of one table as numpy columns, each converted once, on first use, for the whole
    recording: a window reads its rows as views (`WindowArrays`). Converting each window's own slices
    of the polars frames was about a third of the feature function's cost at one window per sample
    (`gpuwatch score`, training). The arrays are read-only: the feature function must not write to them."""

    __slots__ = ("df", "serial", "_f64", "_lists", "_us")

    def __init__(self, df: pl.DataFrame) -> None:
        self.df = df
        self.serial = next(_SERIALS)  # names these rows in caches (never reused, unlike id())
        self._f64: dict[str, np.ndarray] = {}
        self._lists: dict[str, list] = {}
        self._us: np.ndarray | None = None

    def f64(self, name: str) -> np.ndarray:
        """A numeric column as float64, NaN for nulls (frames.f64 of the whole column)."""
        a = self._f64.get(name)
        if a is None:
            a = f64(self.df[name])
            a.setflags(write=False)
            self._f64[name] = a
        return a

    def us(self) -> np.ndarray:
        """`ts` as int64 microseconds (frames.epoch_us of the whole column)."""
        if self._us is None:
            a = np.array(epoch_us(self.df["ts"]), dtype=np.int64)
            a.setflags(write=False)
            self._us = a
        return self._us

    def values(self, name: str) -> list:
        """A column's Python values (Series.to_list: each as the frame's own scalar would be)."""
        v = self._lists.get(name)
        if v is None:
            v = self._lists[name] = self.df[name].to_list()
        return v


@dataclass(frozen=True)
class WindowArrays:
    """Where a window's rows lie in its source's per-GPU `Columns`: samples[s_lo:s_hi], steps[t_lo:t_hi],
    events[e_lo:e_hi] - the same rows as the window's frames."""

    samples: Columns
    s_lo: int
    s_hi: int
    steps: Columns
    t_lo: int
    t_hi: int
    events: Columns
    e_lo: int
    e_hi: int
    frames: tuple  # the window's (samples, steps, events) frames these rows are: Window.cols checks them

    def sample(self, name: str) -> np.ndarray:
        return self.samples.f64(name)[self.s_lo:self.s_hi]

    def step(self, name: str) -> np.ndarray:
        return self.steps.f64(name)[self.t_lo:self.t_hi]

    def sample_us(self) -> np.ndarray:
        return self.samples.us()[self.s_lo:self.s_hi]

    def step_us(self) -> np.ndarray:
        return self.steps.us()[self.t_lo:self.t_hi]

    def event_us(self) -> np.ndarray:
        return self.events.us()[self.e_lo:self.e_hi]

    def event_kinds(self) -> list:
        return self.events.values("kind")[self.e_lo:self.e_hi]

    def last_step(self, name: str) -> Any:
        """The window's last step's value of `name` (the frame's own scalar); at least one row."""
        return self.steps.values(name)[self.t_hi - 1]

    def step_values(self, name: str) -> list:
        return self.steps.values(name)[self.t_lo:self.t_hi]

    def last_sample(self, name: str) -> Any:
        """The window's last sample's value of `name` (the frame's own scalar); at least one row."""
        return self.samples.values(name)[self.s_hi - 1]


WINDOW_S = 30.0  # the default window: the feature function looks back this far
WINDOW_STEPS = 64
WINDOW_EVENTS_S = 600.0


def cut_tables(body: pl.DataFrame, ts: np.ndarray, steps: pl.DataFrame, events: pl.DataFrame, gpu: int | None) -> tuple:
    """What a recording's windows of one GPU are cut from (recording/source.py ReplaySource.window_at): its
    samples `body` (times `ts`), its steps with their rows' places among all GPUs' `steps`, and its events with
    the GPU-less ones, each with its numpy columns - the same rows as slicing the whole tables and keeping the
    GPU's (frames.of_gpu), without a gather per window."""
    if gpu is not None and steps.height:
        g = steps["gpu"].to_numpy()
        g = g.astype(np.float64) if g.dtype.kind != "f" else g
        steps_at = np.flatnonzero(g == gpu)
        steps_g = steps if steps_at.size == steps.height else steps[steps_at]
    else:
        steps_at, steps_g = np.arange(steps.height), steps
    ev_g = of_gpu(events, gpu, keep_null=True) if gpu is not None else events
    ev_ts = np.asarray(epoch_us(ev_g["ts"]), dtype=np.int64) if ev_g.height else np.array([], dtype=np.int64)
    return body, ts, Columns(body), steps_g, steps_at, Columns(steps_g), ev_g, ev_ts, Columns(ev_g)
