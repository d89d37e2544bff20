"""The package's shape, read from its source with ast (every import, lazy ones inside functions too):
no private name (`_x`) is imported from another module - a name another module needs is public, so
renaming a private helper never breaks a distant import - and no module imports itself back through
others (an import circle), the second thing import-linter's layers contract cannot see inside a layer."""

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
