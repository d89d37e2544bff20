"""`gpuwatch stress` as a CI job: one-line progress, `--fail-on` thresholds, `--summary-json` and `--junit`.

No terminal UI here (no Textual): a progress line every `--progress` seconds on stderr, and at the end
the verdict of the run as checks - no unrecovered failure and the integrity checks per workload, the
recording, and one check per row of the health matrix (`gpuwatch.report.health`, the same rows as the
HTML report). Each row's status (pass, FAIL, FAIL (not enforced), FAIL (no data), no data (not
enforced)) comes from one table, `gpuwatch.report.judgement`: a row fails the run only when `--fail-on`
named its check; without that it is reported against the report's default and the exit code says only
what it said before (an unrecovered failure, a recording that failed, a signal).

Imported by `gpuwatch.cli` only; imports `gpuwatch.runtime` and below, `gpuwatch.report.health` and
`gpuwatch.report.judgement`.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable
from xml.etree import ElementTree as ET

from gpuwatch import __version__
from gpuwatch.errors import UsageError
from gpuwatch.report.judgement import by_status, help_text, judge
from gpuwatch.units import hms

# --fail-on KEY: (the comparison that fails the run, the Thresholds field it sets, the health row it
# gates, the range a value may take, whether a trailing % divides by 100)
FAIL_ON: dict[str, tuple[str, str, str, float, float, bool]] = {
    "util": ("<", "min_util_pct", "GPU utilization", 0.0, 100.0, False),
    "mfu": ("<", "min_mfu", "Compute (TFLOP/s vs peak)", 0.0, 1.0, True),
    "mem_peak": (">", "max_mem_frac", "Memory (peak vs limit)", 0.0, 1.0, True),
    "temp_margin": ("<", "temp_margin_c", "Temperature", 0.0, 200.0, False),
    "throttled": (">", "max_throttle_frac", "Throttling", 0.0, 1.0, True),
}
FAIL_ON_HELP = ("fail the run (exit 1) when a health row crosses VALUE; comma-separated, repeatable: "
                "util<PCT (mean GPU utilization while the workload ran, 0-100), mfu<FRAC (median MFU, 0-1 or N%%), "
                "mem_peak>FRAC (peak memory / limit, 0-1 or N%%), temp_margin<C (degrees below the slowdown "
                "temperature), throttled>FRAC (share of samples with a limiting clock reason, 0-1 or N%%). "
                "E.g. --fail-on util<85,mfu<0.6,temp_margin<5,throttled>0.05,mem_peak>0.95. Each health row "
                "then reads " + help_text())
_ITEM = re.compile(r"^\s*([a-z_]+)\s*([<>])\s*([0-9]*\.?[0-9]+)\s*(%?)\s*$")


def parse_fail_on(text: str) -> dict[str, float]:
    """`"util<85,mfu<0.6"` -> {"util": 85.0, "mfu": 0.6}. UsageError (one line) for anything else."""
    out: dict[str, float] = {}
    for item in str(text).split(","):
        m = _ITEM.match(item)
        if not m:
            key = re.match(r"\s*([a-z_]+)", item)
            if key and key.group(1) not in FAIL_ON:
                raise UsageError(f"--fail-on: unknown check {key.group(1)!r} (one of {', '.join(FAIL_ON)})")
            raise UsageError(f"--fail-on: bad item {item.strip()[:40]!r}: use KEY<VALUE or KEY>VALUE, e.g. util<85")
        key, op, num, pct = m.groups()
        if key not in FAIL_ON:
            raise UsageError(f"--fail-on: unknown check {key!r} (one of {', '.join(FAIL_ON)})")
        want, _field, _row, lo, hi, frac = FAIL_ON[key]
        if op != want:
            raise UsageError(f"--fail-on: {key} fails {'below' if want == '<' else 'above'} a value: use {key}{want}{num}{pct}")
        value = float(num)
        if pct and frac:
            value /= 100
        if not math.isfinite(value) or not lo <= value <= hi:
            raise UsageError(f"--fail-on: {key}{op}{num}{pct} out of range ({lo:g}..{hi:g}{' or 0..100%' if frac else ''})")
        if key in out:
            raise UsageError(f"--fail-on: {key} given twice")
        out[key] = value
    return out


def merge_fail_on(parts: list[dict[str, float]] | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for p in parts or []:
        for k, v in p.items():
            if k in out:
                raise UsageError(f"--fail-on: {k} given twice")
            out[k] = v
    return out


# -- progress --------------------------------------------------------------------------------------------
class Progress:
    """Called every `--progress` seconds from the session's wait: one line on stderr with elapsed/duration,
    steps, tokens/s (median of the steps since the last line), OOMs, the latest risk, guard actions and
    recorded rows. `offset_s`: run time of the earlier parts of a resumed session."""

    def __init__(self, session, duration_s: float | None, offset_s: float = 0.0, out=None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.s, self.duration_s, self.offset_s = session, duration_s, offset_s
        self.out, self.clock = out, clock
        self.t0 = clock()
        bus = session.bus
        self._steps_at, self._risk_at = bus.steps.next_seq, bus.risk.next_seq
        self._risk: dict[Any, float] = {}
        self._tps: float | None = None

    def elapsed(self) -> float:
        return self.offset_s + self.clock() - self.t0

    def line(self) -> str:
        s, bus = self.s, self.s.bus
        rows, self._steps_at, _ = bus.steps.since(self._steps_at)
        tps = [r["tokens_per_s"] for r in rows if r.get("tokens_per_s") is not None]
        self._tps = statistics.median(tps) if tps else None
        risk, self._risk_at, _ = bus.risk.since(self._risk_at)
        for r in risk:
            if r.get("risk") is not None:
                self._risk[r.get("gpu")] = float(r["risk"])
        el = self.elapsed()
        parts = [f"{hms(el)}/{hms(self.duration_s)}" + (f" ({100 * el / self.duration_s:.0f} %)" if self.duration_s else "")]
        steps = [w.export_state()["step"] for w in s.workloads]
        parts.append(f"step {'/'.join(map(str, steps)) or '-'}" + (f" (+{len(rows)})" if s.workloads else ""))
        parts.append(f"{self._tps:.0f} tok/s" if self._tps is not None else "- tok/s")
        ooms = sum(w.ooms for w in s.workloads)
        rec = sum(w.recovered for w in s.workloads)
        parts.append(f"OOM {ooms} ({rec} recovered)")
        failed = [w for w in s.workloads if w.unrecovered]
        if failed:
            parts.append(f"FAILED {len(failed)}")
        parts.append(f"risk {max(self._risk.values()):.2f}" if self._risk else "risk -")
        status = s.status()
        parts += [status.guard_progress(), status.recorder_progress()]
        return "gpuwatch: " + " | ".join(parts)

    def __call__(self) -> None:
        print(self.line(), file=self.out or sys.stderr, flush=True)


# -- the verdict ----------------------------------------------------------------------------------------
@dataclass
class RunInfo:
    """What cmd_stress knows besides the session: the CI flags, and time (this part and earlier ones)."""

    fail_on: dict[str, float] = field(default_factory=dict)
    summary_json: Path | None = None
    junit: Path | None = None
    duration_s: float | None = None
    ran_s: float = 0.0  # this process's wait
    offset_s: float = 0.0  # earlier parts of a resumed session
    previous_unrecovered: list[str] = field(default_factory=list)
    resumed: bool = False

    @property
    def wanted(self) -> bool:
        """Whether the run's end needs the recording read back (health rows, whole-session summaries)."""
        return bool(self.fail_on or self.summary_json or self.junit or self.resumed)


