"""The sampler child's C loop (gpuwatch/telemetry/ticker.py, _ticker.c) against the stand-in libnvidia-ml.so.1
the benchmarks build (no GPU here): same rows as the Python loop, its fall-backs, a GPU lost mid-run."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, wait_for_stream
from support.fake_nvml import build_fake_nvml

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the C loop is Linux only")

TIMING = {"ts", "tick", "sampler_interval_us", "sampler_cost_us", "sampler_cpu_us"}


@pytest.fixture(scope="module")
def fake_lib(tmp_path_factory) -> Path:
    lib = build_fake_nvml(tmp_path_factory.mktemp("fake_nvml"))
    if lib is None:
        pytest.skip("no C compiler: neither the fake NVML nor the C loop can be built")
    return lib


@pytest.fixture
def fenv(env, fake_lib, tmp_path) -> dict:
    """A subprocess environment with the fake NVML (1 GPU, 20 running processes: more than the 16 the
    process array starts with) and its own compile cache."""
    return dict(env, LD_LIBRARY_PATH=str(fake_lib.parent), FAKE_NVML_GPUS="1", FAKE_NVML_PROCS="20",
                XDG_CACHE_HOME=str(tmp_path / "cache"))


def _record(py, e: dict, out: Path, seconds: int = 3, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([py, "-m", "gpuwatch", "record", "--no-model", "--duration", f"{seconds}s", "-o", str(out),
                             *flags], cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _read(p: subprocess.Popen, out: Path):
    from gpuwatch.recording.reader import open_recording

    text, _ = p.communicate(timeout=120)
    assert p.returncode == 0, text
    (sess,) = [q for q in out.iterdir() if (q / "meta.json").exists()]
    return json.loads((sess / "meta.json").read_text()), open_recording(sess)


def test_c_loop_rows_are_the_python_loops(py, fenv, tmp_path):
    runs = {"c": _record(py, fenv, tmp_path / "c"),
            "python": _record(py, dict(fenv, GPUWATCH_SAMPLER_LOOP="python"), tmp_path / "python")}
    res = {k: _read(p, tmp_path / k) for k, p in runs.items()}
    (mc, rc), (mp, rp) = res["c"], res["python"]
    assert mc["sampler_loop"] == "c", mc["sampler_loop_note"]
    assert mp["sampler_loop"] == "python" and "GPUWATCH_SAMPLER_LOOP=python" in mp["sampler_loop_note"]
    a, b = rc.samples, rp.samples
    assert a.columns == b.columns
    assert 25 <= a.height <= 36, a.height  # ~10 rows a second over 3 s
    assert a["tick"].to_list() == list(range(a.height))
    iv = a["sampler_interval_us"].drop_nulls()
    assert 95_000 <= iv.median() <= 105_000 and iv.min() > 50_000 and iv.max() < 200_000, iv.to_list()
    assert (a["sampler_cpu_us"] >= 0).all() and (a["sampler_cost_us"] >= 0).all()
    n = min(a.height, b.height)
    for col in a.columns:
        if col in TIMING or col.startswith(("host_", "proc_")):  # the host's and the process's own readings vary
            continue
        assert a[col].head(n).to_list() == b[col].head(n).to_list(), col
    procs = a["gpu_procs"][0].to_list()
    assert len(procs) == 20 and procs[0] == {"pid": 1000, "used_bytes": None, "sm_util_pct": None,  # the array grew:
                                             "mem_util_pct": None, "user": None, "command": None}  # all 20, first row
    # (utilization, user and command come with the first slow read; this stub NVML has no per-process utilization)
    assert a["gpu_procs"][-1].to_list()[0]["sm_util_pct"] is None
    assert a["host_cpu_pct"].drop_nulls().len() >= a.height - 1  # the host CPU from the C thread's pread
    # the slow reads are merged as in the Python loop: PCIe rates exist only from the second counter reading
    # (2 s in), so rows before it are null and rows after it are not - in both loops alike
    for loop in (a, b):
        pcie = loop["gpu_pcie_tx_bytes_per_s"].to_list()
        assert pcie[0] is None and pcie[-1] is not None, pcie


def test_record_gpus_samples_only_those_gpus_under_their_nvml_index(py, fenv, tmp_path):
    """`gpuwatch record --gpus 2,0` on a machine of three GPUs: the C loop reads GPUs 2 and 0 alone; rows and
    meta.json keep NVML's indices."""
    meta, rec = _read(_record(py, dict(fenv, FAKE_NVML_GPUS="3"), tmp_path / "r", 2, "--gpus", "2,0"), tmp_path / "r")
    assert meta["sampler_loop"] == "c", meta["sampler_loop_note"]
    assert [(g["index"], g["uuid"]) for g in meta["gpus"]] == [(2, "GPU-fake-3"), (0, "GPU-fake-1")]
    assert sorted(set(rec.samples["gpu"].to_list())) == [0, 2]
    assert rec.samples.filter(rec.samples["gpu"] == 2)["gpu_util_pct"].drop_nulls().len() >= 15


