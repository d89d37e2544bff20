"""Pure functions from telemetry to Rich Text: bars, multi-row plots and each panel's lines.
No widget state here, so every panel renders the same in live, replay and follow."""

from __future__ import annotations

import statistics
from datetime import datetime, timezone
from typing import Any

from rich.text import Text

from gpuwatch.predict.headroom import headroom
from gpuwatch.predict.trend import ESTIMATES, SIGNALS, Outlook, outlook
from gpuwatch.recording.frames import shown_limit, used_against_cap
from gpuwatch.recording.ranks import rank_stats, straggler
from gpuwatch.recording.recorded import event_detail
from gpuwatch.recording.window import GpuMeta
from gpuwatch.telemetry.reasons import LIMITING, decode
from gpuwatch.units import fmt_bytes

BLOCKS = " ▁▂▃▄▅▆▇█"
GiB = 2**30
SEVERITY_STYLE = {"error": "bold red", "warning": "yellow", "info": "dim"}


def bar(frac: float | None, width: int, style: str = "green") -> Text:
    if frac is None:
        return Text("·" * width, style="dim")
    frac = min(max(frac, 0.0), 1.0)
    full = int(frac * width)
    part = int((frac * width - full) * 8)
    body = "█" * full + (BLOCKS[part] if part and full < width else "")
    style = "red" if frac >= 0.95 else "yellow" if frac >= 0.85 else style
    return Text(body.ljust(width, "·"), style=style)


def plot(values: list, width: int, height: int, lo: float = 0.0, hi: float | None = None,
         style: str = "cyan") -> list[Text]:
    """A `height`-row block plot of the last `width` values (None = gap), scaled lo..hi."""
    vals = list(values)[-width:]
    nums = [v for v in vals if v is not None]
    top = hi if hi is not None else (max(nums) if nums else 1.0)
    span = (top - lo) or 1.0
    levels = [None if v is None else min(max((v - lo) / span, 0.0), 1.0) * height * 8 for v in vals]
    rows = []
    for r in range(height - 1, -1, -1):
        chars = []
        for lv in levels:
            if lv is None:
                chars.append(" ")
                continue
            fill = lv - r * 8
            chars.append("█" if fill >= 8 else BLOCKS[int(fill)] if fill > 0 else " ")
        rows.append(Text("".join(chars).rjust(width), style=style))
    return rows


def bucket_max(values: list, k: int, scale: float = 1.0) -> list:
    """Collapse every k values into their max (None when all are None), right-aligned to the newest."""
    return _bucket(values, k, max, scale)


