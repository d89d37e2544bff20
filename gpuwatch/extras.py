"""The optional extras of `pip install gpuwatch`, and the one line said when one that is needed is missing.

The core (watch, record, replay, follow, score, train, report, the Prometheus exporter) needs none of
them; the DeepSeek workload (`gpuwatch`/`live`, `stress`) needs torch and transformers, the training-loop
integrations need torch (and transformers + accelerate, or lightning). Whether a module is there is asked
of the import system (`importlib.util.find_spec`), which imports nothing: checking costs no torch import.
"""

from __future__ import annotations

from importlib.util import find_spec

from gpuwatch.errors import MissingExtra

__all__ = ["EXTRAS", "MissingExtra", "available", "require"]

# extra (pyproject's [project.optional-dependencies]) -> the modules it brings that gpuwatch imports
EXTRAS: dict[str, tuple[str, ...]] = {
    "workload": ("torch", "transformers"),
    "hf": ("torch", "transformers", "accelerate"),
    "lightning": ("torch", "lightning"),
}


def available(*modules: str) -> bool:
    """Whether every named top-level module can be imported (nothing is imported to find out)."""
    return all(find_spec(m) is not None for m in modules)


def require(what: str, extra: str | None = None, modules: tuple[str, ...] = ()) -> None:
    """MissingExtra (one line, exit 2) unless the modules of `extra` (or `modules`) are installed:
    `the workload needs torch and transformers: pip install 'gpuwatch[workload]'`."""
    mods = EXTRAS[extra] if extra is not None else modules
    if available(*mods):
        return
    hint = f"pip install 'gpuwatch[{extra}]'" if extra is not None else "pip install " + " ".join(mods)
    names = mods[0] if len(mods) == 1 else ", ".join(mods[:-1]) + " and " + mods[-1]
    raise MissingExtra(f"{what} needs {names}: {hint}")
