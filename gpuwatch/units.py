"""Parsing of human durations and sizes used by flags (`30s`, `100ms`, `40GiB`)."""

from __future__ import annotations

import re

from gpuwatch.errors import UsageError

_DUR = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_SIZE = {
    "": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}


def parse_duration(text: str) -> float:
    """`"30s"`, `"100ms"`, `"1.5h"`, `"90"` (seconds) -> seconds as a float > 0."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*", str(text).lower())
    if not m or m.group(2) not in _DUR and m.group(2) != "":
        raise UsageError(f"bad duration {text!r}: use e.g. 100ms, 30s, 5m, 2h")
    value = float(m.group(1)) * _DUR.get(m.group(2) or "s", 1.0)
    if value <= 0:
        raise UsageError(f"bad duration {text!r}: must be > 0")
    return value


def parse_size(text: str) -> int:
    """`"40GiB"`, `"512MiB"`, `"1e9"` -> bytes (int > 0)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if not m or m.group(2) not in _SIZE:
        raise UsageError(f"bad size {text!r}: use e.g. 40GiB, 512MiB")
    value = int(float(m.group(1)) * _SIZE[m.group(2)])
    if value <= 0:
        raise UsageError(f"bad size {text!r}: must be > 0")
    return value


def fmt_bytes(n: float | None) -> str:
    """Bytes in binary units, 3 significant figures: 1.50 GiB."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} TiB"
