"""Deterministic sources for UI tests: real recorded H200 data, fixed clocks."""

from __future__ import annotations

from gpuwatch.recording.reader import open_recording
from gpuwatch.recording.replay_backend import ReplayGpuBackend
from gpuwatch.recording.source import LiveSource
from gpuwatch.recording.window import GpuMeta
from gpuwatch.telemetry.bus import Bus, Event
from gpuwatch.telemetry.sampler import Sampler

from conftest import RAMP

T0 = 1_796_033_980_000_000  # 2026-11-30 10:19:40 UTC, the recording's own day


class FixedHost:
    def read_fast(self):
        return {"host_cpu_pct": 23.0}

    def read_slow(self):
        return {"host_cpu_per_core_pct": [10, 80, 5, 0, 100, 30, 0, 0], "host_mem_used_bytes": 20 * 2**30,
                "host_mem_total_bytes": 126 * 2**30, "host_swap_used_bytes": 0, "host_load1": 1.5,
                "proc_rss_bytes": 2 * 2**30, "proc_cpu_pct": 101.0}


def live_source(ticks: int = 400) -> tuple[LiveSource, Bus]:
    """A LiveSource whose bus was filled by the real Sampler reading real recorded H200 rows, with a
    fake clock (every tick exactly 100 ms) and the recording's own steps and events."""
    bus = Bus()
    fake = {"t": 0.0}
    s = Sampler(bus, ReplayGpuBackend(RAMP), FixedHost(), clock=lambda: fake["t"],
                wall_us=lambda: T0 + int(fake["t"] * 1e6))
    s.slow_tick()
    for _ in range(ticks):
        s.tick()
        fake["t"] += 0.1
    rec = open_recording(RAMP)
    end = T0 + ticks * 100_000
    for row in rec.steps.to_dicts():
        row["ts"] = int(row["ts"].timestamp() * 1e6)
        if row["ts"] <= end:
            bus.steps.append(row)
    for row in rec.events.to_dicts():
        ts = int(row["ts"].timestamp() * 1e6)
        if ts <= end:
            bus.events.append(Event(row["kind"], row["message"], row["severity"], row["gpu"], {}, ts))
    gpus = [GpuMeta(0, "NVIDIA H200", 150754820096, 700.0, 89)]
    return LiveSource(bus, gpus, "NVIDIA H200 (test)"), bus


def screen_lines(app) -> list[str]:
    """The screen as the user sees it, one string a row (from Textual's own SVG screenshot: the text
    of every cell, each run placed at its column)."""
    import html
    import re

    svg = app.export_screenshot()
    w, h = app.size
    rows = [[" "] * w for _ in range(h)]
    runs = re.finditer(r'<text class="[^"]*" x="([\d.]+)" y="[\d.]+" textLength="([\d.]+)" '
                       r'clip-path="url\(#[^)]*-line-(\d+)\)">(.*?)</text>', svg)
    for m in runs:
        x, length, line, raw = m.groups()
        t = html.unescape(raw).replace("\xa0", " ")
        if not t:
            continue
        col = round(float(x) / (float(length) / len(t)))
        for i, ch in enumerate(t):
            if 0 <= int(line) < h and 0 <= col + i < w:
                rows[int(line)][col + i] = ch
    return ["".join(r).rstrip() for r in rows]


async def settled_lines(pilot, app, ready, timeout: float = 10.0) -> list[str]:
    """The screen's rows once `ready(rows)` holds (polled every 50 ms, up to `timeout` s), else the last
    rows read: on a loaded 2-core CI runner the first frame can come later than a fixed 0.1 s pause
    (the replay footer read empty there once)."""
    import time

    end = time.monotonic() + timeout
    while True:
        lines = screen_lines(app)
        if ready(lines) or time.monotonic() > end:
            return lines
        await pilot.pause(0.05)
