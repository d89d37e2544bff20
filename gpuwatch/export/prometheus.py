"""Live Prometheus metrics from the bus, served by the official client library (`prometheus_client`).

One custom collector reads the bus at each scrape: the latest tick's row per GPU (under dcgm-exporter's
metric names, units and labels where dcgm has the metric), the latest workload step and failure risk
per GPU, and exact cumulative counts of events (its own cursors into the channels, so nothing between
two scrapes is lost or counted twice). What only gpuwatch has is named `gpuwatch_*`. The registry is
private (never the global `REGISTRY`), so two exporters in one process do not clash.

Binds 127.0.0.1 unless told otherwise (dcgm-exporter listens on every interface by default; gpuwatch
does not). The metric table, side by side with dcgm-exporter and nvidia-smi, is docs/PROMETHEUS.md.
"""

from __future__ import annotations

import errno
import ipaddress
import re
import socket
import threading
import time
from typing import Any, Callable, Iterable, Iterator

import polars as pl
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from gpuwatch.errors import UsageError
from gpuwatch.recording.frames import ProcessMemory, own_of_rows, process_memory
from gpuwatch.recording.schema import TABLES
from gpuwatch.recording.window import GpuMeta
from gpuwatch.telemetry.bus import Bus, Event, Tick
from gpuwatch.telemetry.nvml import GpuInfo
from gpuwatch.telemetry.reasons import LIMITING, REASONS

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9400  # dcgm-exporter's port: run one or the other on a host, or pick another port
MIB = float(1 << 20)

# dcgm-exporter's labels, in its order (Hostname as it spells it; device is `nvidia<index>`).
GPU_LABELS = ("gpu", "UUID", "device", "modelName", "Hostname", "pci_bus_id")

# (metric, samples column, help, multiplier). dcgm-exporter's names and units; every one is served as
# a gauge because the client library appends `_total` to counters, which would change dcgm's names.
DCGM_FROM_SAMPLES: tuple[tuple[str, str, str, float], ...] = (
    ("DCGM_FI_DEV_GPU_UTIL", "gpu_util_pct", "GPU utilization (in %).", 1.0),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "gpu_mem_util_pct", "Memory utilization (in %).", 1.0),
    ("DCGM_FI_DEV_FB_USED", "gpu_mem_used_bytes", "Framebuffer memory used (in MiB).", 1 / MIB),
    ("DCGM_FI_DEV_FB_RESERVED", "gpu_mem_reserved_bytes", "Framebuffer memory reserved (in MiB).", 1 / MIB),
    ("DCGM_FI_DEV_FB_TOTAL", "gpu_mem_total_bytes", "Total framebuffer memory (in MiB).", 1 / MIB),
    ("DCGM_FI_DEV_GPU_TEMP", "gpu_temp_c", "GPU temperature (in C).", 1.0),
    ("DCGM_FI_DEV_SLOWDOWN_TEMP", "gpu_temp_slowdown_c", "Slowdown temperature threshold (in C).", 1.0),
    ("DCGM_FI_DEV_POWER_USAGE", "gpu_power_w", "Power draw (in W).", 1.0),
    ("DCGM_FI_DEV_ENFORCED_POWER_LIMIT", "gpu_power_limit_w", "Enforced power limit (in W).", 1.0),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "gpu_energy_mj",
     "Total energy consumption since driver load (in mJ; gpuwatch reads it every 10 s).", 1.0),
    ("DCGM_FI_DEV_SM_CLOCK", "gpu_sm_clock_mhz", "SM clock frequency (in MHz).", 1.0),
    ("DCGM_FI_DEV_MEM_CLOCK", "gpu_mem_clock_mhz", "Memory clock frequency (in MHz).", 1.0),
    ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "gpu_clocks_event_reasons",
     "Current clock event (throttle) reasons, NVML bitmask.", 1.0),
    ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "gpu_ecc_corrected", "Volatile corrected (single-bit) ECC errors.", 1.0),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "gpu_ecc_uncorrected",
     "Volatile uncorrected (double-bit) ECC errors.", 1.0),
    ("DCGM_FI_PROF_PCIE_TX_BYTES", "gpu_pcie_tx_bytes_per_s", "PCIe TX rate (in bytes per second).", 1.0),
    ("DCGM_FI_PROF_PCIE_RX_BYTES", "gpu_pcie_rx_bytes_per_s", "PCIe RX rate (in bytes per second).", 1.0),
)

