"""`gpuwatch report`: every shipped recording renders to HTML and Markdown; the HTML opens in headless
Chromium with no console error and every chart drawn; bad input is one line; the health matrix holds the
values the recording itself gives."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import polars as pl
import pytest

from conftest import BENCH, RAMP, RECORDINGS, SWEEP
from gpuwatch.errors import GpuwatchError, RecordingError
from gpuwatch.recording.reader import open_recording
from gpuwatch.report import render, write_report
from gpuwatch.report.__main__ import main as report_main
from gpuwatch.report.analysis import energy
from gpuwatch.report.health import Thresholds, health_matrix

SAMPLES = sorted(p for p in RECORDINGS.glob("sample-*") if p.is_dir())
CHROMIUM = Path("/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    out = tmp_path_factory.mktemp("reports")
    done = {}
    for s in SAMPLES:
        h = write_report(s, out / f"{s.name}.html", "html")
        m = write_report(s, out / f"{s.name}.md", "md")
        done[s.name] = (h, m)
    return done


def test_every_sample_renders_to_html_and_md(reports):
    assert len(reports) == len(SAMPLES) >= 7
    for name, (h, m) in reports.items():
        html, md = h.read_text(), m.read_text()
        assert html.startswith("<!DOCTYPE html>") and name in html
        for section in ("summary", "health", "anomalies", "recommendations", "energy", "charts", "method",
                        "environment"):
            assert f'id="{section}"' in html, (name, section)
        # self-contained: no script, nothing fetched from anywhere
        assert "<script" not in html.lower()
        assert not re.search(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//""", html, re.I), name
        assert not re.search(r"url\((?!#)", html) and "@import" not in html  # url(#id): inside the SVGs
        ids = re.findall(r'\bid="([^"]+)"', html)
        assert len(ids) == len(set(ids)), name  # one document: the charts' ids must not collide
        assert html.count('<figure class="chart"') >= 5
        assert "NVIDIA H200" in html and "580.159.04" in html  # environment from meta.json
        assert md.startswith(f"# gpuwatch report: {name}") and "<svg" not in md
        assert "## Health matrix" in md and "| GPU utilization |" in md and "## Environment" in md


def _chromium(html: Path, tmp: Path) -> tuple[dict, list[str]]:
    """Open a copy of `html` with an error collector and a chart probe injected; returns (probe, console lines)."""
    probe = """<script>
window.__errs = [];
window.addEventListener('error', function (e) { var t = e.target;
  __errs.push(e.message || ('failed to load ' + ((t && (t.src || t.href)) || '?'))); }, true);
window.addEventListener('securitypolicyviolation', function (e) { __errs.push('csp: ' + e.blockedURI); });
['error', 'warn'].forEach(function (k) { var o = console[k]; console[k] = function () {
  __errs.push(k + ': ' + Array.prototype.join.call(arguments, ' ')); return o.apply(console, arguments); }; });
window.addEventListener('load', function () {
  var charts = Array.prototype.map.call(document.querySelectorAll('figure.chart'), function (f) {
    var s = f.querySelector('svg'), r = s ? s.getBoundingClientRect() : {width: 0, height: 0};
    return {id: f.id, w: r.width, h: r.height, paths: s ? s.querySelectorAll('path').length : 0,
            drawn: s ? Array.prototype.filter.call(s.querySelectorAll('path'), function (p) {
              var b = p.getBBox(); return b.width > 0 || b.height > 0; }).length : 0};
  });
  var p = document.createElement('pre'); p.id = '__probe';
  p.textContent = JSON.stringify({charts: charts, errors: __errs, title: document.title});
  document.body.appendChild(p);
});
</script>"""
    page = tmp / html.name
    page.write_text(html.read_text().replace("<head>", "<head>\n" + probe, 1))
    profile = tempfile.mkdtemp(prefix="chromium-", dir=tmp)
    r = subprocess.run([str(CHROMIUM), *FLAGS, f"--user-data-dir={profile}", "--window-size=1200,3000",
                        "--enable-logging=stderr", "--v=0", "--dump-dom", page.as_uri()],
                       capture_output=True, text=True, timeout=90)
    m = re.search(r'<pre id="__probe">(.*?)</pre>', r.stdout, re.S)
    assert m, f"{html.name}: no probe in the DOM (rc {r.returncode}): {r.stderr[-800:]}"
    text = m.group(1).replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", '"').replace("&amp;", "&")
    console = [line for line in r.stderr.splitlines() if ":CONSOLE" in line]
    return json.loads(text), console


