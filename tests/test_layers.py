"""The core is headless: importing it pulls in neither Textual nor torch/transformers."""

from __future__ import annotations

import subprocess

CORE = ["gpuwatch.cli", "gpuwatch.control", "gpuwatch.runtime", "gpuwatch.telemetry.sampler", "gpuwatch.telemetry.sampler_process",
        "gpuwatch.recording.reader", "gpuwatch.recording.writer", "gpuwatch.recording.replay_backend",
        "gpuwatch.workload.presets", "gpuwatch.workload.flops", "gpuwatch.workload.schedule"]


def test_core_imports_without_textual_torch_transformers(py, env):
    code = ("import sys\n" + "".join(f"import {m}\n" for m in CORE)
            + "bad = [m for m in ('textual', 'torch', 'transformers', 'sklearn') if m in sys.modules]\n"
            + "print(bad)\n")
    r = subprocess.run([py, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_textual_only_in_ui_and_torch_only_in_workload():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "gpuwatch"
    for f in root.rglob("*.py"):
        text = f.read_text()
        rel = f.relative_to(root).as_posix()
        if "import textual" in text or "from textual" in text:
            assert rel.startswith("ui/"), rel
        if "import torch" in text or "from transformers" in text:
            assert rel.startswith("workload/"), rel
