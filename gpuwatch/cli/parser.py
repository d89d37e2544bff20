"""The one parser of every command: each subcommand's flags and the argument types that check them, so a
bad value is a one-line error (exit 2) before anything runs. Nothing here runs a command
(`gpuwatch.cli.commands` does) or imports more than a flag's choices need: building the parser stays
cheap, and `--help` works without any optional extra installed."""

from __future__ import annotations

import argparse
import math
from datetime import datetime, timedelta, timezone
from pathlib import Path

from gpuwatch import __version__
from gpuwatch.errors import UsageError
from gpuwatch.units import parse_duration, parse_size

__all__ = ["SPEED_MAX", "SPEED_MIN", "build_parser", "fix_negative_values", "parse_recorded", "parse_when"]

SPEED_MIN, SPEED_MAX = 0.25, 16.0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, never a usage dump or traceback
        # a subcommand's parser names itself ("gpuwatch report: ..."); the top one is named by the error's own
        # "gpuwatch: error: " prefix already (it read "gpuwatch: error: gpuwatch: unrecognized arguments")
        where = f"{self.prog}: " if " " in self.prog else ""
        raise UsageError(f"{where}{message} (see --help)")


# -- argument types -----------------------------------------------------------------------------------
def _typed(fn):
    def conv(text: str):
        try:
            return fn(text)
        except UsageError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    conv.__name__ = fn.__name__
    return conv


_dur, _size = _typed(parse_duration), _typed(parse_size)


def _pos_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return v


def _float_in(ok, what: str):
    """An argparse type: a float for which `ok(v)` holds (comparisons with nan are false, so nan is
    refused too), else `what` in the one-line error."""
    def conv(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"{text!r}: {what}")
        return v
    return conv


_nonneg = _float_in(lambda v: 0 <= v < math.inf, "must be a finite number >= 0")
_unit = _float_in(lambda v: 0.0 < v < 1.0, "must be between 0 and 1")
_speed = _float_in(lambda v: SPEED_MIN <= v <= SPEED_MAX, f"speed out of range {SPEED_MIN:g}..{SPEED_MAX:g}")


def _nonempty_path(text: str) -> Path:
    if not text.strip():
        raise argparse.ArgumentTypeError("empty path")
    return Path(text)


def _nonempty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("empty value")
    return text


def _gpu_indices(text: str) -> tuple[int, ...]:
    """`--gpus 0,2` of watch/record: GPU indices (NVML's, as `gpuwatch info` lists them); whether each is
    on this machine is known only when NVML is opened (`telemetry.nvml.chosen_gpus`)."""
    try:
        idx = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of GPU indices like 0,2: {text!r}") from None
    if any(i < 0 for i in idx):
        raise argparse.ArgumentTypeError(f"a GPU index is >= 0: {text!r}")
    return idx


def _interval(text: str) -> float:
    v = _dur(text)
    if not 0.01 <= v <= 60:
        raise argparse.ArgumentTypeError(f"interval {text!r} out of range 10ms..60s")
    return v


def _progress(text: str) -> float:
    if text.strip() in ("0", "0s", "off"):
        return 0.0
    return _dur(text)


def _fail_on(text: str):
    from gpuwatch.ci import parse_fail_on

    return _typed(parse_fail_on)(text)


def _fail_on_help() -> str:
    from gpuwatch.ci import FAIL_ON_HELP

    return FAIL_ON_HELP


def _listen(text: str):
    from gpuwatch.export.prometheus import parse_listen

    return _typed(parse_listen)(text)


