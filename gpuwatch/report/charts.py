"""Charts of a session as inline SVG (matplotlib's object API, no pyplot, no display, no JavaScript).

Every chart shares the time axis (from the session's start) and marks events as vertical lines; a kind
with many events (e.g. a non-finite output every step) is drawn as a rug of ticks along the top edge.
Long sessions are reduced to at most `MAX_POINTS` buckets per GPU (mean line, min-max band), so a day of
10 Hz samples still gives a small file. Gaps in the telemetry are left blank, not bridged.
"""

from __future__ import annotations

import io
import itertools
import re
from dataclasses import dataclass
from datetime import datetime

import numpy as np
import polars as pl

from gpuwatch.recording.reader import Recording
from gpuwatch.report.health import Thresholds, effective_limits, mem_used_expr, slowdown_temps

MAX_POINTS = 1200
RUG_ABOVE = 40  # more events of one kind than this: ticks along the top instead of full-height lines
MARKED = {  # kind -> (colour, label)
    "oom": ("#d62728", "OOM"),
    "xid": ("#000000", "XID"),
    "gpu_lost": ("#000000", "GPU lost"),
    "workload_error": ("#000000", "workload error"),
    "nonfinite": ("#ff7f0e", "non-finite"),
    "integrity_mismatch": ("#9467bd", "integrity mismatch"),
    "guard_action": ("#2ca02c", "guard action"),
    "guard_miss": ("#8c564b", "guard miss"),
    "risk_alarm": ("#e377c2", "risk alarm"),
    "mark": ("#7f7f7f", "mark"),
    "throttle_onset": ("#bcbd22", "throttle onset"),
    "recorder_error": ("#000000", "recorder error"),
}
GPU_COLOURS = ["#1f77b4", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd"]


@dataclass
class Chart:
    id: str
    title: str
    svg: str
    note: str = ""


class _Time:
    """Seconds since the session start, shown in s, min or h by span."""

    def __init__(self, start: datetime, end: datetime) -> None:
        self.start_us = int(start.timestamp() * 1e6)
        span = max(1.0, (end - start).total_seconds())
        self.div, self.unit = (1, "s") if span <= 600 else ((60, "min") if span <= 3 * 3600 else (3600, "h"))
        self.span = span / self.div

    def of(self, ts: pl.Series) -> np.ndarray:
        return (ts.dt.epoch("us").cast(pl.Float64).to_numpy() - self.start_us) / 1e6 / self.div


def _series(t: np.ndarray, y: np.ndarray, gap: float) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(x, mean, min, max) with at most MAX_POINTS buckets, NaN where consecutive points are > gap apart."""
    ok = np.isfinite(y)
    t, y = t[ok], y[ok]
    lo = hi = None
    if t.size > MAX_POINTS:
        width = (t[-1] - t[0]) / MAX_POINTS or 1.0
        idx = np.minimum(((t - t[0]) / width).astype(np.int64), MAX_POINTS - 1)
        uniq, start = np.unique(idx, return_index=True)
        cnt = np.diff(np.append(start, t.size))
        x = np.add.reduceat(t, start) / cnt
        mean = np.add.reduceat(y, start) / cnt
        lo, hi = np.minimum.reduceat(y, start), np.maximum.reduceat(y, start)
        t, y = x, mean
        gap = max(gap, 3 * width)
    if t.size > 1:
        brk = np.nonzero(np.diff(t) > gap)[0] + 1
        if brk.size:
            t = np.insert(t, brk, np.nan)
            y = np.insert(y, brk, np.nan)
            if lo is not None:
                lo, hi = np.insert(lo, brk, np.nan), np.insert(hi, brk, np.nan)
    return t, y, lo, hi


class ChartMaker:
    def __init__(self, rec: Recording, th: Thresholds | None = None) -> None:
        from matplotlib.figure import Figure  # imported here: the Markdown report never pays for it

        self._Figure = Figure
        self.rec = rec
        self.th = th or Thresholds()
        frames = [f["ts"] for f in (rec.samples, rec.steps) if f.height]
        start = min(f.min() for f in frames)
        end = max(f.max() for f in frames)
        self.time = _Time(start, end)
        self.samples = rec.samples.filter(pl.col("gpu").is_not_null()).sort("gpu", "ts")
        self.gpus = sorted(self.samples["gpu"].unique().to_list()) if self.samples.height else []
        interval = float((rec.meta.get("config") or {}).get("interval_s") or 0.1)
        self.gap = interval * self.th.gap_factor / self.time.div
        ev = rec.events.filter(pl.col("kind").is_in(list(MARKED)))
        self.events = [(k, self.time.of(g["ts"])) for k in MARKED if (g := ev.filter(pl.col("kind") == k)).height]

    # ------------------------------------------------------------ helpers
    def _fig(self, height: float = 2.5):
        fig = self._Figure(figsize=(10, height), dpi=100)
        # fixed margins (not constrained layout) so every chart's time axis lines up; legends sit on the right
        fig.subplots_adjust(left=0.075, right=0.80, bottom=0.45 / height, top=1 - 0.12 / height)
        ax = fig.add_subplot()
        ax.grid(True, color="#e5e5e5", linewidth=0.6)
        ax.set_axisbelow(True)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        return fig, ax

    def _finish(self, fig, ax, ylabel: str, time_axis: bool = True) -> str:
        if time_axis:
            ax.set_xlim(0, self.time.span)
            ax.set_xlabel(f"time since start ({self.time.unit})")
            self._mark_events(ax)
        ax.set_ylabel(ylabel)
        handles, labels = ax.get_legend_handles_labels()
        if handles:
            ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
        return _svg(fig)

    def _mark_events(self, ax) -> None:
        from matplotlib.lines import Line2D

        for kind, xs in self.events:
            colour, label = MARKED[kind]
            if xs.size > RUG_ABOVE:  # one path of short segments, one per ~pixel column
                cols = np.unique(np.round(xs / (self.time.span / 1500)) * (self.time.span / 1500))
                rx = np.repeat(cols, 3)
                rx[2::3] = np.nan
                ry = np.tile([0.955, 1.0, np.nan], cols.size)
                ax.plot(rx, ry, transform=ax.get_xaxis_transform(), color=colour, linewidth=0.8, alpha=0.8,
                        clip_on=False)
                label = f"{label} ({xs.size}, ticks)"
            else:
                for x in xs:
                    ax.axvline(x, color=colour, linewidth=0.9, alpha=0.75, linestyle="-")
                label = f"{label} ({xs.size})"
            ax.add_line(Line2D([], [], color=colour, label=label))  # legend entry only

    def _plot_gpus(self, ax, col: str | pl.Expr, scale: float = 1.0, band: bool = True) -> bool:
        drew = False
        for i, gpu in enumerate(self.gpus):
            g = self.samples.filter(pl.col("gpu") == gpu)
            vals = g.select(col if isinstance(col, pl.Expr) else pl.col(col)).to_series().cast(pl.Float64)
            if vals.drop_nulls().is_empty():
                continue
            x, y, lo, hi = _series(self.time.of(g["ts"]), vals.fill_null(np.nan).to_numpy() * scale, self.gap)
            colour = GPU_COLOURS[i % len(GPU_COLOURS)]
            label = f"GPU {gpu}" if len(self.gpus) > 1 else None
            ax.plot(x, y, color=colour, linewidth=1.1, label=label)
            if band and lo is not None:
                ax.fill_between(x, lo, hi, color=colour, alpha=0.18, linewidth=0)
            drew = True
        return drew

    def _hline(self, ax, y: float, label: str, colour: str = "#d62728", style: str = "--") -> None:
        ax.axhline(y, color=colour, linestyle=style, linewidth=1.0, label=label)

    # ------------------------------------------------------------ charts
    def charts(self) -> list[Chart]:
        out = []
        for fn in (self.util, self.memory, self.power, self.temperature, self.clocks, self.tokens, self.mfu,
                   self.risk):
            c = fn()
            if c is not None:
                out.append(c)
        return out

    def util(self) -> Chart | None:
        fig, ax = self._fig()
        if not self._plot_gpus(ax, "gpu_util_pct"):
            return None
        self._hline(ax, self.th.min_util_pct, f"target > {self.th.min_util_pct:g} %", "#2ca02c", ":")
        ax.set_ylim(0, 105)
        return Chart("util", "GPU utilization", self._finish(fig, ax, "utilization (%)"))

    def memory(self) -> Chart | None:
        fig, ax = self._fig()
        if not self._plot_gpus(ax, mem_used_expr(), 1 / 2**30):
            return None
        limits = effective_limits(self.rec)
        note = ""
        seen = set()
        for gpu, (limit, total, what) in limits.items():
            if gpu not in self.gpus:
                continue
            if total and ("total", total) not in seen:
                self._hline(ax, total / 2**30, f"card total {total / 2**30:.1f} GiB", "#7f7f7f", "--")
                seen.add(("total", total))
            if limit and limit != total and ("cap", limit) not in seen:
                self._hline(ax, limit / 2**30, f"effective limit {limit / 2**30:.1f} GiB", "#d62728", "--")
                seen.add(("cap", limit))
                note = (f"The workload ran under a memory cap of {limit / 2**30:.1f} GiB (--gpu-memory-limit): "
                        "that, not the card's total, is the limit it could run into.")
        ax.set_ylim(bottom=0)
        return Chart("memory", "GPU memory used", self._finish(fig, ax, "GiB"), note)

    def power(self) -> Chart | None:
        fig, ax = self._fig()
        if not self._plot_gpus(ax, "gpu_power_w"):
            return None
        lim = self.samples["gpu_power_limit_w"].drop_nulls()
        if lim.len():
            self._hline(ax, float(lim.max()), f"power limit {lim.max():.0f} W")
        ax.set_ylim(bottom=0)
        return Chart("power", "Power draw", self._finish(fig, ax, "W"))

    def temperature(self) -> Chart | None:
        fig, ax = self._fig()
        if not self._plot_gpus(ax, "gpu_temp_c"):
            return None
        slow = slowdown_temps(self.rec)
        if slow:
            t = min(slow.values())
            self._hline(ax, t, f"slowdown {t} °C")
            self._hline(ax, t - self.th.temp_margin_c, f"health limit {t - self.th.temp_margin_c:g} °C", "#ff7f0e", ":")
        return Chart("temperature", "GPU temperature", self._finish(fig, ax, "°C"))

    def clocks(self) -> Chart | None:
        fig, ax = self._fig()
        if not self._plot_gpus(ax, "gpu_sm_clock_mhz", band=False):
            return None
        if len(self.gpus) == 1:
            ax.lines[-1].set_label("SM clock")
        for i, gpu in enumerate(self.gpus):
            g = self.samples.filter(pl.col("gpu") == gpu)
            if g["gpu_mem_clock_mhz"].drop_nulls().len():
                x, y, _, _ = _series(self.time.of(g["ts"]), g["gpu_mem_clock_mhz"].cast(pl.Float64)
                                     .fill_null(np.nan).to_numpy(), self.gap)
                ax.plot(x, y, color=GPU_COLOURS[i % len(GPU_COLOURS)], linewidth=0.9, linestyle="--",
                        label="memory clock" + (f" GPU {gpu}" if len(self.gpus) > 1 else ""))
        spans = self._held_spans()
        if spans:
            ax.broken_barh(spans, (0, 1), transform=ax.get_xaxis_transform(), color="#d62728", alpha=0.10,
                           linewidth=0, label="clocks held back")
        ax.set_ylim(bottom=0)
        return Chart("clocks", "Clocks (shaded: throttled)", self._finish(fig, ax, "MHz"))

    def _held_spans(self) -> list[tuple[float, float]]:
        """(start, width) runs where any GPU had a limiting clock-event reason; runs closer than 0.3 % of
        the span are merged so a flickering reason gives a few bars, not thousands."""
        r = self.samples.filter(pl.col("gpu_clocks_event_reasons").is_not_null()).sort("ts")
        if r.is_empty():
            return []
        x = self.time.of(r["ts"])
        held = ((r["gpu_clocks_event_reasons"] & self.th.throttle_mask) != 0).to_numpy()
        half = (self.rec.meta.get("config") or {}).get("interval_s", 0.1) / self.time.div / 2
        merge = max(self.time.span * 0.003, 2 * half)
        spans: list[list[float]] = []
        for xi in x[held]:
            if spans and xi - half <= spans[-1][1] + merge:
                spans[-1][1] = xi + half
            else:
                spans.append([xi - half, xi + half])
        return [(a, b - a) for a, b in spans]

    def _steps_chart(self, id_: str, title: str, col: str, scale: float, ylabel: str) -> tuple | None:
        st = self.rec.steps.filter(pl.col(col).is_not_null() & pl.col(col).is_finite()).sort("gpu", "ts")
        if st.is_empty():
            return None
        fig, ax = self._fig()
        for i, ((gpu,), g) in enumerate(st.group_by(["gpu"], maintain_order=True)):
            x = self.time.of(g["ts"])
            y = g[col].cast(pl.Float64).to_numpy() * scale
            x, y, lo, hi = _series(x, y, gap=max(self.gap, 5 * float(np.median(np.diff(x))) if x.size > 2 else 1e9))
            colour = GPU_COLOURS[i % len(GPU_COLOURS)]
            ax.plot(x, y, color=colour, linewidth=1.0, marker="o" if g.height <= 60 else None, markersize=3,
                    label=f"GPU {gpu}" if st["gpu"].n_unique() > 1 else None)
            if lo is not None:
                ax.fill_between(x, lo, hi, color=colour, alpha=0.18, linewidth=0)
        ax.set_ylim(bottom=0)
        return fig, ax

    def tokens(self) -> Chart | None:
        made = self._steps_chart("tokens", "Throughput", "tokens_per_s", 1.0, "tokens/s")
        if made is None:
            return None
        fig, ax = made
        _thousands(ax)
        return Chart("tokens", "Throughput (per step)", self._finish(fig, ax, "tokens/s"))

    def mfu(self) -> Chart | None:
        made = self._steps_chart("mfu", "MFU", "mfu", 100.0, "% of peak")
        if made is None:
            return None
        fig, ax = made
        self._hline(ax, self.th.min_mfu * 100, f"target {self.th.min_mfu * 100:g} %", "#2ca02c", ":")
        ax.set_ylim(0, max(ax.get_ylim()[1], self.th.min_mfu * 100 * 1.1))
        return Chart("mfu", "Compute: MFU (TFLOP/s / dense peak)", self._finish(fig, ax, "MFU (%)"))

    def risk(self) -> Chart | None:
        rk = self.rec.risk.filter(pl.col("risk").is_not_null())
        if rk.is_empty():
            return None
        fig, ax = self._fig()
        for i, ((gpu, kind), g) in enumerate(rk.sort("gpu", "kind", "ts").group_by(["gpu", "kind"], maintain_order=True)):
            x, y, _, _ = _series(self.time.of(g["ts"]), g["risk"].cast(pl.Float64).to_numpy(), 1e18)
            ax.plot(x, y, color=GPU_COLOURS[i % len(GPU_COLOURS)], linewidth=1.1,
                    label=f"{kind} risk" + (f" GPU {gpu}" if rk["gpu"].n_unique() > 1 else ""))
        thr = rk["threshold"].drop_nulls()
        if thr.len():
            self._hline(ax, float(thr.min()), f"alarm at {thr.min():.2f}")
        ax.set_ylim(0, 1.02)
        return Chart("risk", "Failure risk (model)", self._finish(fig, ax, "probability"))

    def sweep(self, rows: list[dict], kind: str) -> Chart | None:
        meas = [r for r in rows if r.get("tps") and r.get("lat_p50")]
        if len(meas) < 2:
            return None
        fig, ax = self._fig(height=3.2)
        x = np.array([r["lat_p50"] * 1000 for r in meas])
        y = np.array([r["tps"] for r in meas])
        ax.plot(x, y, color=GPU_COLOURS[0], marker="o", linewidth=1.3, markersize=5)
        for r, xi, yi in zip(meas, x, y):
            ax.annotate(r["label"], (xi, yi), textcoords="offset points", xytext=(5, -11), fontsize=8)
        if x.max() / max(x.min(), 1e-9) > 20:
            ax.set_xscale("log")
        ax.set_ylim(0, y.max() * 1.12)
        ax.set_xlabel("step latency, median (ms)")
        _thousands(ax)
        return Chart("sweep", f"Batch {kind}: latency vs throughput", self._finish(fig, ax, "tokens/s", time_axis=False))


def _thousands(ax) -> None:
    from matplotlib.ticker import StrMethodFormatter

    ax.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))


_XML_HEAD = re.compile(r"^.*?(?=<svg)", re.S)
_SVG_SEQ = itertools.count(1)


def _svg(fig) -> str:
    from matplotlib import rc_context

    buf = io.StringIO()
    with rc_context({"svg.fonttype": "none", "svg.hashsalt": "gpuwatch", "font.size": 9,
                     "font.family": "DejaVu Sans"}):
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    text = _XML_HEAD.sub("", buf.getvalue(), count=1)
    # several SVGs share one HTML document: give each its own ids (matplotlib's repeat across figures)
    prefix = f"g{next(_SVG_SEQ)}-"
    ids = set(re.findall(r'\bid="([^"]+)"', text))
    if ids:
        alt = "|".join(re.escape(i) for i in sorted(ids, key=len, reverse=True))
        text = re.sub(rf'(\bid="|url\(#|href="#)({alt})(?=[")])', lambda m: m.group(1) + prefix + m.group(2), text)
    # responsive: keep the viewBox, drop the fixed size
    text = re.sub(r'<svg([^>]*?) width="[^"]*" height="[^"]*"', r'<svg\1 role="img" preserveAspectRatio="xMinYMin meet"',
                  text, count=1)
    return text


def make_charts(rec: Recording, th: Thresholds | None = None) -> list[Chart]:
    if rec.samples.is_empty() and rec.steps.is_empty():
        return []
    return ChartMaker(rec, th).charts()
