"""The guard's per-step work cut for time (docs/BENCHMARKS.md, issue 28, "the guard's own time per step") changes nothing it decides, says or
records: the Hugging Face callback's guard over a simulated curriculum (tests/support/guard_step_sim.py: the real
callback, loop, guard, planner, live windows and shipped risk model; a fake clock) against the run recorded before
the change, tests/data/guard_step_sim.json. A deliberate change to the policy or the estimator changes that run:
record it again with

    python -c "import sys, json; sys.path.insert(0, 'tests'); from support.guard_step_sim import run; \
json.dump(run(), open('tests/data/guard_step_sim.json', 'w'), sort_keys=True, separators=(',', ':'))"
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import polars as pl
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

GOLDEN = Path(__file__).parent / "data" / "guard_step_sim.json"


def _same(a, b) -> bool:
    """Equal, floats to 1e-9 relative: another machine's BLAS or numpy may round a least-squares fit's last bits."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_hf_guard_decides_says_and_records_as_before():
    from support.guard_step_sim import run

    got, want = run(), json.loads(GOLDEN.read_text())
    assert [d["micro"] for d in got["decisions"]] == [d["micro"] for d in want["decisions"]]
    for key in ("decisions", "events", "steps", "risk"):
        assert len(got[key]) == len(want[key]), key
        for i, (a, b) in enumerate(zip(got[key], want[key])):
            assert _same(a, b), (key, i, {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if not _same(a.get(k), b.get(k))})
    assert sum(d.get("action") == "plan" for d in got["decisions"]) == 3  # 16 -> 8 -> 6 -> 4, as on the H100 (s47)


def test_plans_arrays_read_checkpointing_as_the_polars_fill_did():
    """`plans._arrays` reads the checkpointing column without a polars query: nulls are off, as fill_null(False)
    made them."""
    from gpuwatch.predict import plans

    st = pl.DataFrame({"batch": [8, 8, 4], "seq_len": [16, 32, 32], "micro_batches": [1, None, 2],
                       "precision": ["bf16", "bf16", "fp32"], "torch_allocated_bytes": [1, 2, None],
                       "torch_peak_bytes": [3, 4, 5], "step_time_s": [0.1, None, 0.3],
                       "checkpointing": [True, None, False]}, schema_overrides={"checkpointing": pl.Boolean})
    ck = plans._arrays(type("W", (), {"steps": st})())[-1]
    assert ck.dtype == bool and ck.tolist() == np.asarray(st["checkpointing"].fill_null(False).to_numpy(), dtype=bool).tolist()
    empty = plans._arrays(type("W", (), {"steps": st.clear()})())[-1]
    assert empty.dtype == bool and empty.size == 0