def parse_when(text: str, end: bool = False) -> datetime:
    """An ISO date or time (UTC unless it says otherwise) as an aware datetime; a bare date with `end` is
    the end of that day (`--until 2026-12-01` keeps that day's sessions)."""
    t = text.strip()
    try:
        when = datetime.fromisoformat(t.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a date or time (YYYY-MM-DD or YYYY-MM-DDTHH:MM[:SS][+HH:MM]): {text!r}") from None
    if end and len(t) == 10:  # a date alone
        when += timedelta(days=1)
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def _until(text: str) -> datetime:
    return parse_when(text, end=True)


# -- flags shared by several commands -----------------------------------------------------------------
def _common(p: argparse.ArgumentParser, record_default: bool) -> None:
    p.add_argument("--interval", type=_interval, default=0.1, metavar="DUR",
                   help="sampling interval (default 100ms)")
    p.add_argument("-o", "--output", type=_nonempty_path, default=Path("recordings"), metavar="DIR",
                   help="where session folders are written (default recordings/)")
    p.add_argument("--record", action=argparse.BooleanOptionalAction, default=record_default,
                   help=f"write a recording (default: {'on' if record_default else 'off'})")
    p.add_argument("--sampler", choices=["process", "thread"], default="process",
                   help="sample in a child process (default; keeps 100 ms under a busy GIL) or a thread")
    p.add_argument("--source", type=_nonempty, metavar="SESSION",
                   help="replay a recorded session as if it were live (demo/tests; labelled REPLAY)")
    p.add_argument("--prometheus", type=_listen, metavar="[HOST:]PORT",
                   help="serve live metrics for Prometheus (binds 127.0.0.1 unless a host is given)")
    _model_args(p)


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, metavar="PATH", help="failure-risk model (default: models/risk.joblib)")
    p.add_argument("--no-model", action="store_true", help="no risk scoring")
    p.add_argument("--trust-model", action="store_true",
                   help="load a model whose sha256 does not match its manifest (a joblib file runs code)")
    p.add_argument("--risk-threshold", type=_unit, default=None, metavar="P",
                   help="alarm at this risk instead of the model's threshold (0..1; lower = earlier, more false alarms)")


def _workload_args(p: argparse.ArgumentParser) -> None:
    from gpuwatch.contract import GUARD_MODES, GUARD_RULES, PRECISIONS, WORKLOAD_MODES
    from gpuwatch.workload.presets import PRESETS, SCHEDULES

    p.add_argument("--preset", choices=sorted(PRESETS), help="model size (default: largest that fits)")
    p.add_argument("--mode", choices=WORKLOAD_MODES, default="prefill")
    p.add_argument("--schedule", choices=SCHEDULES, default="steady")
    p.add_argument("--precision", choices=PRECISIONS, default=None, help="default bf16 on GPU, fp32 on CPU")
    p.add_argument("--batch", type=_pos_int, help="batch size (default from preset)")
    p.add_argument("--seq-len", type=_pos_int, help="sequence length (default from preset)")
    p.add_argument("--max-batch", type=_pos_int, help="upper batch for sweep/ramp")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--gpus", type=_nonempty, default=None, help="'all' = one workload per GPU, or a list like 0,1")
    p.add_argument("--gpu-memory-limit", type=_size, metavar="SIZE",
                   help="make the GPU behave like a smaller card, e.g. 40GiB")
    p.add_argument("--leak-mib", type=_nonneg, default=0.0, help="fault: keep N MiB per step")
    p.add_argument("--fragment", action="store_true", help="fault: random sequence lengths")
    p.add_argument("--fp16-overflow", action="store_true", help="fault: scale activations to overflow fp16")
    p.add_argument("--integrity-every", type=_pos_int, default=50, metavar="STEPS",
                   help="run the same input twice every N steps and compare")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any DeepseekV3Config field, e.g. --set num_hidden_layers=4")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--new-tokens", type=_pos_int, default=None, metavar="N",
                   help="decode: tokens generated per step after the prompt (default 128 on a GPU, 16 on a CPU)")
    p.add_argument("--graphs", choices=("auto", "on", "off"), default="auto",
                   help="static KV cache + CUDA graphs: auto = decode, on = decode and small prefills, off = eager")
    p.add_argument("--tune", action="append", default=[], metavar="KEY=VALUE",
                   help="a speed switch (gpuwatch/workload/tuning.py), e.g. --tune attention=sdpa-flash")
    p.add_argument("--guard", choices=GUARD_MODES, default="on",
                   help="act on the risk before a failure (on, default), only log what it would do (observe), or off")
    p.add_argument("--guard-rule", choices=GUARD_RULES, default="model",
                   help="model (gpuwatch), fixed (memory >90%% halve, <30%% double), accelerate or composer (reactive)")
    p.add_argument("--guard-plan", choices=("on", "off"), default="on",
                   help="with --guard-rule model: on = the planner chooses the micro-batch, checkpointing and "
                        "precision from the memory estimate (default); off = the risk threshold and its timer only")


