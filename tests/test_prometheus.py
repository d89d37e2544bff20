"""The Prometheus exporter, scraped over HTTP while a real bus is fed a real H200 recording; and the
Grafana dashboard's queries checked against what a real exporter serves."""

from __future__ import annotations

import json
import math
import re
import socket
import time
import urllib.error
import urllib.request

import polars as pl
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuwatch.errors import UsageError
from gpuwatch.export.prometheus import (DCGM_FROM_SAMPLES, STEP_GAUGES, PrometheusExporter,
                                        parse_listen)
from gpuwatch.recording.reader import open_recording
from gpuwatch.recording.replay_backend import ReplayGpuBackend
from gpuwatch.telemetry.bus import Bus, Event
from gpuwatch.telemetry.host import HostSampler
from gpuwatch.telemetry.nvml import GpuInfo
from gpuwatch.telemetry.sampler import Sampler

from conftest import RAMP, ROOT

MIB = 1024 * 1024
TICKS = 40


def _us(dt) -> int:
    return int(dt.timestamp() * 1_000_000)


def _gpus_from_meta(rec) -> list[GpuInfo]:
    """The recording's real GPU identity (the replay backend blanks UUID and PCI id)."""
    return [GpuInfo(g["index"], g["name"], g.get("uuid"), g.get("pci_bus_id"), g.get("mem_total_bytes"),
                    g.get("power_limit_w"), g.get("temp_slowdown_c")) for g in rec.meta["gpus"]]


def _feed(bus: Bus, rec, steps: int | None = None) -> None:
    """The recording's steps and events onto the bus, as the workload and the session put them there."""
    for s in rec.steps.head(steps if steps is not None else rec.steps.height).to_dicts():
        s["ts"] = _us(s["ts"])
        bus.steps.append(s)
    for e in rec.events.to_dicts():
        bus.events.append(Event(e["kind"], e["message"], e["severity"], e["gpu"],
                                json.loads(e["detail"] or "{}"), _us(e["ts"])))