def test_falls_back_to_the_python_loop_when_the_compile_fails(py, fenv, tmp_path):
    meta, rec = _read(_record(py, dict(fenv, CC="/bin/false"), tmp_path / "r", seconds=2), tmp_path / "r")
    assert meta["sampler_loop"] == "python"
    assert "compile failed" in meta["sampler_loop_note"]
    assert rec.samples.height >= 15 and rec.samples["gpu_util_pct"].to_list()[0] == 97


def test_load_raises_without_a_compiler(monkeypatch, tmp_path):
    from gpuwatch.telemetry import ticker

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(OSError):
        ticker.load()
    monkeypatch.delenv("CC")
    if ticker.shutil.which("cc") or ticker.shutil.which("gcc"):
        lib = ticker.load()  # compiled into the cache, keyed by the source's hash
        assert list(tmp_path.glob("gpuwatch/ticker-*.so")) and hasattr(lib, "gw_start")


def test_a_broken_library_in_the_cache_is_built_again(monkeypatch, tmp_path):
    """A truncated .so (a killed copy, a shared home on another architecture) must not turn the C loop off for
    good: it is removed and compiled again."""
    from gpuwatch.telemetry import ticker

    if not (ticker.shutil.which("cc") or ticker.shutil.which("gcc")):
        pytest.skip("no C compiler")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    so = ticker.so_path()  # (not loaded in this process first: rewriting a mapped library would crash it)
    so.write_bytes(b"\x7fELF truncated")
    lib = ticker.load()
    assert hasattr(lib, "gw_start") and so.stat().st_size > 1000
    assert not list(tmp_path.glob("gpuwatch/.ticker-*.tmp"))


def test_gpu_lost_mid_run_is_an_event_and_the_run_goes_on(py, fenv, tmp_path):
    lost = tmp_path / "lost"
    p = _record(py, dict(fenv, FAKE_NVML_LOST_FILE=str(lost)), tmp_path / "r", seconds=5)
    # the loss after the first rows are on disk (a slower start-up, as on the GPU machine, must not lose them all)
    assert wait_for_stream(tmp_path / "r", 30)
    time.sleep(0.5)
    lost.touch()
    meta, rec = _read(p, tmp_path / "r")
    assert meta["sampler_loop"] == "c", meta["sampler_loop_note"]
    ev = rec.events.filter(rec.events["kind"] == "gpu_lost")
    assert ev.height == 1 and ev["gpu"][0] == 0
    s = rec.samples
    gone = s.filter(s["gpu"].is_null())  # rows without a GPU go on after the loss, ticks consecutive
    assert gone.height >= 5 and s.filter(s["gpu"] == 0).height >= 5
    assert s["tick"].to_list() == list(range(s.height))
    assert gone["host_cpu_pct"].drop_nulls().len() >= gone.height - 1


def test_a_field_not_supported_mid_run_is_dropped_and_the_c_loop_goes_on(py, fenv, tmp_path):
    """The temperature starts answering not-supported: null from then on (the C thread restarted without the
    call), the other fields and the tick numbers go on."""
    flag = tmp_path / "notsup"
    p = _record(py, dict(fenv, FAKE_NVML_NOTSUP_FILE=str(flag)), tmp_path / "r", seconds=5)
    assert wait_for_stream(tmp_path / "r", 30)  # rows on disk first, however slow the start-up
    time.sleep(0.5)
    flag.touch()
    time.sleep(0.5)
    flag.unlink()  # asked again it would answer: it is not asked again
    meta, rec = _read(p, tmp_path / "r")
    assert meta["sampler_loop"] == "c", meta["sampler_loop_note"]
    s = rec.samples
    temps = s["gpu_temp_c"].to_list()
    k = temps.index(None)
    assert k >= 5 and set(temps[:k]) == {60} and set(temps[k:]) == {None} and len(temps) - k >= 5
    assert s["gpu_util_pct"].null_count() == 0 and s["tick"].to_list() == list(range(s.height))
    iv = s["sampler_interval_us"].drop_nulls()
    assert iv.min() > 50_000 and iv.max() < 200_000, iv.to_list()  # the restarted C thread keeps the deadlines
    assert rec.events.filter(rec.events["kind"] == "gpu_lost").height == 0


SCRIPT = r"""
import time
from gpuwatch.telemetry.bus import Bus
from gpuwatch.telemetry.sampler_process import SamplerProcess
from gpuwatch.recording.backends import BackendFactory
bus = Bus()
sp = SamplerProcess(bus, BackendFactory(), 0.1, deliver_s=0.0)
sp.launch()
arrived = []
sp.start()
end = time.monotonic() + 2.0
seen = 0
while time.monotonic() < end:
    n = len(bus.ticks.latest(1000))
    if n > seen:
        arrived.append(n - seen)
        seen = n
    time.sleep(0.01)
sp.stop()
print(sp.loop, max(arrived), seen)
"""


def test_per_tick_delivery_with_the_c_loop(py, fenv):
    """The live dashboard asks for each tick as it is taken (deliver_s=0): the C loop wakes Python per tick."""
    out = subprocess.run([py, "-c", SCRIPT], cwd=ROOT, env=fenv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    loop, most, seen = out.stdout.split()
    assert loop == "c" and int(most) <= 2 and int(seen) >= 15, out.stdout