class _Rows:
    """A stand-in for `bus.steps` holding a recording's step rows (summaries of a whole resumed session)."""

    def __init__(self, rows: list[dict]) -> None:
        self._rows = rows

    def latest(self, n: int) -> list[dict]:
        return self._rows[-n:] if n else []

    def __len__(self) -> int:
        return len(self._rows)


class _StepsBus:
    def __init__(self, rows: list[dict]) -> None:
        self.steps = _Rows(rows)


def open_session_recording(session):
    """The session's recording after stop (compacted), or (None, why not)."""
    r = session.recorder
    if r is None:
        return None, "not recorded (--no-record): health checks skipped"
    from gpuwatch.errors import RecordingError
    from gpuwatch.recording.reader import open_recording

    try:
        return open_recording(r.dir), None
    except RecordingError as e:
        return None, f"recording unreadable: {e}"


def step_source(session, rec):
    """What `summarize(w, bus)` should read: the recording's steps (all parts of a resumed session) when
    there is a recording, else the live bus."""
    if rec is None:
        return session.bus
    rows = rec.steps.sort("ts").to_dicts()
    for row in rows:  # the bus holds ts as UTC microseconds
        row["ts"] = int(row["ts"].timestamp() * 1e6) if row.get("ts") is not None else None
    return _StepsBus(rows)