# (metric, steps column, help): the latest step per GPU.
STEP_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("gpuwatch_tokens_per_second", "tokens_per_s", "Tokens processed (generated, for decode) per second, last step."),
    ("gpuwatch_tflops", "tflops", "Achieved TFLOP/s of the last step (FLOPs counted from the model config)."),
    ("gpuwatch_mfu_ratio", "mfu", "Model FLOPs utilization of the last step: tflops / dense peak (0..1)."),
    ("gpuwatch_step_time_seconds", "step_time_s", "Wall time of the last step (synchronised)."),
    ("gpuwatch_batch_size", "batch", "Sequences in the last step."),
    ("gpuwatch_seq_len", "seq_len", "Tokens per sequence in the last step."),
    ("gpuwatch_micro_batches", "micro_batches", "Micro-batches the last step ran as."),
    ("gpuwatch_next_batch_size", "next_batch", "Batch the workload plans for its next step."),
    ("gpuwatch_loss", "loss", "Train loss of the last step (NaN when non-finite)."),
    ("gpuwatch_max_abs_logit", "max_abs_logit", "Max absolute logit of the last step's output."),
    ("gpuwatch_torch_allocated_bytes", "torch_allocated_bytes", "torch.cuda.memory_allocated after the last step."),
    ("gpuwatch_torch_reserved_bytes", "torch_reserved_bytes", "torch.cuda.memory_reserved after the last step."),
    ("gpuwatch_torch_peak_bytes", "torch_peak_bytes", "torch.cuda.max_memory_allocated during the last step."),
    ("gpuwatch_step", "step", "Number of the last step."),
)

# (counter name without _total, event kind, help): per GPU, 0 from the start for every known GPU.
EVENT_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("gpuwatch_oom", "oom", "Out-of-memory errors of the workload."),
    ("gpuwatch_oom_recovered", "oom_recovered", "OOMs the workload recovered from."),
    ("gpuwatch_nonfinite", "nonfinite", "Steps with a non-finite loss or output."),
    ("gpuwatch_integrity_mismatch", "integrity_mismatch", "Integrity checks that did not match."),
    ("gpuwatch_xid_errors", "xid", "XID errors reported by the driver."),
    ("gpuwatch_gpu_lost", "gpu_lost", "GPUs that fell off the bus."),
    ("gpuwatch_risk_alarms", "risk_alarm", "Times the failure risk rose to its alarm threshold."),
    ("gpuwatch_guard_misses", "guard_miss", "Failures the guard did not prevent."),
)

# (metric, samples column, help, multiplier): host and monitored-process columns, one value per tick.
HOST_GAUGES: tuple[tuple[str, str, str, float], ...] = (
    ("gpuwatch_host_cpu_percent", "host_cpu_pct", "Busy % of all cores since the previous tick.", 1.0),
    ("gpuwatch_host_load1", "host_load1", "1-minute load average.", 1.0),
    ("gpuwatch_host_memory_used_bytes", "host_mem_used_bytes", "Host memory used (total - available).", 1.0),
    ("gpuwatch_host_memory_total_bytes", "host_mem_total_bytes", "Host memory total.", 1.0),
    ("gpuwatch_host_swap_used_bytes", "host_swap_used_bytes", "Swap used.", 1.0),
    ("gpuwatch_process_resident_memory_bytes", "proc_rss_bytes",
     "Resident memory of the monitored process (gpuwatch and its workload).", 1.0),
    ("gpuwatch_process_cpu_percent", "proc_cpu_pct", "CPU of the monitored process, % of one core.", 1.0),
    ("gpuwatch_sampler_tick_interval_seconds", "sampler_interval_us",
     "Time between the starts of the last two ticks.", 1e-6),
    ("gpuwatch_sampler_tick_cost_seconds", "sampler_cost_us", "Wall time the last tick's reads took.", 1e-6),
    ("gpuwatch_sampler_tick_cpu_seconds", "sampler_cpu_us", "CPU time the last tick's reads took.", 1e-6),
)