def scrape(url: str) -> dict[str, dict]:
    """{family name: {"type":, "samples": [(name, labels, value)]}} parsed by the client library."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {f.name: {"type": f.type, "samples": [(s.name, s.labels, s.value) for s in f.samples]}
            for f in text_string_to_metric_families(text)}


def value(fams: dict, sample: str, **labels) -> float:
    fam = sample if sample in fams else re.sub(r"_total$", "", sample)  # text format: info is a gauge
    hits = [v for n, ls, v in fams[fam]["samples"] if n == sample and all(ls.get(k) == w for k, w in labels.items())]
    assert len(hits) == 1, (sample, labels, fams.get(fam))
    return hits[0]


@pytest.fixture(scope="module")
def fed():
    rec = open_recording(RAMP)
    bus = Bus()
    backend = ReplayGpuBackend(RAMP)
    sampler = Sampler(bus, backend, HostSampler())  # the H200's rows, this machine's host columns
    sampler.slow_tick()
    for _ in range(TICKS - 1):
        sampler.tick()
    time.sleep(0.02)  # host CPU % is a difference: give the last tick some time to measure
    sampler.tick()
    _feed(bus, rec)
    # No recording has a risk table or guard actions yet (the predictor and guard are later issues):
    # these rows and events are shaped as docs/SCHEMA.md says the scorer and the guard publish them.
    for i, r in enumerate((0.12, 0.47, 0.91)):
        bus.risk.append({"ts": bus.ticks.latest()[0].ts_us - (2 - i) * 100_000, "gpu": 0, "kind": "oom",
                         "risk": r, "alarm": r >= 0.8, "threshold": 0.8, "model": "oom-gbm.json@0123456789ab",
                         "reasons": '[["mem_slope", 0.3]]'})
    for action in ("shrink_batch", "shrink_batch", "lower_precision"):
        bus.emit("guard_action", f"guard: {action}", "warning", gpu=0, action=action, rule="risk", risk=0.91)
    bus.emit("xid", "XID 79 on GPU 0", "error", gpu=0, xid=79)
    exp = PrometheusExporter(bus, _gpus_from_meta(rec), port=0, hostname="h200-test")
    exp.start()
    yield rec, bus, exp
    exp.stop()


def test_values_equal_the_bus_latest_with_dcgm_units_and_labels(fed):
    rec, bus, exp = fed
    fams = scrape(exp.url)
    row = bus.ticks.latest()[0].rows[0]
    meta = rec.meta["gpus"][0]
    lab = {"gpu": "0", "UUID": meta["uuid"], "device": "nvidia0", "modelName": "NVIDIA H200",
           "Hostname": "h200-test", "pci_bus_id": meta["pci_bus_id"]}
    for name, col, _, mult in DCGM_FROM_SAMPLES:
        if row.get(col) is None:
            assert not fams[name]["samples"], name  # null in the recording: no sample, never a 0
            continue
        assert fams[name]["type"] == "gauge"
        assert value(fams, name, **lab) == pytest.approx(row[col] * mult, rel=1e-9), name
    assert value(fams, "DCGM_FI_DEV_FB_USED", **lab) == row["gpu_mem_used_bytes"] / MIB
    assert value(fams, "DCGM_FI_DEV_FB_FREE", gpu="0") == pytest.approx(
        (row["gpu_mem_total_bytes"] - row["gpu_mem_used_bytes"] - (row["gpu_mem_reserved_bytes"] or 0)) / MIB)
    assert value(fams, "DCGM_FI_DEV_POWER_USAGE", gpu="0") == pytest.approx(row["gpu_power_w"])
    assert value(fams, "DCGM_FI_DEV_XID_ERRORS", gpu="0") == 79  # the last XID, as dcgm reports it
    assert value(fams, "gpuwatch_gpu_up", gpu="0") == 1
    mask = row["gpu_clocks_event_reasons"]
    assert value(fams, "gpuwatch_clocks_event_reason", gpu="0", reason="sw_power_cap") == (1 if mask & 4 else 0)
    assert value(fams, "gpuwatch_sampler_tick_cpu_seconds") == pytest.approx(row["sampler_cpu_us"] / 1e6)
    assert value(fams, "gpuwatch_sampler_ticks_total") == TICKS
    assert value(fams, "gpuwatch_last_sample_timestamp_seconds") == pytest.approx(row["ts"] / 1e6)
    assert value(fams, "gpuwatch_host_cpu_percent") == pytest.approx(row["host_cpu_pct"])

    last = rec.steps.tail(1).to_dicts()[0]
    for name, col, _ in STEP_GAUGES:
        if last.get(col) is not None:
            assert value(fams, name, **lab) == pytest.approx(last[col]), name
    assert value(fams, "gpuwatch_steps_total", gpu="0") == rec.steps.height
    info = value(fams, "gpuwatch_workload_info", gpu="0", mode="train", phase=last["phase"], precision="bf16")
    assert info == 1

    kinds = dict(rec.events["kind"].value_counts().iter_rows())
    assert value(fams, "gpuwatch_oom_total", **lab) == kinds["oom"] == 5
    assert value(fams, "gpuwatch_oom_recovered_total", gpu="0") == kinds["oom_recovered"]
    assert value(fams, "gpuwatch_nonfinite_total", gpu="0") == 0  # present from the start: rate() works
    assert value(fams, "gpuwatch_events_total", kind="oom", severity="error") == 5
    assert value(fams, "gpuwatch_guard_actions_total", gpu="0", action="shrink_batch") == 2
    assert value(fams, "gpuwatch_guard_actions_total", gpu="0", action="lower_precision") == 1

    assert value(fams, "gpuwatch_failure_risk", kind="oom", **lab) == pytest.approx(0.91)
    assert value(fams, "gpuwatch_risk_alarm", kind="oom", gpu="0") == 1
    assert value(fams, "gpuwatch_risk_threshold", kind="oom", gpu="0") == pytest.approx(0.8)
    assert value(fams, "gpuwatch_risk_model_info", kind="oom", model="oom-gbm.json@0123456789ab") == 1
    assert "process_cpu_seconds_total" in {n for f in fams.values() for n, _, _ in f["samples"]}


def test_event_counts_are_exact_however_many_arrive_between_scrapes(fed):
    rec, bus, exp = fed
    before = value(scrape(exp.url), "gpuwatch_oom_total", gpu="0")
    for i in range(7000):  # most of the 10,000-event ring, between two scrapes
        bus.emit("oom", f"oom {i}", "error", gpu=0)
    fams = scrape(exp.url)
    assert value(fams, "gpuwatch_oom_total", gpu="0") == before + 7000
    assert value(fams, "gpuwatch_exporter_missed_total", channel="events") == 0
    assert value(scrape(exp.url), "gpuwatch_oom_total", gpu="0") == before + 7000  # nothing counted twice
    fams = scrape(exp.url)
    assert value(fams, "gpuwatch_exporter_scrapes_total") >= 3
    assert value(fams, "gpuwatch_exporter_scrape_cpu_seconds_total") > 0


def test_channel_since_reads_the_new_items_and_counts_the_overwritten():
    from gpuwatch.telemetry.bus import Channel

    ch = Channel(5)
    assert ch.since(0) == ([], 0, 0)
    for i in range(3):
        ch.append(i)
    assert ch.since(1) == ([1, 2], 3, 0)
    for i in range(3, 12):
        ch.append(i)
    assert ch.since(9) == ([9, 10, 11], 12, 0)
    assert ch.since(12) == ([], 12, 0)
    assert ch.since(0) == ([7, 8, 9, 10, 11], 12, 7)


def test_an_overrun_ring_is_reported_not_hidden():
    bus = Bus()
    exp = PrometheusExporter(bus, [], port=0)
    exp.start()
    try:
        for i in range(10_500):
            bus.emit("nonfinite", "x", "warning", gpu=None)
        fams = scrape(exp.url)
        assert value(fams, "gpuwatch_nonfinite_total", gpu="cpu") == 10_000
        assert value(fams, "gpuwatch_exporter_missed_total", channel="events") == 500
    finally:
        exp.stop()


def test_no_tick_yet_and_cpu_only_machine_still_serve():
    rec = open_recording(RAMP)
    bus = Bus()
    exp = PrometheusExporter(bus, _gpus_from_meta(rec), port=0)  # a GPU with no tick yet
    exp.start()
    try:
        fams = scrape(exp.url)
        assert value(fams, "gpuwatch_gpu_up", gpu="0") == 0
        assert not fams["DCGM_FI_DEV_GPU_UTIL"]["samples"]
    finally:
        exp.stop()

    bus = Bus()  # CPU-only: one row per tick with gpu=None, a workload on the CPU
    s = Sampler(bus, None, HostSampler())
    s.slow_tick()
    s.tick()
    s.tick()
    bus.steps.append({"ts": bus.ticks.latest()[0].ts_us, "step": 0, "gpu": None, "mode": "prefill",
                      "batch": 2, "tokens_per_s": 812.5, "step_time_s": 0.5, "tflops": 0.01, "mfu": None})
    exp = PrometheusExporter(bus, [], port=0)
    exp.start()
    try:
        fams = scrape(exp.url)
        row = bus.ticks.latest()[0].rows[0]
        assert row["gpu"] is None
        assert not fams["DCGM_FI_DEV_GPU_UTIL"]["samples"]
        assert value(fams, "DCGM_FI_DEV_COUNT") == 0
        assert value(fams, "gpuwatch_host_memory_total_bytes") == row["host_mem_total_bytes"]
        assert value(fams, "gpuwatch_tokens_per_second", gpu="cpu", device="cpu") == 812.5
        assert not fams["gpuwatch_mfu_ratio"]["samples"]
        assert value(fams, "gpuwatch_tokens_total", gpu="cpu") == 406
    finally:
        exp.stop()


def test_binds_loopback_by_default():
    bus = Bus()
    assert PrometheusExporter.__init__.__defaults__[0] == "127.0.0.1"
    exp = PrometheusExporter(bus, [], port=0)
    exp.start()
    try:
        host, port = exp.bound
        assert host == "127.0.0.1" and exp._server.socket.getsockname()[0] == "127.0.0.1"
        assert exp.url == f"http://127.0.0.1:{port}/metrics"
    finally:
        exp.stop()


def test_ipv6_loopback():
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    exp = PrometheusExporter(Bus(), [], host="::1", port=0)
    try:
        exp.start()
    except UsageError:
        pytest.skip("no IPv6 loopback here")
    try:
        assert exp.url.startswith("http://[::1]:")
        assert "gpuwatch_exporter_info" in urllib.request.urlopen(exp.url, timeout=5).read().decode()
    finally:
        exp.stop()


def test_port_in_use_is_a_usage_error_naming_host_port():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(UsageError, match=rf"127\.0\.0\.1:{port}: address already in use") as e:
            PrometheusExporter(Bus(), [], port=port).start()
        assert "\n" not in str(e.value)


def test_stop_frees_the_port_and_ends_the_thread():
    exp = PrometheusExporter(Bus(), [], port=0)
    exp.start()
    port, thread = exp.port, exp._thread
    scrape(exp.url)
    exp.stop()
    assert not thread.is_alive()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(exp.url, timeout=2)
    again = PrometheusExporter(Bus(), [], port=port)  # the same port, straight away
    again.start()
    again.stop()
    exp.stop()  # twice is harmless


@pytest.mark.parametrize("text, want", [
    ("9400", ("127.0.0.1", 9400)), (" 9401 ", ("127.0.0.1", 9401)), ("0.0.0.0:9400", ("0.0.0.0", 9400)),
    ("localhost:9400", ("localhost", 9400)), ("[::1]:9400", ("::1", 9400)), ("[::]:1", ("::", 1)),
    ("gpu-node-3.example.org:65535", ("gpu-node-3.example.org", 65535)),
])
def test_parse_listen_good(text, want):
    assert parse_listen(text) == want


@pytest.mark.parametrize("text", ["", "abc", "0", "65536", ":9400", "::1:9400", "[::1]", "[zz]:9400",
                                  "300.1.1.1:9400", "host:", "host:port", "a b:9400", "[::1]:0", "-1"])
def test_parse_listen_bad(text):
    with pytest.raises(UsageError) as e:
        parse_listen(text)
    assert "\n" not in str(e.value) and "listen address" in str(e.value)


# -- the Grafana dashboard and the docs against what a real exporter serves ----------------------------
PROMQL_WORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
                "offset", "bool", "inf", "nan"}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, keywords, label matchers, grouping
    labels, durations, strings and Grafana variables left out)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    e = re.sub(r"\$\{[^}]*\}|\$\w+", "1", e)  # Grafana variables
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)  # ranges and subqueries
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    names = set()
    for m in re.finditer(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)\b(\s*\()?", e):
        if m.group(2) or m.group(1).lower() in PROMQL_WORDS:
            continue
        names.add(m.group(1))
    return names


def _exprs(dashboard: dict) -> list[tuple[str, str]]:
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                if t.get("expr"):
                    out.append((p.get("title", ""), t["expr"]))
            walk(p.get("panels", []))

    walk(dashboard["panels"])
    for v in dashboard.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v.get("query")
            q = q.get("query", "") if isinstance(q, dict) else q or ""
            if m := re.fullmatch(r"label_values\((.*),\s*\w+\)", q.strip()):
                out.append(("variable " + v["name"], m.group(1)))
    return out


def test_promql_name_extraction():
    assert promql_metric_names('sum by (gpu) (rate(gpuwatch_oom_total{Hostname=~"$host"}[$__rate_interval]))') \
        == {"gpuwatch_oom_total"}
    assert promql_metric_names("DCGM_FI_DEV_FB_USED / (DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE) * 100") \
        == {"DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE"}
    assert promql_metric_names('max_over_time(a_b[5m:1m]) > bool 0.5 or on(gpu) vector(0)') == {"a_b"}


def test_grafana_dashboard_queries_only_served_metrics(fed):
    rec, bus, exp = fed
    served = {n for f in scrape(exp.url).values() for n, _, _ in f["samples"]} | set(scrape(exp.url))
    dash = json.loads((ROOT / "grafana" / "gpuwatch.json").read_text())
    assert dash["schemaVersion"] >= 39
    ds = [v for v in dash["templating"]["list"] if v.get("type") == "datasource"]
    assert ds and ds[0]["query"] == "prometheus"
    exprs = _exprs(dash)
    assert len(exprs) >= 20
    unknown = {(title, n) for title, e in exprs for n in promql_metric_names(e) if n not in served}
    assert not unknown, unknown
    used = {n for _, e in exprs for n in promql_metric_names(e)}
    for needed in ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_GPU_TEMP",
                   "DCGM_FI_DEV_SM_CLOCK", "gpuwatch_clocks_event_reason", "gpuwatch_tokens_per_second",
                   "gpuwatch_tflops", "gpuwatch_mfu_ratio", "gpuwatch_failure_risk", "gpuwatch_guard_actions_total",
                   "gpuwatch_host_cpu_percent", "gpuwatch_sampler_cpu_seconds_total",
                   "gpuwatch_exporter_scrape_cpu_seconds_total"):
        assert needed in used, needed
    ids = [p["id"] for p in _all_panels(dash["panels"])]
    assert len(ids) == len(set(ids))


def _all_panels(panels):
    for p in panels:
        yield p
        yield from _all_panels(p.get("panels", []))


def test_docs_name_every_served_metric_and_only_those(fed):
    rec, bus, exp = fed
    fams = scrape(exp.url)
    ours = {re.sub(r"_(total|info)$", "", n) for n in fams if n.startswith(("DCGM_", "gpuwatch_"))}
    doc = (ROOT / "docs" / "PROMETHEUS.md").read_text()
    documented = {re.sub(r"_(total|info)$", "", n) for n in re.findall(r"`((?:DCGM|gpuwatch)_\w+)", doc)}
    assert ours - documented == set(), "served but not in docs/PROMETHEUS.md"
    assert documented - ours == set(), "in docs/PROMETHEUS.md but not served"


def test_scrape_values_are_finite_except_a_nan_loss(fed):
    rec, bus, exp = fed
    for name, fam in scrape(exp.url).items():
        for n, _, v in fam["samples"]:
            assert not math.isinf(v), n
            assert not math.isnan(v) or n == "gpuwatch_loss", n


def test_watch_source_exports_the_recorded_host_not_this_machine():
    """Issue 17 (3): under `watch --source`, `--prometheus` exported this machine's host figures and
    name; it exports the recorded host's, as the screen shows them."""
    import json as _json

    from gpuwatch.recording.replay_backend import ReplayGpuBackend
    from gpuwatch.recording.source import LiveSource, RecordedFeed
    from gpuwatch.recording.window import GpuMeta
    from gpuwatch.telemetry.sampler import Sampler
    from gpuwatch.ui.launch import attach_feed
    from uihelpers import T0, FixedHost

    ramp = ROOT / "recordings" / "sample-h200-ramp-train"
    recorded_host = _json.loads((ramp / "meta.json").read_text())["host"]
    bus = Bus()
    backend = ReplayGpuBackend(ramp)
    fake = {"t": 0.0}
    s = Sampler(bus, backend, FixedHost(), clock=lambda: fake["t"], wall_us=lambda: T0 + int(fake["t"] * 1e6))
    g = backend.gpus[0]
    src = LiveSource(bus, [GpuMeta(0, g.name, g.mem_total_bytes, g.power_limit_w, g.temp_slowdown_c)], backend.label)
    exp = PrometheusExporter(bus, backend.gpus, port=0, hostname="this-machine")

    class S:
        workload, recorder, guard, model_note, workloads = None, None, None, "no risk model", []
    S.bus, S.source, S.exporter = bus, src, exp
    feed = RecordedFeed(bus, ramp)
    attach_feed(S, feed)
    s.slow_tick()
    for _ in range(30):
        s.tick()
        fake["t"] += 0.1
    feed.pump()
    assert feed.host_row.get("host_mem_total_bytes")
    fams = {f.name: f for f in exp.collector.collect()}
    mem = fams["gpuwatch_host_memory_total_bytes"].samples
    assert mem and mem[0].labels["Hostname"] == recorded_host != "this-machine"
    assert mem[0].value == float(feed.host_row["host_mem_total_bytes"])


