"""`gpuwatch report SESSION -o report.html`: one self-contained file about a recorded session.

HTML (default): inline CSS and inline SVG charts, no JavaScript, no network; opens offline anywhere.
Markdown (`--format md`, or `-o x.md`): the same tables for a CI summary page, charts left out.
The file is written to a temporary name in the target folder and renamed, so a reader never sees
half a report. A session that cannot be read is one line (`RecordingError`), like everywhere else.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from typing import TYPE_CHECKING

from gpuwatch.errors import GpuwatchError, RecordingError, UsageError

if TYPE_CHECKING:  # polars, jinja2 and matplotlib load only when a report is made: the CLI's parser imports this cheaply
    from gpuwatch.recording.reader import Recording
    from gpuwatch.report.health import Row, Thresholds

__all__ = ["FORMATS", "Row", "Thresholds", "build_context", "health_matrix", "render", "run",
           "write_report"]

FORMATS = ("html", "md")
_SUFFIX = {".html": "html", ".htm": "html", ".md": "md", ".markdown": "md"}
TEMPLATES = Path(__file__).resolve().parent / "templates"


def __getattr__(name: str):
    if name in ("Row", "Thresholds", "health_matrix"):
        from gpuwatch.report import health

        return getattr(health, name)
    raise AttributeError(name)


def format_for(out: Path | None, fmt: str | None) -> str:
    if fmt:
        if fmt not in FORMATS:
            raise UsageError(f"unknown report format {fmt!r}: use html or md")
        return fmt
    return _SUFFIX.get(out.suffix.lower(), "html") if out else "html"


def build_context(rec: Recording, fmt: str = "html", th: Thresholds | None = None) -> dict[str, Any]:
    """Everything the templates show, computed once from the recording."""
    from gpuwatch.report import analysis as A
    from gpuwatch.report.health import Thresholds, health_matrix

    th = th or Thresholds()
    matrix = health_matrix(rec, th)
    anomalies = A.anomalies(rec, th)
    sweep = A.batch_table(rec)
    en = A.energy(rec)
    word, sentence = A.verdict(matrix, anomalies)
    charts = []
    sweep_chart = None
    if fmt == "html":
        from gpuwatch.report.charts import ChartMaker, make_charts

        charts = make_charts(rec, th)
        if sweep:
            sweep_chart = ChartMaker(rec, th).sweep(sweep.rows, sweep.kind)
    lines, wls = A.method(rec)
    return {
        "session": rec.path.name or str(rec.path), "path": str(rec.path),
        "generated": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "verdict": word, "verdict_text": sentence, "summary": A.summary(rec, en),
        "matrix": matrix, "thresholds": th, "anomalies": anomalies,
        "recommendations": A.recommendations(rec, matrix, th, sweep, anomalies),
        "energy": en, "charts": charts, "sweep": sweep, "sweep_chart": sweep_chart,
        "method_lines": lines, "workloads": wls, "environment": A.environment(rec),
        "has_risk": rec.risk.height > 0, "warnings": rec.warnings, **multigpu(rec),
    }


def multigpu(rec: Recording) -> dict[str, Any]:
    """A data-parallel session's ranks (whole-run medians, the straggler) and its collective check."""
    from gpuwatch.recording.ranks import collectives, rank_stats, straggler

    stats = rank_stats(rec.steps.sort("ts").to_dicts(), last=10**9) if "rank" in rec.steps.columns else []
    return {"ranks": stats, "straggler": straggler(stats), "collectives": collectives(rec.events.to_dicts())}


def _env(fmt: str):
    import jinja2

    from gpuwatch.report import analysis as A

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), autoescape=(fmt == "html"),
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                             keep_trailing_newline=True)
    env.filters["num"] = A.fmt_num
    env.filters["bytes"] = lambda n: "-" if n is None else A.fmt_bytes(n)
    env.filters["ms"] = lambda s: "-" if s is None else f"{s * 1000:.1f}"
    env.filters["pct"] = lambda x: "-" if x is None else f"{x * 100:.1f} %"
    env.filters["duration"] = A.fmt_duration
    env.filters["md"] = _md_cell
    return env


def _md_cell(x: Any) -> str:
    """A value safe inside a Markdown table cell (and not read as HTML by GitHub)."""
    text = " ".join(str(x).split())
    # `<` backslash-escaped so no renderer reads a tag; `>` needs nothing inside a cell, and `&gt;`
    # showed up as such in the Markdown as read in a terminal or an editor
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("<", "\\<")


def render(rec: Recording, fmt: str = "html", th: Thresholds | None = None) -> str:
    ctx = build_context(rec, fmt, th)
    return _env(fmt).get_template(f"report.{fmt}.j2").render(**ctx)


def _check_target(out: Path) -> None:
    """Before the work: `out` can be written (one line, exit 1, where not)."""
    from gpuwatch.atomic import check_output_file

    check_output_file(out, None, example="report.html", error=GpuwatchError)


def _atomic_write(out: Path, text: str) -> None:
    from gpuwatch.atomic import write_file

    _check_target(out)
    try:
        write_file(out, text, mode=0o644)
    except OSError as e:
        raise GpuwatchError(f"{out}: cannot write the report ({e.strerror or e})") from None


def load(session: Path) -> Recording:
    from gpuwatch.recording.reader import open_recording

    rec = open_recording(session)
    if rec.samples.is_empty():
        why = rec.warnings[0] if rec.warnings else f"{session}: no samples recorded"
        raise RecordingError(f"{why} (a report needs the samples table)")
    return rec


def write_report(session: Path, out: Path, fmt: str = "html", thresholds: Thresholds | None = None) -> Path:
    """Render `session` to `out` atomically; returns `out`. Raises GpuwatchError (one line)."""
    session, out = Path(session), Path(out)
    fmt = format_for(None, fmt)
    _check_target(out)  # before the work, not after it
    rec = load(session)
    _atomic_write(out, render(rec, fmt, thresholds))
    return out


def run(args) -> int:
    """`gpuwatch report` (its flags are parsed by `gpuwatch.cli`): write the report and say where."""
    fmt = format_for(args.output, getattr(args, "format", None))
    out = args.output or Path(f"{Path(args.path).resolve().name}-report.{fmt}")
    write_report(Path(args.path), out, fmt)
    print(f"wrote {out} ({out.stat().st_size / 1024:.0f} KiB, {fmt})")
    return 0