def health_rows(rec, fail_on: dict[str, float]) -> list[dict[str, Any]]:
    """The health matrix of `rec` with the given thresholds (defaults elsewhere), as JSON-able rows."""
    from gpuwatch.report.health import Thresholds, health_matrix

    th = Thresholds(**{FAIL_ON[k][1]: v for k, v in fail_on.items()})
    key_of = {row: k for k, (_op, _f, row, *_r) in FAIL_ON.items()}
    out = []
    for row in health_matrix(rec, th):
        key = key_of.get(row.name)
        enforced = key in fail_on
        out.append({"name": row.name, "key": key, "value": row.value, "threshold": row.threshold, "op": row.op,
                    "unit": row.unit, "status": row.status, "enforced": enforced,
                    "verdict": judge(row.passed, enforced).status,  # report/judgement.py: the one table
                    "value_text": row.value_text, "threshold_text": row.threshold_text, "detail": row.detail})
    return out


def verdict(session, why: str, info: RunInfo, summaries: list[dict], rec, rec_note: str | None) -> dict[str, Any]:
    """The whole summary of the run (what --summary-json writes), checks and exit code included."""
    from gpuwatch.waiting import SIGNAL_EXIT

    checks: list[dict[str, Any]] = []
    reasons: list[str] = []
    status = session.status()
    workloads = _workload_checks(session, status, why, info, summaries, checks, reasons)
    r = status.recorder
    recording = _recording_check(r, checks, reasons)
    rows = health_rows(rec, info.fail_on) if rec is not None else []
    _health_checks(rows, checks, reasons)
    if rec is None:
        checks.append({"name": "health checks", "status": "skipped", "message": rec_note or "no recording"})
    code = 1 if reasons else 0
    if why in SIGNAL_EXIT:
        code = SIGNAL_EXIT[why]
        reasons.insert(0, f"stopped by {why}")
    g = status.guard
    return {
        "gpuwatch": __version__, "argv": sys.argv, "session": str(r.dir) if r is not None else None,
        "stopped_by": why, "elapsed_s": round(info.offset_s + info.ran_s, 3), "this_run_s": round(info.ran_s, 3),
        "duration_s": info.duration_s, "resumed": bool(info.resumed),
        "workloads": workloads, "recording": recording,
        "guard": g.as_json() if g else None,
        "model": status.model_note,
        "thresholds": dict(info.fail_on),
        "health": {"checked": rec is not None, "note": rec_note, "rows": rows},
        "checks": checks,
        "exit": {"code": code, "why": reasons or ["all checks passed" if code == 0 else ""]},
    }


def _workload_checks(session, status, why: str, info: RunInfo, summaries: list[dict], checks: list[dict[str, Any]],
                     reasons: list[str]) -> list[dict[str, Any]]:
    """Per workload: its summary for the JSON, and its checks (no unrecovered failure, steps completed,
    integrity) added to `checks`, with why each failure fails the run added to `reasons`."""
    from gpuwatch.waiting import SIGNAL_EXIT

    workloads = []
    for w, ws, s in zip(session.workloads, status.workloads, summaries):
        st = w.export_state()
        earlier = list(info.previous_unrecovered)
        s = {**s, "steps_total": st["step"], "schedule": st["schedule"], "precision": st["precision"],
             "previous_unrecovered": earlier}
        workloads.append(s)
        label = ws.label
        bad = s["unrecovered"] or (earlier[0] if earlier else None)
        checks.append({"name": f"no unrecovered failure ({label})", "status": "fail" if bad else "pass",
                       "message": f"unrecovered: {bad}" if bad else f"{s['ooms']} OOM(s), {s['recovered']} recovered"})
        if bad:
            reasons.append(f"{label}: unrecovered failure: {bad}")
        elif st["step"] == 0 and s["ooms"] and why not in SIGNAL_EXIT:  # every attempt ran out of memory
            checks.append({"name": f"steps completed ({label})", "status": "fail",
                           "message": f"no step completed ({s['ooms']} OOM(s))"})
            reasons.append(f"{label}: no step completed ({s['ooms']} OOM(s))")
        every = w.cfg.integrity_every
        ran = st["step"] // every if every else 0
        if s["integrity_failures"]:
            checks.append({"name": f"integrity checks ({label})", "status": "fail",
                           "message": f"{s['integrity_failures']} of {ran} integrity check(s) differed"})
        elif ran == 0:
            checks.append({"name": f"integrity checks ({label})", "status": "skipped",
                           "message": f"no integrity check ran ({st['step']} steps, one every {every})"})
        else:
            checks.append({"name": f"integrity checks ({label})", "status": "pass",
                           "message": f"{ran} integrity check(s), outputs identical"})
    return workloads


