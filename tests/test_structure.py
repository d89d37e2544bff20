"""The package's shape, read from its source with ast (every import, lazy ones inside functions too):
no private name (`_x`) is imported from another module - a name another module needs is public, so
renaming a private helper never breaks a distant import - no object reaches another's private members
(`x._name` on anything but self/cls/super()), and no module imports itself back through others (an import
circle), the second thing import-linter's layers contract cannot see inside a layer."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

PKG = ROOT / "gpuwatch"
# Circles known and owned elsewhere: delete the entry when the change that removes it lands.
KNOWN_CIRCLES: list[set[str]] = []


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _imports(mods: dict[str, Path]):
    """(module, imported module, names imported from it, line) for every gpuwatch import."""
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "gpuwatch":
                        yield name, a.name, [], node.lineno
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "gpuwatch":
                assert node.level == 0, f"{path}:{node.lineno}: relative import"
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    if sub in mods:  # `from gpuwatch.recording import schema`: the module itself
                        yield name, sub, [], node.lineno
                    else:
                        yield name, node.module, [a.name], node.lineno


def test_no_private_name_is_imported_across_modules():
    mods = _modules()
    bad = [f"{mods[m].relative_to(ROOT)}:{line}: {', '.join(names)} from {target}"
           for m, target, names, line in _imports(mods)
           if target != m and any(n.startswith("_") and not n.startswith("__") for n in names)]
    assert not bad, "private names imported from other modules:\n" + "\n".join(bad)


def _circles(edges: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative enough for ~80 nodes)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, target, _names, _line in _imports(mods):
        if target in mods and target != m:
            edges[m].add(target)
    found = [c for c in _circles(edges) if c not in KNOWN_CIRCLES]
    assert not found, "import circles: " + "; ".join(" <-> ".join(sorted(c)) for c in found)


def test_the_checks_see_what_they_look_for():
    assert _circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [{"a", "b"}]
    mods = _modules()
    found = {(m, t) for m, t, _n, _l in _imports(mods)}
    assert ("gpuwatch.runtime", "gpuwatch.telemetry.bus") in found  # a module-level import
    assert any(m == "gpuwatch.runtime" and t.startswith("gpuwatch.workload") for m, t in found)  # lazy ones


MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
# Functions allowed past MAX_FUNCTION_LINES: tables and kernels, where one flat body is the point.
LONG_FUNCTIONS_ALLOWED = {
    # the table of every Prometheus metric family served, in exposition order (one entry per family)
    "gpuwatch.export.prometheus.BusCollector._families",
}


def test_no_module_over_600_lines():
    mods = _modules()
    big = {m: n for m, p in mods.items() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not big, f"modules over {MAX_MODULE_LINES} lines (split by responsibility): {big}"


def _functions(mods: dict[str, Path]):
    """(qualified name, lines) of every function and method, nested ones too."""
    for name, path in mods.items():
        def walk(node, prefix):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    q = f"{prefix}.{child.name}"
                    if not isinstance(child, ast.ClassDef):
                        yield q, child.end_lineno - child.lineno + 1
                    yield from walk(child, q)
                else:
                    yield from walk(child, prefix)
        yield from walk(ast.parse(path.read_text(), str(path)), name)


def test_no_function_over_80_lines():
    found = dict(_functions(_modules()))
    long = {q: n for q, n in found.items() if n > MAX_FUNCTION_LINES and q not in LONG_FUNCTIONS_ALLOWED}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them, or allow a table/kernel here): {long}"
    stale = {q for q in LONG_FUNCTIONS_ALLOWED if found.get(q, 0) <= MAX_FUNCTION_LINES}
    assert not stale, f"allowed long functions that are gone or short now (drop them from the list): {stale}"



# Private members reached on another object: `x._name`, or getattr/setattr/hasattr(x, "_name"), on anything
# but `self`, `cls` or `super()`. What one object needs of another is a public method or a declared protocol
# member, so a private field can be renamed without breaking a distant reader (the C ticker once drove the
# sampler's `_stop`/`_wake` and the NVML reader's `_parr`; scoring read `ReplaySource._ts`; training called
# `RiskComposite._combine`). A third-party module's own privates (`torch._C`, `pynvml._nvmlGetFunctionPointer`)
# are reached through its module alias and allowed; a private member of a third-party *object* is allowed only
# where it is listed here with why no public member does the job, keyed "module: expression".
FOREIGN_PRIVATE_ALLOWED = {
    # transformers' Trainer keeps its own copy of the per-device batch, which a restart reads back; no setter
    "gpuwatch.integrations.hf: trainer._train_batch_size",
    # scikit-learn's HistGradientBoostingClassifier keeps its trees and baseline (the raw score before the
    # first tree) nowhere public; the scorer's pure-Python tree walk (0.36 ms a window) needs both
    "gpuwatch.predict.scorer: getattr(clf, '_predictors')",
    "gpuwatch.predict.scorer: clf._baseline_prediction",
    # transformers' switch of the MoE experts' implementation is a private config field
    "gpuwatch.workload.model: getattr(cfg, '_experts_implementation')",
    "gpuwatch.workload.model: getattr(self.model.config, '_experts_implementation')",
    "gpuwatch.workload.runner: getattr(self.model.config, '_experts_implementation')",
    # workload/tuning.py: transformers' attention and experts switches are private config fields where a
    # version refuses a registered name through the public setter; its grouped-GEMM dispatcher has no public
    # name; torch's `nn.Module.compile` has no public undo (revert clears what it set)
    "gpuwatch.workload.tuning: model.config._attn_implementation",
    "gpuwatch.workload.tuning: getattr(model.config, '_experts_implementation')",
    "gpuwatch.workload.tuning: model.config._experts_implementation",
    "gpuwatch.workload.tuning: getattr(moe, '_grouped_mm')",
    "gpuwatch.workload.tuning: setattr(m, '_compiled_call_impl')",
    # a marker gpuwatch sets on a transformers module it fused (its own attribute on a foreign object)
    "gpuwatch.workload.fastpath: getattr(mods[0], '_gw_fused')",
    "gpuwatch.workload.fastpath: mods[0]._gw_fused",
}
_PROBES = {"getattr", "setattr", "hasattr", "delattr"}


def _private(name: object) -> bool:
    return isinstance(name, str) and name.startswith("_") and not name.startswith("__")


def _module_aliases(tree: ast.AST) -> set[str]:
    """Names bound by `import x` / `import x.y as z` (not gpuwatch's own): a module's privates are its library's."""
    return {a.asname or a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
            for a in node.names} - {"gpuwatch"}


def _own_or_module(node: ast.expr, modules: set[str]) -> bool:
    """`self`, `cls` or `super()` (the object itself), or an attribute path rooted at a module alias."""
    if (isinstance(node, ast.Name) and node.id in ("self", "cls")) or (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"):
        return True
    while isinstance(node, ast.Attribute):  # torch.cuda.memory._snapshot: the root is the module alias
        node = node.value
    return isinstance(node, ast.Name) and node.id in modules


def _private_reads(tree: ast.AST):
    """(line, expression) of each private member reached on another object."""
    modules = _module_aliases(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and not _own_or_module(node.value, modules):
            yield node.lineno, ast.unparse(node)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _PROBES
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and _private(node.args[1].value)
              and not _own_or_module(node.args[0], modules)):
            yield node.lineno, f"{node.func.id}({ast.unparse(node.args[0])}, {node.args[1].value!r})"


def _private_reads_in(mods: dict[str, Path]) -> dict[str, list[str]]:
    """"module: expression" -> where, for every private member another object's code reaches in `mods`."""
    found: dict[str, list[str]] = {}
    for m, p in mods.items():
        for line, expr in _private_reads(ast.parse(p.read_text(), str(p))):
            found.setdefault(f"{m}: {expr}", []).append(f"{p.relative_to(ROOT)}:{line}")
    return found


def test_no_private_member_is_reached_across_objects():
    found = _private_reads_in(_modules())
    bad = [f"{where[0]}: {key.split(': ', 1)[1]}" for key, where in found.items() if key not in FOREIGN_PRIVATE_ALLOWED]
    assert not bad, ("private members of other objects (make it a public method or a protocol member):\n"
                     + "\n".join(bad))
    stale = FOREIGN_PRIVATE_ALLOWED - set(found)
    assert not stale, f"allowed private reads that are gone (drop them from the list): {stale}"


def test_the_private_member_check_catches_a_planted_case():
    planted = ast.parse(
        "import torch\n"
        "class A:\n"
        "    def f(self, other):\n"
        "        self._own = other._theirs\n"          # caught: another object's private field
        "        super()._build(); torch._C; torch.cuda.memory._snapshot()\n"  # the object itself, a module's
        "        getattr(other, '_probe', None)\n"      # caught: the same read through getattr
        "        getattr(self, '_mine', None)\n"
        "        return other.__class__, other.public, src.x._ts\n")  # a dunder and a public name pass
    assert [e for _l, e in _private_reads(planted)] == ["other._theirs", "getattr(other, '_probe')", "src.x._ts"]
# -- benchmarks/: measurements only, under the same rules ----------------------------------------------------
BENCH = ROOT / "benchmarks"
# Known in benchmarks/ and owned elsewhere: delete an entry when the change that removes it lands.
BENCH_LONG_FUNCTIONS_KNOWN = {
    "benchmarks.planner_curriculum.run_arm",  # issue 28's planner benchmark, owned with the planner
}
BENCH_PRIVATE_IMPORTS_KNOWN = {
    # the decode benchmark's bandwidth bound reuses the FLOP counter's per-layer counts (workload/flops.py)
    ("benchmarks.bench_decode", "gpuwatch.workload.flops", "_attn_params"),
    ("benchmarks.bench_decode", "gpuwatch.workload.flops", "_layer_counts"),
}


def _bench_modules() -> dict[str, Path]:
    return {f"benchmarks.{p.stem}": p for p in sorted(BENCH.glob("*.py"))}


def _strings_outside_docstrings(path: Path):
    """(line, text) of every string literal in code: docstrings and comments are words, not references."""
    tree = ast.parse(path.read_text(), str(path))
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and ast.get_docstring(n, clean=False) is not None}
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            yield n.lineno, n.value


def test_benchmarks_keep_the_size_rules():
    mods = _bench_modules()
    assert "benchmarks.bench_sampler" in mods and len(mods) > 20
    big = {m: n for m, p in mods.items() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not big, f"benchmarks over {MAX_MODULE_LINES} lines (split by measurement): {big}"
    found = dict(_functions(mods))
    long = {q: n for q, n in found.items() if n > MAX_FUNCTION_LINES and q not in BENCH_LONG_FUNCTIONS_KNOWN}
    assert not long, f"benchmark functions over {MAX_FUNCTION_LINES} lines: {long}"
    stale = {q for q in BENCH_LONG_FUNCTIONS_KNOWN if found.get(q, 0) <= MAX_FUNCTION_LINES}
    assert not stale, f"known long benchmark functions that are gone or short now (drop them): {stale}"


def test_benchmarks_import_no_private_gpuwatch_name():
    mods = _bench_modules()
    used = {(m, target, n) for m, target, names, _line in _imports(mods) for n in names
            if n.startswith("_") and not n.startswith("__")}
    assert not used - BENCH_PRIVATE_IMPORTS_KNOWN, f"private gpuwatch names imported by benchmarks: {used - BENCH_PRIVATE_IMPORTS_KNOWN}"
    assert not BENCH_PRIVATE_IMPORTS_KNOWN - used, f"known private imports no longer made (drop them): {BENCH_PRIVATE_IMPORTS_KNOWN - used}"


# Private members benchmarks still reach (issue 27's public seams took the rest, session 38): the decode
# benchmark times the engine's captured bodies one by one, and transformers' experts switch is a private config
# field; the scorer benchmark clears the feature module's forecast cache between rounds.
BENCH_PRIVATE_READS_KNOWN = {
    "benchmarks.bench_decode: M._cache_kw", "benchmarks.bench_decode: eng._decode_body",
    "benchmarks.bench_decode: eng._prefill_body", "benchmarks.bench_decode: eng._reset",
    "benchmarks.bench_decode: eng._st", "benchmarks.bench_decode: getattr(model.config, '_experts_implementation')",
    "benchmarks.bench_scorer: getattr(sys.modules['gpuwatch.predict.features'], '_FORECASTS')",
}


def test_benchmarks_reach_no_private_member_of_gpuwatch_objects():
    found = _private_reads_in(_bench_modules())
    bad = [f"{where[0]}: {key.split(': ', 1)[1]}" for key, where in found.items() if key not in BENCH_PRIVATE_READS_KNOWN]
    assert not bad, "benchmarks reading private members (make it a public method):\n" + "\n".join(bad)
    stale = BENCH_PRIVATE_READS_KNOWN - set(found)
    assert not stale, f"known private reads that are gone (drop them from the list): {stale}"


# Tests of a measurement tool itself, which load that one script: the held-out generator must draw from a seed
# what it drew when the protocol was fixed (951972f), and the profile's categories are checked on the CPU. What
# they test is the benchmark, so it stays in benchmarks/ (issue 27's rule is about tests that borrow from one).
BENCH_SCRIPTS_TESTED = {"test_heldout_gen.py", "test_workload_profile.py"}


def test_nothing_outside_benchmarks_runs_or_loads_them():
    """Benchmarks hold measurements only: no test loads or runs one (what tests share with them lives in
    tests/support/), and the package names none in its code (its help texts included)."""
    here = Path(__file__).resolve()
    files = [p for p in sorted((ROOT / "tests").rglob("*.py")) if p != here] + sorted(PKG.rglob("*.py"))
    found = [f"{p.relative_to(ROOT)}:{line}: {text[:60]!r}" for p in files
             for line, text in _strings_outside_docstrings(p) if "benchmarks" in text
             and p.name not in BENCH_SCRIPTS_TESTED]
    assert not found, "benchmarks/ referenced from code:\n" + "\n".join(found)
    assert not any(t for t in _imports(_modules()) if t[1].split(".")[0] == "benchmarks")