def bucket_time(rows: list[dict[str, Any]], end_us: int, columns: int, col_us: int = 1_000_000,
                key: str = "risk") -> list:
    """Rows with a `ts` (us) into `columns` columns of `col_us` each, the last ending at `end_us`: the max
    of `key` in each (None where no row fell). Risk rows come at the scorer's pace (or every k-th sample
    when scored after the fact), not one per sample, so they are placed by time, not by count."""
    out: list = [None] * columns
    start = end_us - columns * col_us
    for r in rows:
        v, ts = r.get(key), r.get("ts")
        if v is None or ts is None or ts <= start or ts > end_us:
            continue
        i = min(columns - 1, int((ts - start - 1) // col_us))
        out[i] = v if out[i] is None else max(out[i], v)
    return out


def bucket_min(values: list, k: int, scale: float = 1.0) -> list:
    return _bucket(values, k, min, scale)


def _bucket(values: list, k: int, fn, scale: float) -> list:
    vals = list(values)
    start = len(vals) % k
    out = [fn(v) if (v := [x for x in vals[:start] if x is not None]) else None] if start else []
    for i in range(start, len(vals), k):
        chunk = [x for x in vals[i:i + k] if x is not None]
        out.append(fn(chunk) * scale if chunk else None)
    if start and out[0] is not None:
        out[0] *= scale
    return out


def clock(ts_us: int | None) -> str:
    if ts_us is None:
        return "--:--:--"
    return datetime.fromtimestamp(ts_us / 1e6, timezone.utc).strftime("%H:%M:%S.%f")[:-5]


def _f(v: Any, fmt: str = "{:.0f}", none: str = "-") -> str:
    return none if v is None else fmt.format(v)


def gpu_lines(row: dict[str, Any] | None, meta: GpuMeta, width: int, wide: bool,
              reserved: float | None = None) -> list[Text]:
    """`reserved`: torch's reserved bytes after the GPU's last step (the memory outside torch, `shown_limit`)."""
    if row is None:
        return [Text(f"GPU{meta.index} {meta.name}: no data (lost?)", style="bold red")]
    bw = max(6, (width - 62) // 2)
    util = row.get("gpu_util_pct")
    used, card = row.get("gpu_mem_used_bytes"), row.get("gpu_mem_total_bytes") or meta.mem_total_bytes
    procs = row.get("gpu_procs") or []
    # measured against what an OOM is measured against: the workload's --gpu-memory-limit where set - and then
    # the workload process's own memory, not the whole GPU's (side by side, a capped run read 6.8/4 GiB, 180 %:
    # two processes' memory against one's cap)
    (own,), kind = used_against_cap([used], [row.get("gpu_procs")], meta.pid, bool(meta.mem_limit_bytes))
    capped = kind != "gpu" and own is not None
    used = own if capped else used
    total = shown_limit(meta.mem_limit_bytes, card, own if capped else None, reserved)
    own_known = capped and kind == "own"
    mfrac = used / total if used is not None and total else None
    line1 = Text.assemble(
        (f"GPU{meta.index} ", "bold"), (f"{meta.name.removeprefix('NVIDIA ').removesuffix(' [replay]')[:10]:10s} ", ""), "util ", bar(util / 100 if util is not None else None, bw),
        f" {_f(util):>3}%  {'own' if own_known else 'mem'} ", bar(mfrac, bw, "magenta"),
        f" {_f(used / GiB if used is not None else None, '{:.1f}')}/"
        f"{_f(total / GiB if total else None, '{:.1f}' if total and total < 10 * GiB else '{:.0f}')} GiB",
        f" {_f(mfrac * 100 if mfrac is not None else None)}%")
    temp, slow = row.get("gpu_temp_c"), row.get("gpu_temp_slowdown_c") or meta.temp_slowdown_c
    pw, lim = row.get("gpu_power_w"), row.get("gpu_power_limit_w") or meta.power_limit_w
    tstyle = "red" if temp is not None and slow and temp >= slow - 5 else ""
    pstyle = "yellow" if pw is not None and lim and pw >= 0.95 * lim else ""
    line2 = Text.assemble(
        "temp ", (f"{_f(temp)}°C", tstyle), f"/{_f(slow)}  power ", (f"{_f(pw)}", pstyle), f"/{_f(lim)} W  ",
        f"SM {_f(row.get('gpu_sm_clock_mhz'))} mem {_f(row.get('gpu_mem_clock_mhz'))} MHz  ",
        f"PCIe ↑{_f(_gb(row.get('gpu_pcie_tx_bytes_per_s')), '{:.2f}')} ↓{_f(_gb(row.get('gpu_pcie_rx_bytes_per_s')), '{:.2f}')} GB/s")
    mask = row.get("gpu_clocks_event_reasons")
    reasons = decode(mask)
    rstyle = "bold yellow" if mask and mask & LIMITING else "dim"
    pmem = sum(p.get("used_bytes") or 0 for p in procs)
    line3 = Text.assemble(
        "throttle: ", (", ".join(reasons) or "none", rstyle),
        f"  ECC {_f(row.get('gpu_ecc_corrected'))}/{_f(row.get('gpu_ecc_uncorrected'))}",
        f"  procs {len(procs)} ({fmt_bytes(pmem) if procs else '-'})")
    return [line1, line2, line3]


def compact(v: float) -> str:
    """3 significant figures with k/M/G suffixes: 15079 -> 15.1k."""
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= div:
            return f"{v / div:.3g}{suffix}"
    return f"{v:.3g}"


def _gb(v: float | None) -> float | None:
    return None if v is None else v / 1e9


def host_lines(row: dict[str, Any] | None, width: int, wide: bool) -> list[Text]:
    if not row:
        return [Text("host: no data", style="dim")]
    cores = row.get("host_cpu_per_core_pct") or []
    cpu = row.get("host_cpu_pct")
    core_str = "".join(BLOCKS[min(8, int((c or 0) / 12.5 + 0.99))] if c else "·" for c in cores)
    mu, mt = row.get("host_mem_used_bytes"), row.get("host_mem_total_bytes")
    line = Text.assemble(
        ("host ", "bold"), f"CPU {_f(cpu, '{:.0f}'):>3}% ", (core_str[: max(0, width - 70)], "green"),
        f" mem {fmt_bytes(mu)}/{fmt_bytes(mt)} swap {fmt_bytes(row.get('host_swap_used_bytes'))}",
        f" load {_f(row.get('host_load1'), '{:.1f}')}",
        "" if wide else f"  tick {_f(_ms(row.get('sampler_cost_us')), '{:.2f}')} ms")
    proc = Text.assemble(
        ("process ", "bold"), f"CPU {_f(row.get('proc_cpu_pct'), '{:.0f}')}% RSS {fmt_bytes(row.get('proc_rss_bytes'))}",
        "  sampler ", f"{_f(_ms(row.get('sampler_cost_us')), '{:.2f}')} ms/tick, interval {_f(_ms(row.get('sampler_interval_us')), '{:.1f}')} ms")
    return [line, proc] if wide else [line]


def _ms(us: int | None) -> float | None:
    return None if us is None else us / 1000


def workload_lines(steps: list[dict[str, Any]], status: dict[str, Any] | None, power_w: float | None,
                   wide: bool) -> list[Text]:
    """The workload's own figures, from its step rows (live or recorded)."""
    if not steps:
        if status:
            return [Text(f"workload: {status.get('state')}  {status.get('describe', '')}", style="yellow")]
        return [Text("workload: none in this session", style="dim")]
    last = steps[-1]
    times = sorted(r["step_time_s"] for r in steps[-200:] if r.get("step_time_s"))
    p50 = statistics.median(times) if times else None
    p99 = times[min(len(times) - 1, int(0.99 * len(times)))] if times else None
    tps = last.get("tokens_per_s")
    tpj = tps / power_w if tps and power_w else None
    state = (status or {}).get("state", "recorded")
    l1 = Text.assemble(
        ("work ", "bold"), f"{(status or {}).get('preset', '')} {last.get('mode')} {last.get('precision')}  ",
        f"batch {last.get('batch')}×{last.get('seq_len')}  ", (f"{_f(tps, '{:,.0f}')} tok/s", "bold green"),
        f"  step p50 {_f(p50, '{:.3f}')} p99 {_f(p99, '{:.3f}')} s  ",
        (state, "bold yellow" if state in ("paused", "building", "compiling") else "bold red" if state == "failed" else "green"))
    mfu = last.get("mfu")
    l2 = Text.assemble(
        f"     {compact(last['tflops']) if last.get('tflops') is not None else '-'} TFLOP/s  MFU {_f(mfu * 100 if mfu is not None else None, '{:.1f}')}%  ",
        f"{_f(tpj, '{:.1f}')} tok/J  loss {_f(last.get('loss'), '{:.3f}')}  |logit| {_f(last.get('max_abs_logit'), '{:.3g}')}  ",
        f"torch {fmt_bytes(last.get('torch_allocated_bytes'))} alloc / {fmt_bytes(last.get('torch_peak_bytes'))} peak",
        f"  experts {last.get('expert_impl') or '-'}")
    ranks = rank_lines(steps, wide)
    return [l1, *ranks] if ranks and not wide else [l1, l2, *ranks]


def rank_lines(steps: list[dict[str, Any]], wide: bool) -> list[Text]:
    """A data-parallel run (2+ ranks): the straggler against the median, communication beside the step;
    one line at 80 columns, one more per rank when wide."""
    stats = rank_stats(steps)
    slow = straggler(stats)
    if not stats or slow is None:
        return []
    comm = [s.comm_s for s in stats if s.comm_s is not None]
    share = [s.comm_share for s in stats if s.comm_share is not None]
    style = "bold red" if slow.excess > 0.1 else "yellow" if slow.excess > 0.03 else "green"
    head = Text.assemble(
        ("ranks ", "bold"), f"{len(stats)}  step med {slow.median_s:.3f}s  ", ("slowest ", "bold"),
        (f"r{slow.rank} {slow.step_s:.3f}s +{100 * slow.excess:.0f}%", style),
        f"  comm {max(comm):.3f}s ({100 * max(share):.0f}%)" if comm and share else "  comm -")
    if not wide:
        return [head]
    per = [Text(f"     r{s.rank}: step {_f(s.step_s, '{:.3f}')} s  comm {_f(s.comm_s, '{:.3f}')} s "
                f"({_f(s.comm_share * 100 if s.comm_share is not None else None)}%)  {fmt_bytes(s.comm_bytes)} all-reduced"
                f"  {_f(s.tokens_per_s, '{:,.0f}')} tok/s  at step {s.last_step}") for s in stats[:8]]
    return [head, *per]


def risk_line(mem_series: list, total: int | None, interval_s: float, why: str = "no risk scored",
              why_style: str = "yellow", cap: int | None = None, width: int | None = None) -> Text:
    """No risk at this moment: say why, once ("risk: no risk model; ", "risk: not scored yet at this
    moment; "), and show memory headroom instead; its trend, the time to full and the --gpu-memory-limit
    it is read against follow, each whole or not at all within `width`."""
    h = headroom(mem_series[-300:], total, interval_s)
    why = why.removeprefix("risk ").rstrip(" ;")  # "risk scoring off" reads "risk: scoring off"
    line = Text.assemble(("risk: ", "bold"), (f"{why}; ", why_style))
    if h is None:
        return line + Text("memory headroom unknown")
    trend = "flat" if h.slope_bytes_per_s is None or abs(h.slope_bytes_per_s) < 1e6 else \
        f"{h.slope_bytes_per_s * 60 / GiB:+.2f} GiB/min"
    style = "bold red" if h.free_frac < 0.05 else "yellow" if h.free_frac < 0.15 else "green"
    line += Text.assemble("headroom ", (f"{h.free_frac * 100:.1f}% ({fmt_bytes(h.free_bytes)})", style))
    extras = {"trend": Text(f", trend {trend}"),
              "full": Text(f", full in ~{_dur(h.seconds_to_full)}") if h.seconds_to_full is not None else Text(""),
              "cap": Text(f" (of the {fmt_bytes(cap)} --gpu-memory-limit)", style="dim") if cap else Text("")}
    room = None if width is None else width - len(line)
    shown = set()
    for name in ("full", "trend", "cap"):  # the time to full matters most when not all of it fits
        if room is None or len(extras[name]) <= room:
            shown.add(name)
            room = None if room is None else room - len(extras[name])
    for name in extras:  # said in this order
        if name in shown:
            line += extras[name]
    return line


def risk_model_line(row: dict[str, Any], guard: str, width: int, outlook: Outlook | None = None) -> Text:
    """The scorer's latest word on the plotted GPU: risk vs threshold, the estimate's time to the limit as a
    range and the signal that carries it (`outlook`, predict/trend.py; shown from half the threshold up),
    the features pushing it up, the model, and what the guard is doing."""
    import json

    r, thr = row.get("risk"), row.get("threshold")
    alarm = bool(row.get("alarm"))
    try:
        reasons = json.loads(row.get("reasons") or "[]")
    except ValueError:
        reasons = []
    style = "bold red" if alarm else "yellow" if r is not None and thr and r >= 0.5 * thr else "green"
    t = Text.assemble(("risk ", "bold"), (f"OOM {_f(r, '{:.2f}')}", style),
                      f" / alarm {_f(thr, '{:.2f}')}", (" ALARM" if alarm else "", "bold red"))
    if outlook is not None:
        t.append(f"  {outlook_text(outlook, reasons)}", style=style)
    if reasons:
        t.append("  why: " + ", ".join(f"{n} +{d:.2f}" for n, d in reasons[:3]))
    if guard:
        t.append(f"  {guard}", style="cyan")
    t.append(f"  {row.get('model') or ''}", style="dim")
    return t


def risk_outlook(source, gpu: int | None, row: dict[str, Any]) -> Outlook | None:
    """The estimate's time to the limit and the signal carrying it (predict/trend.py) from the window the
    risk panel speaks of (the source's, live or at the replay cursor) - only from half the alarm threshold
    up, where it is worth one feature pass (~2 ms)."""
    r, thr = row.get("risk"), row.get("threshold")
    if r is None or not thr or r < 0.5 * thr:
        return None
    from gpuwatch.predict.features import features

    try:
        return outlook(features(source.window(gpu)))
    except Exception:  # noqa: BLE001 - a window that cannot be cut shows no range, never an error
        return None


def outlook_text(o: Outlook, reasons: list | None = None) -> str:
    """"OOM in ~6-12 s (trend)": the range of the time to the limit by the estimator's strongest signal, and
    that signal - with the step's estimated peak against the usable limit where the plan's signal carries it
    and the estimate is over ("next-step peak 112 %": how far over is what ranks the risk above its alarm),
    and the feature that carries the risk where its strongest reason is none of the estimator's
    ("lookahead; carried by torch_peak_frac": the classifier's context)."""
    top = reasons[0][0] if reasons else None
    sig = o.signal + (f" {o.est:.0%}" if o.est is not None and o.est > 1.0 else "")
    by = sig if top is None or top in SIGNALS or top in ESTIMATES else f"{sig}; carried by {top}"
    return f"OOM in ~{_range(o.lo_s, o.hi_s)} ({by})"


def _range(lo: float, hi: float | None) -> str:
    """"3.2-7.5 s", "60-120 s", "2 min-1.5 h", "40 s or more" (hi None: beyond what the trend can say)."""
    if hi is None:
        return f"{_dur(lo) if lo >= 10 else _num(lo) + ' s'} or more"
    if hi < 120:
        a, b = _num(lo), _num(hi)
        return f"{a} s" if a == b else f"{a}-{b} s"
    a, b = _dur(lo), _dur(hi)
    return a if a == b else f"{a}-{b}"


def _num(s: float) -> str:
    return f"{s:.1f}" if s < 10 and round(s, 1) != round(s) else f"{s:.0f}"


def _dur(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"


def ellipsize(text: str, width: int) -> str:
    """`text` in at most `width` cells, cut at a word boundary and ended with an ellipsis when it does
    not fit (never mid-word; a single word longer than the whole line is the only thing cut inside)."""
    if len(text) <= width:
        return text
    if width <= 1:
        return "…"[:width]
    head = text[:width - 1]
    cut = max(head.rfind(" "), head.rfind(";"), head.rfind(","))
    if text[width - 1] in " ;,":  # the cut falls right on a boundary: keep the whole last word
        cut = width - 1
    head = head[:cut] if cut > 0 else head
    return head.rstrip(" ;,:") + "…"


def event_text(e: dict[str, Any]) -> str:
    """One event in full: time, kind, GPU, message and the risk behind it."""
    d = event_detail(e)
    msg = e["message"]
    if e.get("kind") == "control":  # sessions recorded before the wording was fixed said `ceiling -> None`
        msg = msg.replace(" -> None (", " -> none (lifted) (")
    extra = f" (risk {d['risk']:.2f})" if isinstance(d.get("risk"), (int, float)) else ""
    gpu = f"GPU{e['gpu']} " if e.get("gpu") is not None else ""
    return f"{clock(e['ts'])[:8]} {e['kind']:<15} {gpu}{msg}{extra}"


def event_lines(events: list[dict[str, Any]], n: int, width: int) -> list[Text]:
    out = [Text(ellipsize(event_text(e), width), style=SEVERITY_STYLE.get(e.get("severity"), ""))
           for e in events[-n:]]
    return out or [Text("no events yet", style="dim")]


def header(kind: str, label: str, cursor_us: int | None, extra: str, paused: bool) -> Text:
    badge = {"live": ("● LIVE", "bold green"), "replay": ("◆ REPLAY", "bold cyan"),
             "follow": ("◉ FOLLOW", "bold magenta")}[kind]
    if kind == "live" and "REPLAY" in label:  # a recording played as live must never pass for live
        badge = ("◆ REPLAY", "bold cyan")
    t = Text.assemble(badge, " ", (" gpuwatch ", "bold reverse"), " ", clock(cursor_us))
    t.no_wrap = True
    if paused:
        t.append("  ‖ PAUSED", style="bold yellow")
    if extra:
        t.append("  " + extra)
    t.append("  " + label, style="bold")  # last: the first thing a narrow terminal cuts
    return t


PROC_SORTS = ("memory", "pid", "user", "command", "gpu")


def proc_rows(latest: dict[Any, dict[str, Any]], names: dict[int, tuple[str, str]]) -> list[dict[str, Any]]:
    """Every process on every GPU at the cursor: gpu, pid, GPU memory (NVML's compute-apps), SM and
    memory utilization where NVML gave them, user and command where known: as recorded with the sample
    (the sampler adds them once a second), else from `names` (pid -> both; a live screen's own lookup)."""
    out = []
    for g, row in latest.items():
        for p in (row or {}).get("gpu_procs") or []:
            pid = p.get("pid")
            user, cmd = p.get("user"), p.get("command")
            if user is None and cmd is None:
                user, cmd = names.get(pid, ("-", "-"))
            user, cmd = user or "-", cmd or "-"
            out.append({"gpu": g, "pid": pid, "used_bytes": p.get("used_bytes"), "sm_pct": p.get("sm_util_pct"),
                        "mem_pct": p.get("mem_util_pct"), "user": user, "command": cmd})
    return out


def sort_procs(rows: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    if key == "memory":
        return sorted(rows, key=lambda r: (-(r["used_bytes"] or 0), r["pid"] or 0))
    if key in ("user", "command"):
        return sorted(rows, key=lambda r: (str(r[key]).lower(), r["pid"] or 0))
    if key == "gpu":
        return sorted(rows, key=lambda r: (r["gpu"] if r["gpu"] is not None else -1, -(r["used_bytes"] or 0)))
    return sorted(rows, key=lambda r: r["pid"] or 0)


def proc_lines(rows: list[dict[str, Any]], key: str, n: int, width: int) -> list[Text]:
    """A process table like nvitop's: the first `n` rows after sorting by `key`, commands cut last."""
    head = Text(f"{'GPU':>3} {'PID':>8} {'USER':<10} {'GPU MEM':>9} {'SM%':>4} {'MEM%':>4}  COMMAND"
                f"  sorted by {key}; o: sort", style="bold")  # whole at 80 columns (80 with `command`)
    out = [head]
    for r in sort_procs(rows, key)[:max(0, n - 1)]:
        line = (f"{_f(r['gpu']):>3} {_f(r['pid']):>8} {str(r['user'])[:10]:<10} {fmt_bytes(r['used_bytes']):>9} "
                f"{_f(r['sm_pct']):>4} {_f(r['mem_pct']):>4}  ")
        out.append(Text(line + ellipsize(str(r["command"]), max(1, width - len(line)))))
    if not rows:
        out.append(Text("no process on any GPU at this moment", style="dim"))
    return out