@pytest.mark.skipif(not CHROMIUM.exists(), reason="/usr/bin/chromium absent (Debian package chromium; .ci/run installs it)")
def test_html_opens_in_chromium_without_errors_and_draws_every_chart(reports, tmp_path):
    canary = tmp_path / "canary" / "canary.html"  # the probe must see what it is there to catch
    canary.parent.mkdir()
    canary.write_text('<!DOCTYPE html><html><head><title>gpuwatch report: canary</title></head><body>'
                      '<img src="https://cdn.invalid/x.png"><figure class="chart"><svg width="0" height="0"></svg>'
                      '</figure></body></html>')
    htmls = [canary, *(h for h, _ in reports.values())]
    with ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 2))) as pool:
        results = list(pool.map(lambda h: (h, *_chromium(h, tmp_path)), htmls))
    _, probe, _ = results.pop(0)
    assert any("cdn.invalid" in e for e in probe["errors"]) and probe["charts"][0]["w"] == 0
    for html, probe, console in results:
        assert probe["errors"] == [], (html.name, probe["errors"])
        assert console == [], (html.name, console)
        assert probe["title"].startswith("gpuwatch report")
        assert len(probe["charts"]) >= 5, html.name
        for c in probe["charts"]:
            assert c["w"] > 300 and c["h"] > 80, (html.name, c)
            assert c["paths"] > 5 and c["drawn"] > 5, (html.name, c)


def _direct(session: Path, table: str) -> pl.DataFrame:
    """A table read straight from the Parquet file, not through gpuwatch's reader."""
    return pl.read_parquet(session / f"{table}.parquet")


def test_health_matrix_on_the_sweep_holds_the_recordings_own_values():
    rows = {r.name: r for r in health_matrix(open_recording(SWEEP))}
    samples, steps = _direct(SWEEP, "samples"), _direct(SWEEP, "steps")
    t0, t1 = steps["ts"].min(), steps["ts"].max()
    active = samples.filter(pl.col("ts").is_between(t0, t1))
    util = active["gpu_util_pct"].cast(pl.Float64).mean() / 100
    assert rows["GPU utilization"].value == pytest.approx(util)
    assert rows["GPU utilization"].passed is (util > 0.85)
    measured = steps.filter(~pl.col("phase").str.contains("warmup") & (pl.col("step") > 0))
    assert measured.height == 20  # 5 batches x 4 measured steps
    mfu = measured["mfu"].median()
    assert rows["Compute (TFLOP/s vs peak)"].value == pytest.approx(mfu)
    assert 0 < mfu < 1 and rows["Compute (TFLOP/s vs peak)"].passed is (mfu >= 0.6)
    # a schema-v1 session without a PID in meta.json: the one process NVML lists is the workload's
    # (frames.own_memory), measured against what the card leaves it at its peak
    own = samples["gpu_procs"].list.first().struct.field("used_bytes").cast(pl.Float64)
    i = own.arg_max()
    at = samples.row(i, named=True)
    limit = at["gpu_mem_total_bytes"] - (at["gpu_mem_used_bytes"] - own[i]) - (at.get("gpu_mem_reserved_bytes") or 0)
    assert rows["Memory (peak vs limit)"].value == pytest.approx(own[i] / limit)
    assert rows["Memory (peak vs limit)"].passed is (own[i] / limit <= 0.95)
    tmax, slow = samples["gpu_temp_c"].max(), samples["gpu_temp_slowdown_c"].min()
    assert rows["Temperature"].value == tmax and rows["Temperature"].threshold == slow - 5
    assert rows["Temperature"].passed is (tmax < slow - 5)
    held = (active["gpu_clocks_event_reasons"] & 0xEC) != 0  # LIMITING
    assert rows["Throttling"].value == pytest.approx(held.mean())
    # the thresholds are parameters: a looser MFU target passes, a huge temperature margin fails
    loose = {r.name: r for r in health_matrix(open_recording(SWEEP), Thresholds(min_mfu=mfu / 2, temp_margin_c=slow - tmax + 1))}
    assert loose["Compute (TFLOP/s vs peak)"].passed is True
    assert loose["Temperature"].passed is False


