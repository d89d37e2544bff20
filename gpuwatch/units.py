"""Parsing of human durations, sizes and replay go-to times used by flags and keys (`30s`, `100ms`,
`40GiB`, `12:03:04`), and byte formatting. Parsers raise only UsageError (one line); `parse_goto`
never raises."""

from __future__ import annotations

import math
import re
from datetime import datetime, timedelta, timezone

from gpuwatch.errors import UsageError

_DUR = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_SIZE = {
    "": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4, "pb": 1000**5, "eb": 1000**6,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4, "pib": 1024**5, "eib": 1024**6,
}
MAX_DURATION_S = 366 * 86400.0  # a year: anything longer is a typo
MAX_SIZE_BYTES = 2**60  # 1 EiB
_BIN_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB")


def _shown(text: object) -> str:
    s = repr(str(text))
    return s if len(s) <= 40 else s[:37] + "...'"


def parse_duration(text: str) -> float:
    """`"30s"`, `"100ms"`, `"1.5h"`, `"90"` (seconds) -> seconds as a float, 0 < s <= 366 days."""
    s = str(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*", s.lower(), flags=re.ASCII)
    if not m or m.group(2) not in _DUR and m.group(2) != "":
        raise UsageError(f"bad duration {_shown(s)}: use e.g. 100ms, 30s, 5m, 2h")
    value = float(m.group(1)) * _DUR.get(m.group(2) or "s", 1.0)
    if not math.isfinite(value) or value > MAX_DURATION_S:
        raise UsageError(f"bad duration {_shown(s)}: more than 366 days")
    if value <= 0:
        raise UsageError(f"bad duration {_shown(s)}: must be > 0")
    return value


def parse_size(text: str) -> int:
    """`"40GiB"`, `"512MiB"`, `"1e9"` -> bytes (int, 0 < n <= 1 EiB; exact for whole numbers)."""
    s = str(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", s.lower(), flags=re.ASCII)
    if not m or m.group(2) not in _SIZE:
        raise UsageError(f"bad size {_shown(s)}: use e.g. 40GiB, 512MiB")
    num = m.group(1)
    value: float | int = int(num) * _SIZE[m.group(2)] if num.isdigit() else float(num) * _SIZE[m.group(2)]
    if not math.isfinite(value) or value > MAX_SIZE_BYTES:
        raise UsageError(f"bad size {_shown(s)}: more than 1 EiB")
    if int(value) <= 0:
        raise UsageError(f"bad size {_shown(s)}: must be > 0")
    return int(value)


def hms(seconds: float | None) -> str:
    """Seconds as H:MM:SS (whole seconds, never negative); `-` for None."""
    if seconds is None:
        return "-"
    s = int(max(0, seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def fmt_bytes(n: float | None) -> str:
    """Bytes in binary units, 3 significant figures (1.5 GiB, 977 KiB), never scientific notation:
    a value that would round to 1000 or more of a unit is shown in the next one (1023.5 KiB is 1 MiB)."""
    if n is None:
        return "-"
    try:
        n = float(n)
    except (TypeError, ValueError):
        return "-"
    if not math.isfinite(n):
        return "-"
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in _BIN_UNITS:
        n /= 1024
        if abs(n) < 999.5:
            return f"{n:.3g} {unit}"
    return f"{n:.0f} {_BIN_UNITS[-1]}"


def parse_goto(value: str, start_us: int, end_us: int, cursor_us: int) -> float | None:
    """Where replay's go-to should move, in UTC microseconds, or None for input it cannot use (never
    raises). Accepts a UTC clock time `HH:MM[:SS[.fff]]` on the recording's first day (the next day's
    when that is before the start, for a session over midnight; None when outside the session, beyond
    a second's slack), `+90s` / `-5m` from the cursor and `50%` of the session (both clamped to it)."""
    try:
        return _parse_goto(str(value), int(start_us), int(end_us), int(cursor_us))
    except Exception:
        return None


def _parse_goto(v: str, start: int, end: int, cursor: int) -> float | None:
    v = v.strip()
    if end < start:
        return None
    # whole microseconds, compared exactly (a float of a time past 2**53 us would not be)
    clamp = lambda t: int(min(max(t, start), end))  # noqa: E731
    if m := re.fullmatch(r"(\d{1,3}(?:\.\d{1,6})?)\s*%", v, flags=re.ASCII):
        pct = float(m.group(1))  # past 100 % is clamped to the end, as `+90s` past the end is
        return clamp(start + pct / 100 * (end - start))
    if v[:1] in ("+", "-") and len(v) > 1:
        try:
            d = parse_duration(v[1:])
        except UsageError:
            return None
        return clamp(cursor + (1 if v[0] == "+" else -1) * d * 1e6)
    if m := re.fullmatch(r"(\d{1,2}):(\d{2})(?::(\d{2})(\.\d{1,6})?)?", v, flags=re.ASCII):
        h, mi, s = int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)
        if h > 23 or mi > 59 or s > 59:
            return None
        day = datetime.fromtimestamp(start / 1e6, timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
        offset = timedelta(hours=h, minutes=mi, seconds=s, microseconds=round(float(m.group(4) or 0) * 1e6))
        slack = 1_000_000
        t = (day + offset).timestamp() * 1e6
        while t < start - slack and t <= end + slack:  # over midnight: the same clock on a later day
            t += 86400e6
        if start - slack <= t <= end + slack:
            return clamp(t)
        return None
    return None