# -- the commands' flags ------------------------------------------------------------------------------
def _add_live_commands(sub) -> None:
    """The commands that sample this machine: live, watch, replay, info, record."""
    live = sub.add_parser("live", help="dashboard + workload (the default with no command)")
    _common(live, record_default=True)
    _workload_args(live)
    w = sub.add_parser("watch", help="dashboard without a workload")
    _common(w, record_default=False)
    for q in (live, w):
        q.add_argument("--duration", type=_dur, default=None, metavar="DUR", help="quit after DUR")
    r = sub.add_parser("replay", help="replay a recorded session")
    r.add_argument("path", type=_nonempty_path)
    r.add_argument("--follow", action="store_true", help="attach to a session still being recorded")
    r.add_argument("--speed", type=_speed, default=1.0, help=f"playback speed {SPEED_MIN:g}..{SPEED_MAX:g} (default 1)")
    _model_args(r)
    sub.add_parser("info", help="GPUs, driver and what each metric reads here")
    rec = sub.add_parser("record", help="headless recording")
    _common(rec, record_default=True)
    rec.add_argument("--duration", type=_dur, default=None, metavar="DUR", help="stop after DUR (default: Ctrl-C)")
    for q in (w, rec):  # live's and stress's --gpus place the workloads (CUDA ordinals); every GPU is sampled
        q.add_argument("--gpus", dest="sample_gpus", type=_gpu_indices, default=None, metavar="LIST",
                       help="sample only these GPUs, e.g. 0,2 (NVML indices, as `gpuwatch info` lists them; "
                            "default: all)")


def _add_stress(sub) -> None:
    s = sub.add_parser("stress", help="headless DeepSeek workload, recorded")
    _common(s, record_default=True)
    _workload_args(s)
    s.add_argument("--duration", type=_dur, default=None, metavar="DUR",
                   help="stop after DUR (a resumed run counts the time its session already ran)")
    s.add_argument("--steps", type=_pos_int, default=None, help="stop after N steps (a resumed run: N in all)")
    s.add_argument("--progress", type=_progress, default=None, metavar="DUR",
                   help="one progress line on stderr every DUR (default 60s when stdout is not a terminal, "
                        "10s when it is; 0 = none)")
    s.add_argument("--summary-json", type=Path, metavar="PATH",
                   help="write the run's summary as JSON: workloads, recording, guard, health rows, exit code and why")
    s.add_argument("--junit", type=Path, metavar="PATH",
                   help="write JUnit XML: one test case per check (no unrecovered failure and integrity checks "
                        "per workload, the recording, each health-matrix row)")
    s.add_argument("--fail-on", type=_fail_on, action="append", metavar="CHECKS", help=_fail_on_help())
    s.add_argument("--resume", type=Path, metavar="SESSION",
                   help="continue an interrupted stress session in its folder (step, schedule, batch ceiling, "
                        "run time); the workload flags are the recorded ones and may not contradict them")
    s.add_argument("--nproc", type=_pos_int, metavar="N", help="data-parallel (DDP) over N ranks, under torchrun")
    s.add_argument("--collectives", type=_size, metavar="SIZE", help="ranks: first an nccl-tests-like check to SIZE")
    s.add_argument("--dp", choices=["ddp", "fsdp"], help="ranks: DDP (default), or FSDP sharded per decoder layer")
    s.add_argument("--peak-gbps", type=_nonneg, help="busbw peak per direction (default: 450 on H100/H200 NVLink 4)")