def _recording_check(r, checks: list[dict[str, Any]], reasons: list[str]) -> dict[str, Any] | None:
    """The recording's part of the summary (None without one) and its check (`r`: a RecorderStatus)."""
    if r is None:
        return None
    checks.append({"name": "recording", "status": "fail" if r.bad else "pass", "message": r.check()})
    if r.bad:
        reasons.append(f"recording: {r.bad}")
    return r.as_json()


def _health_checks(rows: list[dict[str, Any]], checks: list[dict[str, Any]], reasons: list[str]) -> None:
    """One check per health-matrix row, judged by the one table (report/judgement.py): its JUnit status,
    whether it fails the run, and the status it says."""
    for row in rows:
        j = by_status()[row["verdict"]]
        what = f"{row['value_text']} ({row['threshold_text']})"
        if j.status == "FAIL":
            msg = f"FAIL: {row['value_text']}, needs {row['threshold_text']} ({row['detail']})"
            reasons.append(f"health: {row['name']} {row['value_text']}, needs {row['threshold_text']}")
        elif j.status == "FAIL (no data)":
            msg = f"FAIL (no data): {row['detail']}"
            reasons.append(f"health: {row['name']}: FAIL (no data: {row['detail']}) for --fail-on {row['key']}")
        elif j.status == "FAIL (not enforced)":
            msg = f"FAIL (not enforced): {what}: {row['detail']} (--fail-on {row['key']}... enforces it)"
        elif j.status == "no data (not enforced)":
            msg = f"no data (not enforced): {row['detail']}"
        else:
            msg = f"pass: {what}: {row['detail']}"
        checks.append({"name": f"health: {row['name']}", "status": j.check, "message": msg})


def health_lines(summary: dict[str, Any]) -> list[str]:
    """stdout's health lines: each row's value, threshold and status (report/judgement.py), and why
    where there is no data."""
    h = summary["health"]
    if not h["checked"]:
        return [f"health: {h['note']}"]
    out = []
    for row in h["rows"]:
        line = f"health: {row['name']}: {row['value_text']} ({row['threshold_text']}) {row['verdict']}"
        if row["value"] is None:
            line += f": {row['detail']}"
        out.append(line)
    return out


def _write_atomic(text: str, path: Path) -> None:
    from gpuwatch.atomic import write_file

    write_file(path, text)


def write_summary_json(summary: dict[str, Any], path: Path) -> None:
    _write_atomic(json.dumps(summary, indent=2, default=str) + "\n", path)


