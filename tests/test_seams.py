"""No object reads another object's private state: `x._name` is allowed only on `self`, `cls` and
`super()`. What one object needs of another is a public method or a declared protocol member, so a
private field can be renamed or removed without breaking a distant reader (the C ticker once drove the
sampler's `_stop`/`_wake` and the NVML reader's `_parr`; scoring read `ReplaySource._ts`).

A third-party library's private names are another matter: a module's (`torch._C`, `torch._dynamo`,
`pynvml._nvmlGetFunctionPointer`) are read through its module alias and allowed; a private attribute of a
third-party object is allowed only where it is listed below with why no public member does the job."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

SCANNED = [ROOT / "gpuwatch"]
# (module path relative to the root, the expression) -> why it cannot be public
THIRD_PARTY_PRIVATE = {
    # scikit-learn's HistGradientBoostingClassifier keeps its baseline (the raw score before the first tree)
    # nowhere public; the scorer's pure-Python tree walk (0.36 ms a window) needs it to equal predict_proba
    ("gpuwatch/predict/scorer.py", "clf._baseline_prediction"),
    # the Trainer's per-device batch is what accelerate's find_executable_batch_size resizes; transformers
    # reads it back from this attribute on a restart, with no public setter
    ("gpuwatch/integrations/hf.py", "trainer._train_batch_size"),
    # a marker gpuwatch sets on a transformers module it fused (its own attribute on a foreign object)
    ("gpuwatch/workload/fastpath.py", "mods[0]._gw_fused"),
}


def _module_aliases(tree: ast.AST) -> set[str]:
    """Names bound by `import x` / `import x.y as z` / `from pkg import module`: a private attribute of a
    module is that library's own business (torch._C), not another object's state."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out.add(a.asname or a.name.split(".")[0])
    return out


def private_reads(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    mods = _module_aliases(tree)
    rel = str(path.relative_to(ROOT))
    bad = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        v = node.value
        while isinstance(v, ast.Attribute):  # torch.cuda.memory._snapshot: the root is the module alias
            v = v.value
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        if isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name) and node.value.func.id == "super":
            continue
        if isinstance(v, ast.Name) and v.id in mods and not v.id == "gpuwatch":
            continue
        expr = ast.unparse(node)
        if (rel, expr) in THIRD_PARTY_PRIVATE:
            continue
        bad.append(f"{rel}:{node.lineno}: {expr}")
    return bad


def test_no_private_state_read_across_objects():
    bad = [b for root in SCANNED for p in sorted(root.rglob("*.py")) for b in private_reads(p)]
    assert not bad, "private attributes read on another object (make them public methods/members):\n" + "\n".join(bad)


def test_the_seam_check_sees_what_it_looks_for(tmp_path):
    p = ROOT / "gpuwatch" / "_probe_for_test_seams.py"
    try:
        p.write_text("import torch\nclass A:\n    def f(self, o):\n        self._x; super()._y; torch._C\n"
                     "        return o._z\n")
        assert [b.split(": ")[1] for b in private_reads(p)] == ["o._z"]
    finally:
        p.unlink()
