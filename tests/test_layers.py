"""The layering is a contract, not a habit: import-linter checks every import (lazy ones inside
functions too) against pyproject's [tool.importlinter] contracts, and a subprocess proves the core
imports with neither Textual nor torch/transformers/scikit-learn loaded."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

CORE = ["gpuwatch.cli", "gpuwatch.control", "gpuwatch.contract", "gpuwatch.control.guard", "gpuwatch.control.policy", "gpuwatch.runtime",
        "gpuwatch.telemetry.sampler", "gpuwatch.telemetry.sampler_process", "gpuwatch.recording.reader",
        "gpuwatch.recording.writer", "gpuwatch.recording.replay_backend", "gpuwatch.recording.backends",
        "gpuwatch.predict.features", "gpuwatch.predict.model", "gpuwatch.workload.presets",
        "gpuwatch.workload.flops", "gpuwatch.workload.schedule", "gpuwatch.workload.factory",
        "gpuwatch.workload.summary", "gpuwatch.export.prometheus", "gpuwatch.ci", "gpuwatch.predict.scorer",
        "gpuwatch.resume", "gpuwatch.recording.layout", "gpuwatch.recording.ipc", "gpuwatch.atomic"]


def test_import_contracts_hold():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert exe, "import-linter is a test dependency"
    r = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "BROKEN" not in r.stdout and r.stdout.count("KEPT") >= 4


def test_core_imports_without_textual_torch_transformers(py, env):
    code = ("import sys\n" + "".join(f"import {m}\n" for m in CORE)
            + "bad = [m for m in ('textual', 'torch', 'transformers', 'sklearn') if m in sys.modules]\n"
            + "print(bad)\n")
    r = subprocess.run([py, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