def junit_xml(summary: dict[str, Any]) -> str:
    """One <testsuite name="gpuwatch stress"> (inside <testsuites>), one <testcase> per check: a failed
    check has <failure message=...>, a check with no data <skipped message=.../>."""
    checks = summary["checks"]
    fails = sum(c["status"] == "fail" for c in checks)
    skips = sum(c["status"] == "skipped" for c in checks)
    t = f"{summary['this_run_s']:.3f}"
    root = ET.Element("testsuites", name="gpuwatch", tests=str(len(checks)), failures=str(fails),
                      errors="0", skipped=str(skips), time=t)
    suite = ET.SubElement(root, "testsuite", name="gpuwatch stress", tests=str(len(checks)), failures=str(fails),
                          errors="0", skipped=str(skips), time=t,
                          timestamp=time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()))
    props = ET.SubElement(suite, "properties")
    for k in ("session", "stopped_by", "elapsed_s", "duration_s", "resumed"):
        ET.SubElement(props, "property", name=k, value=str(summary.get(k)))
    ET.SubElement(props, "property", name="exit_code", value=str(summary["exit"]["code"]))
    for c in checks:
        case = ET.SubElement(suite, "testcase", classname="gpuwatch.stress", name=c["name"], time="0")
        if c["status"] == "fail":
            kind = ("check" if not c["name"].startswith("health")
                    else "no data" if c["message"].startswith("FAIL (no data)") else "threshold")
            ET.SubElement(case, "failure", message=c["message"][:500], type=kind).text = c["message"]
        elif c["status"] == "skipped":
            ET.SubElement(case, "skipped", message=c["message"][:500])
        else:
            ET.SubElement(case, "system-out").text = c["message"]
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def write_junit(summary: dict[str, Any], path: Path) -> None:
    _write_atomic(junit_xml(summary), path)


# -- the end of a headless run -------------------------------------------------------------------------
def finish(session, why: str, run: RunInfo | None = None) -> int:
    """The summary lines of a headless run (`record`, `stress`) on stdout, and its exit code (a signal: 128
    + its number). With `run` (stress's CI flags or a resumed session) the recording is read back for
    whole-session summaries and the health matrix, `--summary-json`/`--junit` are written, and a health
    row that fails a `--fail-on` threshold makes the exit code 1."""
    from gpuwatch.waiting import SIGNAL_EXIT

    rec = rec_note = None
    if run is not None and run.wanted:
        rec, rec_note = open_session_recording(session)
        steps_from = step_source(session, rec)
    else:
        steps_from = session.bus
    summaries, code = _workload_lines(session, why, steps_from, SIGNAL_EXIT)
    if run is not None and run.previous_unrecovered:
        print(f"  UNRECOVERED before the resume: {run.previous_unrecovered[0]}")
        code |= 1
    code |= _guard_and_recording_lines(session)
    if run is not None and run.wanted:
        summary = verdict(session, why, run, summaries, rec, rec_note)
        for line in health_lines(summary):
            print(line)
        if run.summary_json:
            write_summary_json(summary, run.summary_json)
        if run.junit:
            write_junit(summary, run.junit)
        code |= summary["exit"]["code"] if why not in SIGNAL_EXIT else 0
        if code and why not in SIGNAL_EXIT:
            print("exit 1: " + "; ".join(summary["exit"]["why"]), file=sys.stderr)
    if why in SIGNAL_EXIT:
        print(f"stopped by {why}", file=sys.stderr)
        return SIGNAL_EXIT[why]
    return code


def _workload_lines(session, why: str, steps_from, signal_exit: dict) -> tuple[list[dict], int]:
    """Each workload's summary printed; (the summaries, 1 if one failed: an unrecovered failure, or no
    step completed at all because every attempt ran out of memory)."""
    from gpuwatch.workload.summary import format_summary, summarize

    code = 0
    summaries = []
    for w in session.workloads:
        s = summarize(w, steps_from)
        summaries.append(s)
        print(format_summary(s))
        code |= 1 if s["unrecovered"] else 0
        if not s["unrecovered"] and s["ooms"] and w.export_state()["step"] == 0 and why not in signal_exit:
            # nothing ran (every attempt out of memory, say): a run that did no work did not pass
            print(f"  FAILED: no step completed ({s['ooms']} OOM(s))")
            code |= 1
    return summaries, code


def _guard_and_recording_lines(session) -> int:
    """The guard's line and the recording's line; 1 if the recording failed or is incomplete."""
    status = session.status()
    if status.guard is not None:
        print(status.guard.summary())
    r = status.recorder
    if r is None:
        return 0
    print(r.summary())
    return 1 if r.bad else 0


def detach(session) -> None:
    """SIGHUP (the terminal closed, an SSH link dropped): a headless stress run goes on. What it would
    have printed goes to `stress.log` in its session folder (nowhere without one); an event says so."""
    log = session.recorder.dir / "stress.log" if session.recorder is not None else Path(os.devnull)
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        for std in (1, 2):
            os.dup2(fd, std)
        os.close(fd)
    except OSError:
        pass
    session.bus.emit("detached", f"terminal closed (SIGHUP): the run goes on; output to {log}", "warning")