SHARED = ROOT / "recordings" / "h200-nearcap-2026-12-01" / "nc-small-decode-b32"  # 8 workloads on one H200


def test_workload_process_memory_is_its_own_not_the_shared_gpus():
    """A workload beside seven others on one H200: its own memory (NVML's per-process entry), its limit
    (cap + memory outside torch) and their ratio, by the rule the risk features read (frames.py): the
    ratio is the features' mem_used_frac of the replayed window ending at that tick."""
    from gpuwatch.predict.features import features
    from gpuwatch.recording.source import ReplaySource
    from gpuwatch.telemetry.bus import Tick

    rec = open_recording(SHARED)
    src = ReplaySource(SHARED)
    row = rec.samples.filter(pl.col("gpu") == 0).sort("ts").row(3000, named=True)
    t = _us(row["ts"])
    bus = Bus()
    bus.ticks.append(Tick(1, t, [{**row, "ts": t}]))
    for s in rec.steps.filter(pl.col("ts") <= row["ts"]).sort("ts").to_dicts():
        bus.steps.append({**s, "ts": _us(s["ts"])})
    exp = PrometheusExporter(bus, _gpus_from_meta(rec), port=0, hostname="h200-test", workloads=src.gpus)
    exp.start()
    try:
        fams = scrape(exp.url)
    finally:
        exp.stop()
    pid = rec.meta["pid"]
    own = next(p["used_bytes"] for p in row["gpu_procs"] if p["pid"] == pid)
    used = value(fams, "gpuwatch_workload_gpu_memory_used_bytes", gpu="0")
    limit = value(fams, "gpuwatch_workload_gpu_memory_limit_bytes", gpu="0")
    ratio = value(fams, "gpuwatch_workload_gpu_memory_used_ratio", gpu="0")
    assert used == own and ratio == pytest.approx(used / limit)
    cap = rec.meta["config"]["workloads"][0]["faults"]["memory_limit_bytes"]
    assert cap < limit < cap + 2 * 2**30  # its cap + its memory outside torch (CUDA context, cuBLAS)
    assert value(fams, "DCGM_FI_DEV_FB_USED", gpu="0") * MIB > 20 * cap  # the whole GPU: every process on it
    assert ratio == pytest.approx(features(src.window_at(0, t))["mem_used_frac"], rel=1e-12)
    assert 0.5 < ratio < 1.0
