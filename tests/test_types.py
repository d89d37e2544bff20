"""The typed core stays typed: mypy over contract, control, predict, runtime and recording (the files and
settings in pyproject's [tool.mypy]) and ruff's small rule set ([tool.ruff.lint]: pyflakes and syntax)
over the same packages, both clean. Run here so that the README's one test command (what CI runs) covers
them; both are test dependencies, so a missing one fails rather than skips."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import ROOT

TYPED = ["gpuwatch/contract.py", "gpuwatch/control", "gpuwatch/predict", "gpuwatch/runtime.py", "gpuwatch/recording"]


def test_mypy_is_clean_over_the_typed_core():
    r = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    m = re.search(r"no issues found in (\d+) source files", r.stdout)
    assert m and int(m.group(1)) >= 30, r.stdout  # the configured packages, not an empty selection


def test_mypy_settings_name_the_typed_core():
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert cfg["files"] == TYPED


def test_ruff_is_clean_over_the_typed_core():
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *TYPED], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]


def test_the_checkers_catch_a_planted_mistake(tmp_path):
    """The same commands fail on a wrong type and an undefined name (they are not silently checking nothing)."""
    bad = tmp_path / "planted.py"
    bad.write_text("from gpuwatch.contract import StepPlan\n\n"
                   "def f() -> int:\n"
                   "    return StepPlan(batch='8', seq_len=4).batch + undefined_name\n")
    r = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), str(bad)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1 and "arg-type" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"),
                        str(bad)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "F821" in r.stdout, r.stdout + r.stderr
