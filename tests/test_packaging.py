"""Issue 27 (5): a monitor that installs without torch. `pip install gpuwatch` (the core) gives watch, record,
replay, follow, score, train, eval, report and the exporter; the workload and the training-loop
integrations are extras, and a command that needs a missing one says which in one line (exit 2).

The slow test installs the core alone into a fresh venv (no system site-packages, pip's cache as usual)
and runs replay, score and report on a shipped session there, with torch not importable; it prints how
long the install took."""

from __future__ import annotations

import importlib.util
import json
import os
import pkgutil
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import RAMP, ROOT

import gpuwatch
from gpuwatch import extras

HEAVY = ("torch", "transformers", "triton", "lightning", "accelerate")
# every package and module of the core: nothing here may import torch when it is imported
CORE_PACKAGES = ("gpuwatch.cli", "gpuwatch.recording", "gpuwatch.predict", "gpuwatch.report", "gpuwatch.export",
                 "gpuwatch.telemetry", "gpuwatch.control", "gpuwatch.ui")
CORE_MODULES = ("gpuwatch.ci", "gpuwatch.runtime", "gpuwatch.backfill", "gpuwatch.resume", "gpuwatch.contract",
                "gpuwatch.extras", "gpuwatch.errors", "gpuwatch.units", "gpuwatch.atomic", "gpuwatch.integrations",
                "gpuwatch.workload", "gpuwatch.workload.presets", "gpuwatch.workload.schedule",
                "gpuwatch.workload.config", "gpuwatch.workload.factory", "gpuwatch.workload.summary")
WORKLOAD_LINE = "gpuwatch: the workload needs torch and transformers: pip install 'gpuwatch[workload]'"


def core_modules() -> list[str]:
    names = list(CORE_MODULES)
    for pkg in CORE_PACKAGES:
        names.append(pkg)
        path = [str(ROOT / pkg.replace(".", "/"))]
        names += [m.name for m in pkgutil.walk_packages(path, prefix=pkg + ".") if not m.name.endswith("__main__")]
    return names