def _add_train(sub) -> None:
    """`gpuwatch train`. Sessions: with none given, the shipped H200 set (predict/dataset.py
    `default_sessions`, what models/README.md reproduces); a path given is a session when it is one, any
    other folder is searched for sessions; --since/--until/--host/--scenario keep the sessions whose
    meta.json says so."""
    t = sub.add_parser("train", help="train the failure-risk model on recorded sessions")
    t.add_argument("sessions", nargs="*", type=_path_or_url, metavar="PATH",
                   help="session folders, or folders searched for them, local or in object storage (s3://...: "
                        "needs s3fs; default: the shipped H200 sessions)")
    t.add_argument("-o", "--output", type=Path, default=Path("models/risk.joblib"), metavar="PATH",
                   help="where the model, its manifest and its card go (default models/risk.joblib, the shipped "
                        "model: replacing an existing file needs --force)")
    t.add_argument("--force", action="store_true", help="replace an existing model at -o")
    t.add_argument("--no-counterfactual", action="store_true",
                   help="train on the recorded sessions only, without their counterfactual-cap copies")
    t.add_argument("--stride", type=_pos_int, default=1, help="score every Nth sample (default 1 = every 100 ms)")
    t.add_argument("--no-eval", action="store_true", help="fit only; skip cross-validation and the card's figures")
    t.add_argument("--threshold", type=_unit, default=None,
                   help="with --no-eval: the alarm threshold to write (e.g. the shipped model's)")
    t.add_argument("--horizon", type=_dur, default=None, metavar="DUR",
                   help="predict failures this far ahead (default 5s)")
    t.add_argument("--threads", type=_pos_int, default=None, metavar="N",
                   help="OpenMP threads per fit (default 2: the shipped model's bytes; 1 gives other bits)")
    t.add_argument("-j", "--jobs", type=_pos_int, default=1, metavar="N",
                   help="processes for cutting windows and for the cross-validation folds (the same model for any N)")
    t.add_argument("--dask", type=_dask, metavar="ADDRESS",
                   help="run that work on the Dask cluster at ADDRESS (tcp://HOST:8786), or local:N for N worker "
                        "processes here (the same model; needs the extra gpuwatch[fleet])")
    t.add_argument("--no-sample", action="store_true",
                   help="fit on every window (default: the informative ones and a weighted sample of long quiet "
                        "stretches; evaluation always scores every window)")
    t.add_argument("--max-windows", type=_pos_int, default=None, metavar="N",
                   help="the final fit, and each cross-validation fold's, takes at most N windows (default "
                        "4,000,000): every informative one where they fit, the quiet ones sampled with weights (the "
                        "card says how many were seen and kept); the windows wait on disk, and evaluation still scores "
                        "every one")
    t.add_argument("--features", type=Path, metavar="DIR",
                   help="keep every window's features there, one Parquet file per GPU of a session")
    t.add_argument("--since", type=parse_when, metavar="WHEN", help="only sessions that started at or after WHEN")
    t.add_argument("--until", type=_until, metavar="WHEN",
                   help="only sessions that started before WHEN (a date: through that day)")
    t.add_argument("--host", action="append", metavar="PATTERN", help="only sessions recorded on a matching host")
    t.add_argument("--scenario", action="append", metavar="PATTERN",
                   help="only sessions of a matching kind of run (ramp-train, nearcap-*, leak, ...; the card lists them)")


def _add_eval(sub) -> None:
    ev = sub.add_parser(
        "eval", help="score a risk model on held-out sessions (the model card's held-out figures)",
        description="Score a risk model on sessions it never trained on (default: the shipped held-out H200 "
                    "sessions, recordings/heldout-*/): recall, false alarms per healthy hour, near the "
                    "limit, lead time: the model per session, then per set (the folder a session lies in) and in "
                    "all the model, the model without the lookahead and without the trend, every baseline, and "
                    "the model at each baseline's own near-limit false-alarm rate. "
                    "--first-step: what the shape library says of each session's first step, against what happened.")
    ev.add_argument("sessions", nargs="*", type=Path, metavar="SESSION",
                    help="session folders (default: every session under recordings/heldout-*/)")
    ev.add_argument("--set", action="append", type=Path, default=[], metavar="DIR", dest="sets",
                    help="every session under DIR, one set (repeatable; e.g. a blind held-out set)")
    ev.add_argument("--per-session", action="store_true",
                    help="the model's line for every session (the default already; kept for old command lines)")
    ev.add_argument("--model", type=Path, metavar="PATH", help="the model (default: models/risk.joblib)")
    ev.add_argument("--stride", type=_pos_int, default=5, help="score every Nth sample (default 5)")
    ev.add_argument("--no-prior", action="store_true",
                    help="without the model's shape library (a session's first step unseen)")
    ev.add_argument("--first-step", action="store_true",
                    help="judge the first steps instead: the training sessions leave one out, then the held-out ones")
    ev.add_argument("-o", "--output", type=Path, metavar="PATH", help="also write the figures as JSON")