def test_health_matrix_is_na_where_a_session_has_no_data():
    rows = {r.name: r for r in health_matrix(open_recording(BENCH))}  # `gpuwatch record`: no steps
    assert rows["Compute (TFLOP/s vs peak)"].passed is None and rows["Compute (TFLOP/s vs peak)"].status == "n/a"
    assert all(r.passed is not None for n, r in rows.items() if n != "Compute (TFLOP/s vs peak)")


def test_capped_session_is_judged_against_its_cap(reports):
    capped = RECORDINGS / "sample-h200-capped-ramp-train"
    cap = json.loads((capped / "meta.json").read_text())["config"]["workloads"][0]["faults"]["memory_limit_bytes"]
    mem = {r.name: r for r in health_matrix(open_recording(capped))}["Memory (peak vs limit)"]
    own, limit = _own_peak_and_limit(capped, cap)
    assert mem.value == pytest.approx(own / limit)
    assert "cap" in mem.detail and mem.passed is False
    assert f"effective limit {cap / 2**30:.1f} GiB" in reports[capped.name][0].read_text()


def _own_peak_and_limit(session: Path, cap: int) -> tuple[float, float]:
    """Straight from the Parquet files: the workload process's highest own memory (its gpu_procs entry:
    meta.json's pid, else the one process listed) and its cap + its memory outside torch (own - torch
    reserved at the first sample after each step, median over the steps, 0..8 GiB)."""
    samples, steps = _direct(session, "samples").sort("ts"), _direct(session, "steps").sort("ts")
    pid = json.loads((session / "meta.json").read_text()).get("pid")
    procs = samples["gpu_procs"]
    if pid is None:
        own = procs.list.first().struct.field("used_bytes")
    else:
        own = procs.list.eval(pl.element().filter(pl.element().struct.field("pid") == pid)
                              .struct.field("used_bytes")).list.first()
    own = own.cast(pl.Float64).fill_null(0.0).to_list()
    ts = samples["ts"].to_list()
    outside = []
    for t, res in zip(steps["ts"].to_list(), steps["torch_reserved_bytes"].to_list()):
        j = next((k for k, u in enumerate(ts) if u >= t), None)
        if j is not None and res is not None:
            outside.append(min(8 * 2**30, max(0.0, own[j] - res)))
    outside.sort()
    n = len(outside)
    mid = (outside[n // 2] if n % 2 else (outside[n // 2 - 1] + outside[n // 2]) / 2) if n else 0.0
    return max(own), cap + mid


NEARCAP = RECORDINGS / "h200-nearcap-2026-12-01"
SIDE_BY_SIDE = sorted(p for p in NEARCAP.glob("nc-*") if p.is_dir())  # set 1: 8 workloads at once on one H200


@pytest.mark.parametrize("session", SIDE_BY_SIDE, ids=lambda p: p.name)
def test_memory_row_of_a_shared_gpu_is_the_workload_process_own(session):
    """Issue: eight capped workloads side by side on one H200 each read the whole GPU's memory against
    their own cap (5627.2 %, 1562.0 %, ..., 244.6 %). The row reads the process's own memory (the rule
    of the risk features, recording/frames.py), against its cap + its memory outside torch."""
    rec = open_recording(session)
    cap = rec.meta["config"]["workloads"][0]["faults"]["memory_limit_bytes"]
    mem = {r.name: r for r in health_matrix(rec)}["Memory (peak vs limit)"]
    own, limit = _own_peak_and_limit(session, cap)
    whole = _direct(session, "samples")["gpu_mem_used_bytes"].max()
    assert whole / cap > 2  # the GPU was shared: its whole memory is several caps
    assert mem.value == pytest.approx(own / limit) and 0.5 < mem.value < 1.05, (mem.value, mem.detail)
    assert "own memory" in mem.detail and "shared with other processes" in mem.detail
    md = render(rec, "md")
    assert "| Workload process memory | peak " in md and "(the whole GPU: every process on it)" in md


def test_one_memory_rule_for_features_report_and_exporter():
    """The process's own memory is one function (recording/frames.py): the risk features, the report's
    health row and the Prometheus exporter call it, and none of them reads `gpu_procs` by PID itself."""
    import ast

    from conftest import ROOT

    users = {"gpuwatch/predict/features.py": "process_memory", "gpuwatch/report/health.py": "own_peak",
             "gpuwatch/export/prometheus.py": "process_memory"}
    for path, name in users.items():
        text = (ROOT / path).read_text()
        tree = ast.parse(text)
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                    and n.module == "gpuwatch.recording.frames" for a in n.names}
        assert name in imported, path
        assert "own_used(" not in text and 'struct.field("pid")' not in text, path


def test_sweep_table_in_html_and_md(reports):
    html = reports[SWEEP.name][0].read_text()
    md = reports[SWEEP.name][1].read_text()
    assert 'id="sweep"' in html and 'id="chart-sweep"' in html and "## Batch sweep" in md
    steps = _direct(SWEEP, "steps").filter(~pl.col("phase").str.contains("warmup"))
    for b in (1, 8, 32, 64, 128):
        tps = steps.filter(pl.col("batch") == b)["tokens_per_s"].median()
        assert f"<td>b={b}</td>" in html and f"| b={b} |" in md
        assert f"{tps:,.0f}" in html, (b, tps)
    assert 'id="sweep"' not in reports["sample-h200-oom-inject"][0].read_text()  # no sweep, no table


def test_anomalies_say_what_was_done(reports):
    html = reports[RAMP.name][0].read_text()
    decisions = {json.loads(d)["decision"] for d in
                 _direct(RAMP, "events").filter(pl.col("kind") == "oom_recovered")["detail"]}
    assert decisions and all(d in html for d in decisions)
    fp16 = reports["sample-h200-fp16-overflow"][1].read_text()
    assert "non-finite output" in fp16 and "bf16" in fp16  # precision advice after non-finite losses
    assert "telemetry gap" in reports["sample-h200-leak-oom"][1].read_text()


def test_energy_counter_and_power_integral_agree():
    rec = open_recording(RAMP)
    by_counter = energy(rec)
    no_counter = dataclasses.replace(rec, samples=rec.samples.with_columns(pl.lit(None, pl.UInt64).alias("gpu_energy_mj")))
    by_power = energy(no_counter)
    assert by_counter["source"].startswith("energy counter") and by_power["source"] == "power integrated over time"
    assert by_counter["avg_w"] == pytest.approx(by_power["avg_w"], rel=0.05)
    assert by_counter["tokens_per_j"] == pytest.approx(by_power["tokens_per_j"], rel=0.1) and by_power["tokens_per_j"] > 1


def test_risk_chart_when_the_risk_table_has_rows(reports):
    rec = open_recording(SWEEP)
    ts = rec.samples["ts"]
    n = 40
    risk = pl.DataFrame({
        "ts": [ts.min() + timedelta(seconds=0.4 * i) for i in range(n)], "gpu": [0] * n, "kind": ["oom"] * n,
        "risk": [i / n for i in range(n)], "alarm": [i / n >= 0.5 for i in range(n)], "threshold": [0.5] * n,
        "model": ["risk.joblib 0123456789ab"] * n, "reasons": ["[]"] * n,
    }).cast({"gpu": pl.UInt8, "risk": pl.Float32, "threshold": pl.Float32})
    html = render(dataclasses.replace(rec, risk=risk), "html")
    fig = re.search(r'<figure class="chart" id="chart-risk">(.*?)</figure>', html, re.S)
    assert fig and "<path" in fig.group(1) and "alarm at 0.50" in fig.group(1)
    assert 'id="chart-risk"' not in reports[SWEEP.name][0].read_text()  # the samples' risk tables are empty


def test_html_is_escaped(tmp_path):
    odd = tmp_path / "run<b>&x"
    shutil.copytree(SWEEP, odd)
    html = write_report(odd, tmp_path / "r.html").read_text()
    assert "run&lt;b&gt;&amp;x" in html and "run<b>" not in html


def _one_line_error(capsys, argv, code=1) -> str:
    rc = report_main(argv)
    err = capsys.readouterr().err
    assert rc == code, err
    assert err.count("\n") == 1 and err.startswith("gpuwatch: error: "), err
    return err


def test_bad_inputs_are_one_line(tmp_path, capsys):
    err = _one_line_error(capsys, [str(tmp_path / "nope"), "-o", str(tmp_path / "r.html")])
    assert "nope" in err
    broken = tmp_path / "broken"
    shutil.copytree(SWEEP, broken)
    data = (broken / "samples.parquet").read_bytes()
    (broken / "samples.parquet").write_bytes(data[: len(data) // 2])
    err = _one_line_error(capsys, [str(broken), "-o", str(tmp_path / "r.html")])
    assert "samples.parquet" in err and "truncated" in err
    err = _one_line_error(capsys, [str(broken / "samples.parquet"), "-o", str(tmp_path / "r.html")])
    assert "truncated" in err
    err = _one_line_error(capsys, [str(SWEEP), "-o", str(tmp_path / "missing" / "r.html")])
    assert "does not exist" in err
    _one_line_error(capsys, [str(SWEEP), "--format", "pdf"], code=2)
    assert not list(tmp_path.glob("*.html")) and not list(tmp_path.glob(".*tmp"))
    with pytest.raises(RecordingError):
        write_report(broken, tmp_path / "r.html")
    with pytest.raises(GpuwatchError):
        write_report(SWEEP, tmp_path / "missing" / "r.html")


def test_write_is_atomic_and_format_follows_the_suffix(tmp_path, capsys):
    out = tmp_path / "ci.md"
    out.write_text("old")
    assert report_main([str(SWEEP), "-o", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert out.read_text().startswith("# gpuwatch report") and os.stat(out).st_mode & 0o777 == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["ci.md"]  # no temp file left behind


def test_report_imports_neither_textual_nor_torch(py, env):
    code = ("import sys, gpuwatch.report\n"
            "light = [m for m in ('polars', 'jinja2', 'matplotlib') if m in sys.modules]\n"
            "import gpuwatch.report.charts, gpuwatch.report.health, gpuwatch.report.analysis\n"
            "print(light, [m for m in ('textual', 'torch', 'transformers') if m in sys.modules])\n")
    r = subprocess.run([py, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[] []"  # registering the sub-command costs no heavy import


def test_a_cpu_session_and_a_two_gpu_session_render():
    rec = open_recording(SWEEP)
    gpu_cols = [c for c in rec.samples.columns if c.startswith("gpu")]
    cpu = dataclasses.replace(
        rec, meta={**rec.meta, "gpus": [], "complete": False},
        samples=rec.samples.with_columns(*(pl.lit(None).cast(rec.samples.schema[c]).alias(c) for c in gpu_cols)),
        steps=rec.steps.with_columns(pl.lit(None, pl.UInt8).alias("gpu"), pl.lit(None, pl.Float64).alias("mfu")))
    rows = {r.name: r for r in health_matrix(cpu)}
    assert all(r.passed is None for r in rows.values()), rows
    html, md = render(cpu, "html"), render(cpu, "md")
    assert 'id="chart-tokens"' in html and 'id="chart-util"' not in html and "incomplete session" in md
    two = dataclasses.replace(rec, samples=pl.concat([
        rec.samples, rec.samples.with_columns(pl.lit(1, pl.UInt8).alias("gpu"), (pl.col("gpu_temp_c") + 30).cast(pl.Int16))]))
    rows = {r.name: r for r in health_matrix(two)}
    assert rows["Temperature"].detail.startswith("GPU 1:") and rows["Temperature"].passed is False
    html = render(two, "html")
    assert ">GPU 1<" in html and html.count('<figure class="chart"') >= 8


def _cpu_session():
    rec = open_recording(SWEEP)
    gpu_cols = [c for c in rec.samples.columns if c.startswith("gpu")]
    return dataclasses.replace(
        rec, meta={**rec.meta, "gpus": []}, events=rec.events.head(0),
        samples=rec.samples.with_columns(*(pl.lit(None).cast(rec.samples.schema[c]).alias(c) for c in gpu_cols)),
        steps=rec.steps.head(0))


def test_a_session_with_no_data_is_never_a_pass():
    """Issue 17 (9): a CPU `record` session's report said "PASS - 0 of 0 health checks passed"."""
    from gpuwatch.report.analysis import anomalies, verdict

    rec = _cpu_session()
    word, sentence = verdict(health_matrix(rec), anomalies(rec, Thresholds()))
    assert word == "NO DATA" and "0 of 0" not in sentence and sentence.startswith("no data"), (word, sentence)
    assert "**NO DATA**" in render(rec, "md") and 'class="verdict v-NODATA"' in render(rec, "html")


def test_markdown_has_no_html_entities():
    """Issue 17 (12): `&gt;` in the Markdown report."""
    md = render(open_recording(SWEEP), "md")
    assert "&gt;" not in md and "&lt;" not in md and "&amp;" not in md


def test_one_throttling_figure_per_report():
    """Issue 17 (12): the matrix said 48 % (while the workload ran), the anomaly list 72.3 % (whole session)."""
    import re

    from gpuwatch.report.analysis import anomalies

    rec = open_recording(SWEEP)
    row = {r.name: r for r in health_matrix(rec)}["Throttling"]
    an = [a for a in anomalies(rec, Thresholds()) if a.kind == "throttling"]
    assert an, "the sweep is throttled by its power cap"
    said = float(re.search(r"held back in ([0-9.]+) %", an[0].example).group(1))
    assert said == pytest.approx(row.value * 100, abs=0.5), (said, row.value)


def test_a_session_whose_steps_have_no_tflops_still_reports():
    """A workload that cannot count its FLOPs (a user's own loop through the library) records null tflops:
    the report says what it has instead of failing on a None format."""
    rec = open_recording(RAMP)
    no_flops = dataclasses.replace(rec, steps=rec.steps.with_columns(pl.lit(None, pl.Float64).alias("tflops")))
    from gpuwatch.report.analysis import summary

    rows = dict(summary(no_flops, None))
    assert "tokens/s" in rows["Throughput"] and "TFLOP/s" not in rows["Throughput"]
    assert "<html" in render(no_flops, "html").lower()


# -- the report agrees with itself (issue: NO DATA above, "every check passed" below) --------------------
def test_no_data_verdict_and_recommendations_agree():
    """A session where no check could be judged said '**NO DATA**: no data: none of the 5 health checks
    could be judged' and, below it, 'Nothing to change: every check passed'."""
    md = render(_cpu_session(), "md")
    assert "**NO DATA**" in md
    recs = md.split("## Recommendations", 1)[1].split("##", 1)[0]
    assert "every check passed" not in recs and "none of the 5 health checks could be judged" in recs, recs


def test_a_failed_check_is_never_called_passed_in_the_recommendations():
    from gpuwatch.report.analysis import nothing_to_change

    from gpuwatch.report.health import Row

    ok = Row("GPU utilization", 0.9, 0.85, True, "")
    bad = Row("Memory (peak vs limit)", 1.2, 0.95, False, "")
    none = Row("Temperature", None, None, None, "no temperature samples")
    assert "every check passed" not in nothing_to_change([ok, bad], [])
    assert "Memory (peak vs limit)" in nothing_to_change([ok, bad], [])
    assert nothing_to_change([ok, none], []).startswith("Nothing to change: the 1 checks with data passed (1 had no data)")
    assert nothing_to_change([ok], []) == "Nothing to change: every check passed; no anomaly was recorded."


STEPLESS = RECORDINGS / "h200-nearcap-2026-12-01" / "nc-small-train-frag-b16"


def test_a_session_without_steps_parquet_counts_its_steps_from_the_events(tmp_path):
    """With steps.parquet deleted the report said only 'no workload steps in this session' of a session
    that ran them; the workload_stop events still say how many, and the report says the file is missing."""
    from gpuwatch.recording.recorded import recorded_steps
    from gpuwatch.recording.source import ReplaySource

    ran = _direct(STEPLESS, "steps").height
    copy = tmp_path / STEPLESS.name
    shutil.copytree(STEPLESS, copy)
    (copy / "steps.parquet").unlink()
    md = render(open_recording(copy), "md")
    note = f"{ran:,} steps (from the workload_stop events: steps.parquet is missing)"
    assert "no workload steps in this session" not in md
    assert f"| Steps | {note} |" in md and "| missing table (warning) |" in md
    assert f"| Compute (TFLOP/s vs peak) | - | >= 60.0 % | **n/a** | {note}" in md
    # the seam the replay screen's status reads (it said "workload: recorded")
    count = ReplaySource(copy).step_count()
    assert count.steps == ran and count.table_missing and count.status != "recorded" and "steps.parquet" in count.status
    whole = ReplaySource(STEPLESS).step_count()
    assert whole.status == "recorded" and whole.steps == whole.rows == ran and not whole.table_missing
    # two ranks, each its own workload_stop: counted per rank
    two = tmp_path / "two-ranks"
    shutil.copytree(RECORDINGS / "cpu-gloo-2rank-train", two)
    (two / "steps.parquet").unlink()
    rec = open_recording(two)
    assert recorded_steps(two, rec.meta, rec.steps, rec.events).steps == _direct(
        RECORDINGS / "cpu-gloo-2rank-train", "steps").height