def test_every_core_module_imports_without_torch(py, env):
    """Module import, not just the import-linter's direct imports: a module of the core that pulled torch
    in at import (itself or through anything it imports) would put it in sys.modules here."""
    mods = core_modules()
    assert "gpuwatch.cli.commands" in mods and "gpuwatch.recording.source" in mods and len(mods) > 70
    code = ("import importlib, sys\n" + f"for m in {mods!r}:\n    importlib.import_module(m)\n"
            + f"print([m for m in {HEAVY!r} if m in sys.modules])\n")
    r = subprocess.run([py, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "[]"


def _without(monkeypatch, *missing: str) -> None:
    """The import system as a core install sees it: `missing` top-level modules are not there."""
    real = importlib.util.find_spec
    monkeypatch.setattr(extras, "find_spec", lambda name, *a: None if name in missing else real(name, *a))


@pytest.mark.parametrize("argv", [["stress", "--duration", "1s"], [], ["live", "--no-record"], ["--preset", "tiny"],
                                  ["stress", "--nproc", "2"]])
def test_the_workload_without_its_extra_is_one_line(argv, monkeypatch, capsys, tmp_path):
    from gpuwatch.cli import main

    monkeypatch.chdir(tmp_path)
    _without(monkeypatch, "transformers")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip() == WORKLOAD_LINE, err
    assert not (tmp_path / "recordings").exists()  # refused before anything is built or written


def test_the_missing_extra_is_named_for_each_import_guard(monkeypatch):
    _without(monkeypatch, "torch", "accelerate", "lightning")
    with pytest.raises(ModuleNotFoundError, match=r"^the workload needs torch and transformers: pip install 'gpuwatch\[workload\]'$"):
        extras.require("the workload", "workload")
    with pytest.raises(extras.MissingExtra, match=r"needs torch, transformers and accelerate: pip install 'gpuwatch\[hf\]'"):
        extras.require("gpuwatch.integrations.hf", "hf")
    with pytest.raises(extras.MissingExtra, match=r"GuardedLoop needs torch: pip install torch$"):
        extras.require("GuardedLoop", modules=("torch",))
    extras.require("the report", modules=("jinja2",))  # there: nothing raised
    assert extras.available("polars") and not extras.available("torch")


# -- the core alone, in a fresh venv ----------------------------------------------------------------------------
def _run(cmd: list[str], env: dict, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _replay_on_a_screen(gw: Path, env: dict, cwd: Path) -> str:
    """`gpuwatch replay` drawn in a real terminal (tmux, 80x24), quit with `q`: the screen it showed."""
    sock, name = f"gw-pkg-{uuid.uuid4().hex[:8]}", "replay"
    tmux = ["tmux", "-L", sock, "-f", "/dev/null"]
    env = dict(env, TERM="xterm-256color")
    subprocess.run([*tmux, "new-session", "-d", "-s", name, "-x", "80", "-y", "24", "-c", str(cwd),
                    f"{gw} replay {RAMP}; echo EXITED $?; sleep 5"], env=env, check=True, timeout=10)
    try:
        screen, deadline = "", time.monotonic() + 60
        while "REPLAY" not in screen and time.monotonic() < deadline:
            time.sleep(0.3)
            screen = subprocess.run([*tmux, "capture-pane", "-t", name, "-p"], capture_output=True, text=True,
                                    timeout=10).stdout
        shown = screen
        subprocess.run([*tmux, "send-keys", "-t", name, "q"], timeout=10)
        while "EXITED" not in screen and time.monotonic() < deadline:
            time.sleep(0.3)
            screen = subprocess.run([*tmux, "capture-pane", "-t", name, "-p"], capture_output=True, text=True,
                                    timeout=10).stdout
        assert "EXITED 0" in screen, screen
        return shown
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True, timeout=10)


@pytest.mark.slow
def test_the_core_installs_alone_and_runs_replay_score_report_without_torch(tmp_path, capsys):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)  # no system site-packages
    py, gw = venv / "bin" / "python", venv / "bin" / "gpuwatch"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_NO_CACHE_DIR", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    t0 = time.monotonic()
    r = _run([str(py), "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off", str(ROOT)],
             env, tmp_path, timeout=1200)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with capsys.disabled():
        print(f"\n[packaging] `pip install gpuwatch` (the core, no extras) into a fresh venv: {took:.1f} s")
    # the venv's own copy, not this checkout: from its site-packages, with the model the wheel carries
    r = _run([str(py), "-c", "import gpuwatch, json; from gpuwatch.predict.model import DEFAULT_MODEL; "
              "print(json.dumps([gpuwatch.__file__, str(DEFAULT_MODEL), DEFAULT_MODEL.exists()]))"], env, tmp_path)
    where, model, shipped = json.loads(r.stdout)
    assert where.startswith(str(venv)) and model.startswith(str(venv)) and shipped, r.stdout + r.stderr
    for heavy in ("torch", "transformers"):
        r = _run([str(py), "-c", f"import {heavy}"], env, tmp_path)
        assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr, f"{heavy} is importable in the core venv"

    # replay: headless (a recorded session replayed through the live pipeline into a new recording), and on
    # a screen where tmux is there
    r = _run([str(gw), "record", "--source", str(RAMP), "--duration", "3s", "-o", str(tmp_path / "rec")], env, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    (copy,) = [p for p in (tmp_path / "rec").iterdir() if (p / "meta.json").exists()]
    assert (copy / "samples.parquet").stat().st_size > 0
    if shutil.which("tmux"):
        assert "REPLAY" in _replay_on_a_screen(gw, env, tmp_path)
    else:
        r = _run([str(gw), "replay", str(RAMP)], env, tmp_path)
        assert r.returncode == 2 and "interactive terminal" in r.stderr, r.stderr

    r = _run([str(gw), "score", str(RAMP), "--json"], env, tmp_path)  # the model the wheel carries
    assert r.returncode == 0, r.stderr[-3000:]
    score = json.loads(r.stdout)
    assert score["windows"] > 100 and score["alarms"], score

    for out in ("report.html", "report.md"):
        r = _run([str(gw), "report", str(RAMP), "-o", out], env, tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
    html = (tmp_path / "report.html").read_text()
    assert "<svg" in html and "OOM" in html  # matplotlib's charts: the core's

    # what needs an extra says which, in one line, and exits 2
    for argv in (["stress", "--preset", "tiny", "--duration", "1s"], ["--no-record"]):
        r = _run([str(gw), *argv], env, tmp_path)
        assert (r.returncode, r.stderr.strip()) == (2, WORKLOAD_LINE), r.stderr
    for mod, needle in (("gpuwatch.integrations.hf", "pip install 'gpuwatch[hf]'"),
                        ("gpuwatch.integrations.lightning", "pip install 'gpuwatch[lightning]'"),
                        ("gpuwatch.integrations.loop", "needs torch: pip install torch")):
        r = _run([str(py), "-c", f"import {mod}"], env, tmp_path)
        assert r.returncode == 1 and needle in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]
    assert not (tmp_path / "recordings").exists()
    assert gpuwatch.__file__.startswith(str(ROOT))  # this process: still the checkout's



def _pin_and_trained(name: str):
    """The core's requirement on `name` (pyproject) and the version the shipped model's manifest was made with."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.version import Version

    from gpuwatch.predict.model import DEFAULT_MODEL, read_manifest

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    req, = [r for r in map(Requirement, deps) if r.name == name]
    return req.specifier, Version(read_manifest(DEFAULT_MODEL)["versions"][name])


def test_the_scikit_learn_pin_is_the_minor_the_shipped_model_was_trained_with():
    """The shipped model loads only under the scikit-learn minor it was pickled with (model.check_manifest), so
    the core's requirement admits that minor and no other: a fresh install then always loads it."""
    from packaging.version import Version

    pin, trained = _pin_and_trained("scikit-learn")
    assert pin.contains(trained)
    assert not pin.contains(Version(f"{trained.major}.{trained.minor + 1}.0"))
    assert trained.minor == 0 or not pin.contains(Version(f"{trained.major}.{trained.minor - 1}.99"))


def test_numpy_is_required_at_the_major_the_shipped_model_was_pickled_with():
    """A numpy-2 pickle does not load under numpy 1.x (numpy 1.26.4 with scikit-learn 1.9.1: "PCG64 is not a
    known BitGenerator module"), which scikit-learn alone would allow."""
    from packaging.version import Version

    pin, trained = _pin_and_trained("numpy")
    assert pin.contains(trained)
    assert not pin.contains(Version(f"{trained.major - 1}.99.99"))