def _add_recording_commands(sub) -> None:
    """The commands over a recorded session: compact, backfill, score, report."""
    cp = sub.add_parser("compact", help="turn a session that was killed (its stream files) into one Parquet "
                        "file per table, as a clean stop does",
                        description="Merge a killed session's Arrow stream files and Parquet chunks into one "
                        "Parquet file per table (what a clean stop writes; DuckDB and pl.scan_parquet read it). "
                        "Refuses a session still being recorded and a damaged file (nothing is deleted).")
    cp.add_argument("session", type=_nonempty_path, help="the session folder, e.g. recordings/<session>")
    bf = sub.add_parser(
        "backfill", help="fill the lookahead columns of `stress` sessions recorded before them",
        description="A migration of recorded sessions: the schema-v4 plan columns (ahead_batch, ahead_seq_len, "
                    "ahead_steps) filled by replaying each `gpuwatch stress` session's schedule through the code "
                    "the live workload runs; a session whose replayed plans equal less than 99 % of its "
                    "recorded next steps is left unchanged. Rewrites steps.parquet (and notes it in meta.json).")
    bf.add_argument("sessions", nargs="+", type=_nonempty_path, metavar="SESSION")
    how = bf.add_mutually_exclusive_group()
    how.add_argument("--check", action="store_true", help="print the agreement only; write nothing")
    how.add_argument("--compare", action="store_true",
                     help="sessions recorded with the columns (live): compare them with the replay; write nothing")
    how.add_argument("--refill", action="store_true",
                     help="rewrite the columns of sessions that have them too (after a change of the lookahead's rule)")
    sc = sub.add_parser("score", help="the risk timeline of a recorded session")
    sc.add_argument("session", type=_nonempty_path)
    sc.add_argument("--json", action="store_true", help="print one JSON object (alarms, summary)")
    sc.add_argument("-o", "--output", type=Path, metavar="PATH", help="write the timeline as Parquet")
    sc.add_argument("--stride", type=_pos_int, default=1)
    sc.add_argument("-j", "--jobs", type=_pos_int, default=1, metavar="N",
                    help="processes computing the windows' features (the same timeline for any N)")
    _model_args(sc)
    from gpuwatch.report import FORMATS  # cheap: polars, jinja2 and matplotlib load only when a report is made

    rp = sub.add_parser(
        "report", help="write a self-contained HTML (or Markdown) report of a recorded session",
        description="Verdict, health matrix, anomalies, charts, batch sweep, energy and recommendations "
                    "of a recorded session, as one HTML file that opens offline (or Markdown for CI).")
    rp.add_argument("path", type=Path, help="a session folder (or one Parquet file)")
    rp.add_argument("-o", "--output", type=Path, default=None, metavar="PATH",
                    help="where to write (default: <session>-report.html in the current folder)")
    rp.add_argument("--format", choices=FORMATS, default=None,
                    help="html or md (default: from the output's suffix, else html)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="gpuwatch", description="Watch, record, replay and protect GPU workloads.")
    p.add_argument("--version", action="version", version=f"gpuwatch {__version__}")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    _add_live_commands(sub)
    _add_stress(sub)
    _add_train(sub)
    _add_eval(sub)
    _add_recording_commands(sub)
    return p


def fix_negative_values(argv: list[str]) -> list[str]:
    """`--duration -1s` would read as an unknown flag ("expected one argument"); join such values to
    their flag so the value's own check says what is wrong with it."""
    out: list[str] = []
    for a in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and len(a) > 1 and a[0] == "-" and a[1].isdigit():
            out[-1] = f"{out[-1]}={a}"
        else:
            out.append(a)
    return out


def parse_recorded(argv: list[str]) -> argparse.Namespace:
    """A recorded command line (meta.json's argv without the program), parsed as it was when it ran:
    what `stress --resume` and `gpuwatch backfill` read a session's own flags from."""
    return build_parser().parse_args(fix_negative_values(argv))


def _path_or_url(text: str) -> Path | str:
    from gpuwatch.predict.remote import is_url

    return text if is_url(text) else Path(text)


def _dask(text: str) -> str:
    from gpuwatch.predict.parallel import parse_dask

    try:
        return parse_dask(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