def _reason_label(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


SAMPLES = TABLES["samples"]
REASON_LABELS = {bit: _reason_label(name) for bit, name in REASONS.items()}


def parse_listen(text: str) -> tuple[str, int]:
    """`"9400"` -> ("127.0.0.1", 9400); `"0.0.0.0:9400"`, `"localhost:9400"`, `"[::1]:9400"`.
    Anything else raises UsageError (one line)."""
    s = str(text).strip()
    hint = "use PORT (binds 127.0.0.1), HOST:PORT or [IPV6]:PORT, e.g. 9400, 0.0.0.0:9400, [::1]:9400"
    if re.fullmatch(r"\d+", s):
        host, port_s = DEFAULT_HOST, s
    elif m := re.fullmatch(r"\[([^\[\]]+)\]:(\d+)", s):
        host, port_s = m.group(1), m.group(2)
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise UsageError(f"bad listen address {text!r}: {host!r} is not an IPv6 address; {hint}") from None
    elif m := re.fullmatch(r"([^:\[\]\s]+):(\d+)", s):
        host, port_s = m.group(1), m.group(2)
        if re.fullmatch(r"[\d.]+", host):
            try:
                ipaddress.IPv4Address(host)
            except ValueError:
                raise UsageError(f"bad listen address {text!r}: {host!r} is not an IPv4 address; {hint}") from None
        elif not re.fullmatch(r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                              r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?", host):
            raise UsageError(f"bad listen address {text!r}: {host!r} is not a host name; {hint}")
    elif s.startswith(":") and re.fullmatch(r":\d+", s):
        raise UsageError(f"bad listen address {text!r}: say which interface, e.g. 0.0.0.0{s} for all "
                         f"(reachable from the network) or {s[1:]} for 127.0.0.1 only")
    else:
        raise UsageError(f"bad listen address {text!r}: {hint}")
    port = int(port_s)
    if not 1 <= port <= 65535:
        raise UsageError(f"bad listen address {text!r}: port must be 1-65535")
    return host, port


def _num(v: Any) -> float | None:
    if v is None or isinstance(v, (str, bytes, list, dict)):
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


class BusCollector(Collector):
    """Reads the bus at each scrape. Thread-safe (scrapes may overlap); cursors advance only here."""

    def __init__(self, bus: Bus, gpus: list[GpuInfo], hostname: str, interval_s: float = 0.1,
                 workloads: Iterable[GpuMeta] = ()) -> None:
        self.bus, self.hostname, self.interval_s = bus, hostname, interval_s
        self.host_override: Callable[[], dict[str, Any]] | None = None  # set by attach_feed (replayed host)
        self.gpus = {g.index: g for g in gpus}
        # per GPU with a workload: its process's PID and memory cap (the runtime's GpuMeta, as the scorer's)
        self.workloads = {m.index: m for m in workloads if m.pid is not None}
        self._lock = threading.Lock()
        self._cur = {"ticks": 0, "steps": 0, "risk": 0, "events": 0}
        self.missed = {"ticks": 0, "steps": 0, "risk": 0, "events": 0}
        self._last_tick: Tick | None = None
        self._ticks = 0
        self._late = 0
        self._sampler_cpu_us = 0
        self._last_step: dict[Any, dict[str, Any]] = {}
        self._steps: dict[Any, int] = {}
        self._tokens: dict[Any, float] = {}
        self._last_risk: dict[tuple[Any, str], dict[str, Any]] = {}
        self._events: dict[tuple[str, str], int] = {}
        self._per_gpu: dict[tuple[str, Any], int] = {}
        self._guard: dict[tuple[Any, str], int] = {}
        self._last_xid: dict[Any, float] = {}
        # the exporter's own cost, filled in by the registry after each scrape
        self.scrapes = 0
        self.scrape_cpu_ns = 0
        self.scrape_wall_ns = 0
        self.last_scrape_wall_ns = 0

    def describe(self) -> Iterable[Any]:
        return []  # no collect() at registration: that would move the cursors

    # -- labels -------------------------------------------------------------------------------------
    def labels(self, gpu: Any) -> list[str]:
        if gpu is None:  # a workload on the CPU
            return ["cpu", "", "cpu", "", self.hostname, ""]
        info = self.gpus.get(gpu)
        return [str(gpu), (info.uuid or "") if info else "", f"nvidia{gpu}",
                info.name if info else "", self.hostname, (info.pci_bus_id or "") if info else ""]

    # -- reading the bus ----------------------------------------------------------------------------
    def _since(self, name: str) -> list[Any]:
        items, self._cur[name], missed = getattr(self.bus, name).since(self._cur[name])
        self.missed[name] += missed
        return items

    def _ingest(self) -> None:
        late_us = 2 * self.interval_s * 1e6
        for t in self._since("ticks"):
            self._last_tick = t
            self._ticks += 1
            row = t.rows[0] if t.rows else {}
            self._sampler_cpu_us += row.get("sampler_cpu_us") or 0
            if (row.get("sampler_interval_us") or 0) > late_us:
                self._late += 1
        for s in self._since("steps"):
            g = s.get("gpu")
            self._last_step[g] = s
            self._steps[g] = self._steps.get(g, 0) + 1
            tps, st = _num(s.get("tokens_per_s")), _num(s.get("step_time_s"))
            if tps is not None and st is not None and tps == tps:
                self._tokens[g] = self._tokens.get(g, 0.0) + round(tps * st)
        for r in self._since("risk"):
            self._last_risk[(r.get("gpu"), str(r.get("kind") or "oom"))] = r
        ev: Event
        for ev in self._since("events"):
            key = (ev.kind, ev.severity)
            self._events[key] = self._events.get(key, 0) + 1
            self._per_gpu[(ev.kind, ev.gpu)] = self._per_gpu.get((ev.kind, ev.gpu), 0) + 1
            detail = ev.detail if isinstance(ev.detail, dict) else {}
            if ev.kind == "guard_action":
                k = (ev.gpu, str(detail.get("action") or "unknown"))
                self._guard[k] = self._guard.get(k, 0) + 1
            elif ev.kind == "xid" and _num(detail.get("xid")) is not None:
                self._last_xid[ev.gpu] = _num(detail.get("xid"))

    def process_memory(self, row: dict[str, Any]) -> ProcessMemory | None:
        """The workload process's own memory on a tick row's GPU and the limit it meets, by the one rule
        the risk features and the report read (recording/frames.py process_memory; torch's reserved
        bytes of the GPU's last step). None where no workload of this process runs on the GPU."""
        meta = self.workloads.get(row.get("gpu"))
        if meta is None:
            return None
        cols = ("gpu_mem_used_bytes", "gpu_mem_reserved_bytes", "gpu_mem_total_bytes")
        frame = pl.DataFrame({c: [row.get(c)] for c in cols}, schema={c: SAMPLES[c] for c in cols})
        step = self._last_step.get(row.get("gpu")) or {}
        reserved = _num(step.get("torch_reserved_bytes"))
        return process_memory(frame, meta.pid, float(meta.mem_limit_bytes) if meta.mem_limit_bytes else None,
                              reserved, meta.mem_total_bytes, own_of_rows([row], meta.pid))

    # -- the scrape ---------------------------------------------------------------------------------
    def collect(self) -> Iterator[Any]:
        with self._lock:
            self._ingest()
            return iter(list(self._families()))

    def _families(self) -> Iterator[Any]:
        """The table of every metric family served, in exposition order: dcgm-exporter's names first,
        then gpuwatch's own (GPU, host, workload, risk, guard, recorder). One flat list on purpose - a
        family added or renamed is one entry here - so it is long as a table is, not as logic is."""
        lab = list(GPU_LABELS)
        tick = self._last_tick
        rows = [r for r in (tick.rows if tick else []) if r.get("gpu") is not None]
        host_row = tick.rows[0] if tick and tick.rows else {}
        if self.host_override is not None:  # `watch --source`: the recorded host's figures, not this machine's
            host_row = {**host_row, **self.host_override()}
        known = sorted(set(self.gpus) | {r["gpu"] for r in rows})

        # GPU telemetry under dcgm-exporter's names
        count = GaugeMetricFamily("DCGM_FI_DEV_COUNT", "Number of GPUs gpuwatch monitors.", labels=["Hostname"])
        count.add_metric([self.hostname], len(self.gpus))
        yield count
        for name, col, help_, mult in DCGM_FROM_SAMPLES:
            fam = GaugeMetricFamily(name, help_, labels=lab)
            for r in rows:
                v = _num(r.get(col))
                if v is not None:
                    fam.add_metric(self.labels(r["gpu"]), v * mult)
            yield fam
        free = GaugeMetricFamily("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", labels=lab)
        for r in rows:
            total, used = _num(r.get("gpu_mem_total_bytes")), _num(r.get("gpu_mem_used_bytes"))
            if total is not None and used is not None:
                free.add_metric(self.labels(r["gpu"]),
                                (total - used - (_num(r.get("gpu_mem_reserved_bytes")) or 0.0)) / MIB)
        yield free
        xid = GaugeMetricFamily("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered.", labels=lab)
        for g in known:
            xid.add_metric(self.labels(g), self._last_xid.get(g, 0.0))
        yield xid

        # GPU: what only gpuwatch has
        up = GaugeMetricFamily("gpuwatch_gpu_up", "1 if the GPU is in the latest tick, 0 if it is not "
                               "(lost, or no tick yet).", labels=lab)
        present = {r["gpu"] for r in rows}
        for g in known:
            up.add_metric(self.labels(g), 1.0 if g in present else 0.0)
        yield up
        reason = GaugeMetricFamily("gpuwatch_clocks_event_reason", "1 while this clock event (throttle) "
                                   "reason is active (decoded DCGM_FI_DEV_CLOCKS_EVENT_REASONS).",
                                   labels=lab + ["reason"])
        limited = GaugeMetricFamily("gpuwatch_clocks_limited", "1 while a reason that holds a busy GPU "
                                    "back is active (power cap, HW slowdown, thermal, power brake).", labels=lab)
        procs = GaugeMetricFamily("gpuwatch_gpu_compute_processes", "Compute processes on the GPU.", labels=lab)
        for r in rows:
            mask = r.get("gpu_clocks_event_reasons")
            if mask is not None:
                for bit, rl in REASON_LABELS.items():
                    reason.add_metric(self.labels(r["gpu"]) + [rl], 1.0 if int(mask) & bit else 0.0)
                limited.add_metric(self.labels(r["gpu"]), 1.0 if int(mask) & LIMITING else 0.0)
            if r.get("gpu_procs") is not None:
                procs.add_metric(self.labels(r["gpu"]), float(len(r["gpu_procs"])))
        yield reason
        yield limited
        yield procs
        own = GaugeMetricFamily("gpuwatch_workload_gpu_memory_used_bytes", "GPU memory the workload's own "
                                "process holds (its entry in NVML's process list), latest tick; absent where NVML "
                                "does not list it (another PID namespace).", labels=lab)
        own_limit = GaugeMetricFamily("gpuwatch_workload_gpu_memory_limit_bytes", "What the workload process's "
                                      "memory is measured against: its memory cap + its memory outside torch, or "
                                      "what the card leaves it beside the other processes.", labels=lab)
        own_ratio = GaugeMetricFamily("gpuwatch_workload_gpu_memory_used_ratio", "The workload process's own GPU "
                                      "memory / its limit (0..1; the risk features' mem_used_frac).", labels=lab)
        for r in rows:
            m = self.process_memory(r)
            if m is None or not m.own or not m.used.size or m.used[-1] != m.used[-1]:
                continue
            ls = self.labels(r["gpu"])
            own.add_metric(ls, float(m.used[-1]))
            if m.limit:
                own_limit.add_metric(ls, float(m.limit))
                own_ratio.add_metric(ls, float(m.used[-1]) / m.limit)
        yield from (own, own_limit, own_ratio)

        # host, monitored process, sampler
        for name, col, help_, mult in HOST_GAUGES:
            fam = GaugeMetricFamily(name, help_, labels=["Hostname"])
            v = _num(host_row.get(col))
            if v is not None:
                fam.add_metric([self.hostname], v * mult)
            yield fam
        cores = GaugeMetricFamily("gpuwatch_host_cpu_core_percent", "Busy % of each core (1 Hz).",
                                  labels=["Hostname", "core"])
        for i, v in enumerate(host_row.get("host_cpu_per_core_pct") or []):
            if v is not None:
                cores.add_metric([self.hostname, str(i)], float(v))
        yield cores
        ts = GaugeMetricFamily("gpuwatch_last_sample_timestamp_seconds", "When the latest tick started "
                               "(Unix time): a stalled sampler shows here.", labels=["Hostname"])
        if tick is not None:
            ts.add_metric([self.hostname], tick.ts_us / 1e6)
        yield ts
        for name, value, help_ in (
            ("gpuwatch_sampler_ticks", self._ticks, "Sampler ticks read from the bus."),
            ("gpuwatch_sampler_late_ticks", self._late,
             f"Ticks that started more than one interval late (interval > {2 * self.interval_s:g} s)."),
            ("gpuwatch_sampler_cpu_seconds", self._sampler_cpu_us / 1e6,
             "CPU time the sampler's reads took (rate() = fraction of one core)."),
        ):
            c = CounterMetricFamily(name, help_, labels=["Hostname"])
            c.add_metric([self.hostname], value)
            yield c

        # workload: the latest step per GPU, and totals
        step_keys = sorted(self._last_step, key=lambda g: (g is None, g if g is not None else 0))
        for name, col, help_ in STEP_GAUGES:
            fam = GaugeMetricFamily(name, help_, labels=lab)
            for g in step_keys:
                v = _num(self._last_step[g].get(col))
                if v is not None:
                    fam.add_metric(self.labels(g), v)
            yield fam
        sts = GaugeMetricFamily("gpuwatch_last_step_timestamp_seconds", "When the last step ended (Unix time).",
                                labels=lab)
        info = InfoMetricFamily("gpuwatch_workload", "The last step's mode, schedule phase, precision and "
                                "experts implementation.", labels=lab)
        for g in step_keys:
            s = self._last_step[g]
            if _num(s.get("ts")) is not None:
                sts.add_metric(self.labels(g), _num(s["ts"]) / 1e6)
            info.add_metric(self.labels(g), {k: str(s.get(k) or "") for k in
                                             ("mode", "phase", "precision", "expert_impl")})
        yield sts
        yield info
        for name, data, help_ in (("gpuwatch_steps", self._steps, "Workload steps."),
                                  ("gpuwatch_tokens", self._tokens, "Tokens processed (tokens/s x step time).")):
            c = CounterMetricFamily(name, help_, labels=lab)
            for g in step_keys:
                c.add_metric(self.labels(g), data.get(g, 0))
            yield c

        # failure risk: the latest scoring per GPU and kind
        risk = GaugeMetricFamily("gpuwatch_failure_risk", "The model's risk that this failure happens within "
                                 "its horizon (0..1; above the alarm threshold it ranks by how far the plan's "
                                 "estimated peak lies over the usable limit), latest scoring.", labels=lab + ["kind"])
        alarm = GaugeMetricFamily("gpuwatch_risk_alarm", "1 while the risk is at or above the alarm threshold.",
                                  labels=lab + ["kind"])
        thr = GaugeMetricFamily("gpuwatch_risk_threshold", "The model's alarm threshold.", labels=lab + ["kind"])
        rts = GaugeMetricFamily("gpuwatch_last_risk_timestamp_seconds", "When the window was scored (Unix time).",
                                labels=lab + ["kind"])
        model = InfoMetricFamily("gpuwatch_risk_model", "The model file and its sha256 prefix.",
                                 labels=lab + ["kind"])
        for (g, kind), r in sorted(self._last_risk.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
            ls = self.labels(g) + [kind]
            for fam, v in ((risk, _num(r.get("risk"))), (alarm, _num(r.get("alarm"))),
                           (thr, _num(r.get("threshold"))),
                           (rts, None if _num(r.get("ts")) is None else _num(r.get("ts")) / 1e6)):
                if v is not None:
                    fam.add_metric(ls, v)
            model.add_metric(ls, {"model": str(r.get("model") or "")})
        yield from (risk, alarm, thr, rts, model)

        # events: exact cumulative counts (our own cursor), per GPU for the failures, by action for the guard
        for name, kind, help_ in EVENT_COUNTERS:
            c = CounterMetricFamily(name, help_, labels=lab)
            gpus = sorted({g for (k, g) in self._per_gpu if k == kind and g is not None} | set(known))
            for g in gpus:
                c.add_metric(self.labels(g), self._per_gpu.get((kind, g), 0))
            if (kind, None) in self._per_gpu:
                c.add_metric(self.labels(None), self._per_gpu[(kind, None)])
            yield c
        guard = CounterMetricFamily("gpuwatch_guard_actions", "Guard actions, by action (guard_action events).",
                                    labels=lab + ["action"])
        for (g, action), n in sorted(self._guard.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
            guard.add_metric(self.labels(g) + [action], n)
        yield guard
        evs = CounterMetricFamily("gpuwatch_events", "Events on the bus, by kind and severity.",
                                  labels=["Hostname", "kind", "severity"])
        for (kind, sev), n in sorted(self._events.items()):
            evs.add_metric([self.hostname, kind, sev], n)
        yield evs
        missed = CounterMetricFamily("gpuwatch_exporter_missed", "Items overwritten in the bus before the "
                                     "exporter read them (0 unless nothing scraped for an hour, or 10,000 "
                                     "events).", labels=["Hostname", "channel"])
        for ch, n in self.missed.items():
            missed.add_metric([self.hostname, ch], n)
        yield missed

        # the exporter's own cost (scrapes finished before this one)
        for name, value, help_ in (
            ("gpuwatch_exporter_scrapes", self.scrapes, "Scrapes served."),
            ("gpuwatch_exporter_scrape_cpu_seconds", self.scrape_cpu_ns / 1e9,
             "CPU time of the scrapes (collect + text format, the serving thread; rate() = fraction of a core)."),
            ("gpuwatch_exporter_scrape_wall_seconds", self.scrape_wall_ns / 1e9, "Wall time of the scrapes."),
        ):
            c = CounterMetricFamily(name, help_, labels=["Hostname"])
            c.add_metric([self.hostname], value)
            yield c
        last = GaugeMetricFamily("gpuwatch_exporter_last_scrape_seconds", "Wall time of the previous scrape.",
                                 labels=["Hostname"])
        last.add_metric([self.hostname], self.last_scrape_wall_ns / 1e9)
        yield last

    def scraped(self, cpu_ns: int, wall_ns: int) -> None:
        with self._lock:
            self.scrapes += 1
            self.scrape_cpu_ns += cpu_ns
            self.scrape_wall_ns += wall_ns
            self.last_scrape_wall_ns = wall_ns


class _TimedRegistry(CollectorRegistry):
    """A private registry that times each full scrape: generate_latest formats each family as this
    generator yields it, so the thread time from first to last covers collecting and formatting."""

    def __init__(self, on_done) -> None:
        super().__init__(auto_describe=False)
        self._on_done = on_done

    def collect(self):
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        try:
            yield from super().collect()
        finally:
            self._on_done(time.thread_time_ns() - c0, time.perf_counter_ns() - t0)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("gpuwatch")
    except Exception:  # noqa: BLE001 - not installed (source tree): the label just says so
        return "unknown"


class PrometheusExporter:
    """Serves the bus at http://host:port/metrics. `start()` binds (a busy port or a refused address
    raises UsageError naming host:port); `stop()` shuts the server down and frees the port."""

    def __init__(self, bus: Bus, gpus: list[GpuInfo], host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                 hostname: str | None = None, interval_s: float = 0.1, workloads: Iterable[GpuMeta] = ()) -> None:
        self.host, self.port = host, port
        self.hostname = hostname or socket.gethostname()
        self.collector = BusCollector(bus, list(gpus), self.hostname, interval_s, workloads)
        self.registry = _TimedRegistry(self.collector.scraped)
        self.registry.register(self.collector)
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, process_resident_memory_bytes...
        build = InfoMetricFamily("gpuwatch_exporter", "gpuwatch version.", value={"version": _version()})

        class _Build(Collector):
            def collect(self):
                return [build]

        self.registry.register(_Build())
        self._server = None
        self._thread: threading.Thread | None = None

    def _where(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def check(self) -> None:
        """Bind and release the address now, before a session folder is made or a workload built (a busy
        port found then left a folder with only meta.json behind, after 11 s of building)."""
        try:
            infos = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
            family, _, _, _, addr = infos[0]
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the HTTP server binds
                sock.bind(addr)
        except (socket.gaierror, OSError) as e:
            self._refused(e)

    @property
    def public(self) -> bool:
        """Bound to every interface (or a non-loopback address): reachable from the network."""
        try:
            return not ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return self.host not in ("localhost",)

    def start(self) -> None:
        if self._server is not None:
            return
        try:
            self._server, self._thread = start_http_server(self.port, self.host, registry=self.registry)
        except (socket.gaierror, OSError) as e:
            self._refused(e)
        self._thread.name = "gw-prometheus"
        self.port = self._server.server_address[1]  # the real port when asked for 0

    def _refused(self, e: OSError) -> None:
        if isinstance(e, socket.gaierror):
            raise UsageError(f"cannot serve Prometheus metrics on {self._where()}: unknown host "
                             f"({e.strerror})") from e
        why = {errno.EADDRINUSE: "address already in use (dcgm-exporter also uses 9400; pick another port)",
               errno.EACCES: "permission denied (ports below 1024 need privileges)",
               errno.EADDRNOTAVAIL: "no such address on this machine"}.get(e.errno, e.strerror or str(e))
        raise UsageError(f"cannot serve Prometheus metrics on {self._where()}: {why}") from e

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()  # ends serve_forever (it polls every 0.5 s)
        server.server_close()  # frees the port
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    @property
    def bound(self) -> tuple[str, int] | None:
        """The socket's address (host, port) while serving, else None."""
        return tuple(self._server.server_address[:2]) if self._server is not None else None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("", "0.0.0.0") else "::1" if self.host == "::" else self.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/metrics"


__all__ = ["PrometheusExporter", "parse_listen", "BusCollector", "DEFAULT_HOST", "DEFAULT_PORT"]
