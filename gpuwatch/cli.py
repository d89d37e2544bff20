"""Command line: the one parser of every command; it turns flags into typed configs and dispatches to the
command's layer (the composition root, `ci.finish`, `recording.compact`, `report.run`...), nothing else.

  gpuwatch                      live dashboard + DeepSeek workload on the embedded default, recording on
  gpuwatch watch                live dashboard, no workload
  gpuwatch replay PATH          replay a session (time travel); --follow attaches to one being written
  gpuwatch info                 GPUs, driver, and what each metric reads on this machine
  gpuwatch record               headless recording
  gpuwatch stress               headless DeepSeek workload, recorded, risk-scored and guarded
  gpuwatch train                train the failure-risk model on recordings; writes it and its card
  gpuwatch score SESSION        the risk timeline of a recorded session
  gpuwatch report SESSION       a self-contained HTML (or Markdown) test report

Errors: a user error (bad flag, unreadable input) exits 2 with one line; a runtime fault exits 1 with
one line; a signal ends a headless run cleanly (recording closed) with 128 + the signal's number.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from gpuwatch import __version__
from gpuwatch.cli_train import add_train_parser, cmd_train as _cmd_train
from gpuwatch.errors import GpuwatchError, UsageError
from gpuwatch.units import parse_duration, parse_size

SPEED_MIN, SPEED_MAX = 0.25, 16.0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, never a usage dump or traceback
        raise UsageError(f"{self.prog}: {message} (see --help)")


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


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="gpuwatch", description="Watch, record, replay and protect GPU workloads.")
    p.add_argument("--version", action="version", version=f"gpuwatch {__version__}")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    live = sub.add_parser("live", help="dashboard + workload (the default with no command)")
    _common(live, record_default=True)
    _workload_args(live)
    w = sub.add_parser("watch", help="dashboard without a workload")
    _common(w, record_default=False)
    for q in (live, w):
        q.add_argument("--duration", type=_dur, default=None, metavar="DUR", help="quit after DUR (benchmarks)")
    r = sub.add_parser("replay", help="replay a recorded session")
    r.add_argument("path", type=_nonempty_path)
    r.add_argument("--follow", action="store_true", help="attach to a session still being recorded")
    r.add_argument("--speed", type=_speed, default=1.0, help=f"playback speed {SPEED_MIN:g}..{SPEED_MAX:g} (default 1)")
    _model_args(r)
    sub.add_parser("info", help="GPUs, driver and what each metric reads here")
    rec = sub.add_parser("record", help="headless recording")
    _common(rec, record_default=True)
    rec.add_argument("--duration", type=_dur, default=None, metavar="DUR", help="stop after DUR (default: Ctrl-C)")
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
    add_train_parser(sub, _pos_int, _unit, _dur)
    cp = sub.add_parser("compact", help="turn a session that was killed (its stream files) into one Parquet "
                        "file per table, as a clean stop does",
                        description="Merge a killed session's Arrow stream files and Parquet chunks into one "
                        "Parquet file per table (what a clean stop writes; DuckDB and pl.scan_parquet read it). "
                        "Refuses a session still being recorded and a damaged file (nothing is deleted).")
    cp.add_argument("session", type=_nonempty_path, help="the session folder, e.g. recordings/<session>")
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
    return p


# -- typed configs from flags -------------------------------------------------------------------------
def session_config(args, workload: bool, deliver_s: float = 0.0):
    from gpuwatch.control.policy import GuardConfig
    from gpuwatch.runtime import ModelChoice, SessionConfig

    spec = _workload_spec(args) if workload else None
    guard = GuardConfig(mode=getattr(args, "guard", "off"), rule=getattr(args, "guard_rule", "model"))
    out = args.output if args.record else None
    if args.prometheus is not None:
        _check_prometheus(*args.prometheus)
    if out is not None:
        from gpuwatch.atomic import check_output_dir

        check_output_dir(out)
    return SessionConfig(interval_s=args.interval, record_dir=out, source=args.source, sampler=args.sampler,
                         deliver_s=deliver_s, workload=spec, guard=guard, prometheus=args.prometheus,
                         model=ModelChoice(args.model, not args.no_model, args.trust_model, args.risk_threshold))


def _check_prometheus(host: str, port: int) -> None:
    """The address is bound and released before anything is built or written (a busy port used to be
    found after the workload was built, leaving a session folder behind); one bound beyond loopback is
    said to be reachable from the network."""
    from gpuwatch.export.prometheus import PrometheusExporter
    from gpuwatch.telemetry.bus import Bus

    ex = PrometheusExporter(Bus(), [], host, port)
    ex.check()
    if ex.public:
        _status(f"warning: --prometheus {host}:{port} serves the metrics on "
                f"{'every interface' if host in ('0.0.0.0', '::', '') else host}: anyone who can reach this "
                "host can read them (no authentication); give a port alone for 127.0.0.1 only")


def _workload_spec(args):
    from gpuwatch.workload.factory import WorkloadSpec
    from gpuwatch.workload.presets import parse_overrides, validate_overrides

    if args.new_tokens is not None and args.mode != "decode":
        raise UsageError(f"--new-tokens is for --mode decode (this run is --mode {args.mode})")
    return WorkloadSpec(
        preset=args.preset, mode=args.mode, schedule=args.schedule, precision=args.precision, batch=args.batch,
        seq_len=args.seq_len, max_batch=args.max_batch, device=args.device, gpus=args.gpus,
        memory_limit_bytes=args.gpu_memory_limit, leak_mib=args.leak_mib, fragment=args.fragment,
        fp16_overflow=args.fp16_overflow, integrity_every=args.integrity_every,
        overrides=validate_overrides(parse_overrides(args.set)), seed=args.seed, max_steps=getattr(args, "steps", None),
        graphs=args.graphs, new_tokens=args.new_tokens, tuning=tuple(getattr(args, "tune", ())))


# -- commands -----------------------------------------------------------------------------------------
def cmd_info(args) -> int:
    from gpuwatch.recording.backends import make_gpu_backend
    from gpuwatch.runtime import versions

    gpu, note = make_gpu_backend()
    print(f"gpuwatch {__version__}: {note}")
    if gpu is not None:
        print(f"driver {gpu.driver_version}, NVML {getattr(gpu, 'nvml_version', None)}, "
              f"memory read with NVML's {getattr(gpu, 'memory_api', 'v1')} call")
        for g in gpu.gpus:
            print(f"GPU {g.index}: {g.name}  {g.pci_bus_id}  {g.uuid}")
            for field, how in gpu.probe(g.index).items():
                print(f"  {field:28s} {how}")
        gpu.close()
    else:
        print("without a GPU: every gpu_* column is null; host_* and proc_* columns are read "
              "(psutil, /proc), the workload runs the tiny preset on the CPU")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions().items() if v))
    return 0


def cmd_record(args) -> int:
    from gpuwatch.runtime import Session

    # Nothing reads the ticks here but the recorder, which writes once a second: take them a second at
    # a time (one wake-up a second in this process instead of ten).
    if not args.record:
        raise UsageError("record --no-record would record nothing (use `gpuwatch watch` to look without recording)")
    cfg = session_config(args, workload=False, deliver_s=1.0)
    with Session(cfg, on_status=_status if args.prometheus else None) as s:
        _status(s.gpu_note)
        if s.recorder:
            _status(f"recording to {s.recorder.dir}")
        why = s.wait(args.duration)
    from gpuwatch.ci import finish

    return finish(s, why)


# flags a resumed run takes from the recorded command line; given again, they must agree with it
_RESUME_FIXED = ("preset", "mode", "schedule", "precision", "batch", "seq_len", "max_batch", "device", "gpus",
                 "gpu_memory_limit", "leak_mib", "fragment", "fp16_overflow", "integrity_every", "set", "seed",
                 "graphs", "tune", "guard", "guard_rule", "interval", "sampler", "source")


def _resumed_args(args, point):
    """The recorded `gpuwatch stress` flags of `point`'s session, with this command's run flags (duration,
    steps, progress, outputs, model) on top. A workload flag given here that differs from the recorded
    one is a UsageError; one left at its default takes the recorded value."""
    parser = build_parser()
    try:
        orig = parser.parse_args(_fix_negative_values(point.argv))
    except UsageError as e:
        raise UsageError(f"--resume {point.dir}: its recorded command line no longer parses ({e})") from None
    defaults = parser.parse_args(["stress"])
    first = point.meta["config"]["workloads"][0]
    orig.preset = orig.preset or first.get("preset")  # "largest that fits" was decided once, at the start
    orig.precision = orig.precision or first.get("precision")
    for f in _RESUME_FIXED:
        new, was = getattr(args, f), getattr(orig, f)
        if new != getattr(defaults, f) and new != was:
            flag = "--" + f.replace("_", "-")
            raise UsageError(f"--resume {point.dir}: {flag} {new} contradicts the recorded run ({flag} {was})")
    for f in ("progress", "summary_json", "junit", "fail_on", "model", "no_model", "trust_model", "risk_threshold",
              "prometheus", "resume"):
        if hasattr(args, f):
            setattr(orig, f, getattr(args, f))
    orig.duration = args.duration if args.duration is not None else orig.duration
    orig.steps = args.steps if args.steps is not None else orig.steps
    orig.record, orig.output = True, point.dir.parent
    return orig


def cmd_stress(args) -> int:
    from dataclasses import replace

    from gpuwatch import ci
    from gpuwatch.resume import refuse_finished
    from gpuwatch.runtime import Session, load_resume

    factory, dist = None, None
    if args.nproc or args.collectives or args.dp or os.environ.get("WORLD_SIZE", "1") != "1":
        from gpuwatch.workload import distributed as dist

        if args.nproc:  # this command again, under torchrun
            return dist.relaunch(sys.argv[1:], args.nproc, args.dp, args.mode)
        ctx = dist.join(args.device, args.resume, args.collectives, args.dp, args.mode)
        if not ctx.leader:  # the workload only: its steps and events go to rank 0's session
            return dist.run_rank(ctx, _workload_spec(args), args.collectives, args.peak_gbps, args.dp)
        factory = dist.make_rank_workloads(ctx, args.collectives, args.peak_gbps, args.dp)
    fail_on = ci.merge_fail_on(args.fail_on)
    if fail_on and not args.record:
        raise UsageError("--fail-on needs the recording to check (drop --no-record)")
    from gpuwatch.atomic import check_output_file

    check_output_file(args.summary_json, "--summary-json")
    check_output_file(args.junit, "--junit")
    point = None
    if args.resume is not None:
        if not args.record:
            raise UsageError("--resume continues the session's recording (drop --no-record)")
        point = load_resume(args.resume)
        args = _resumed_args(args, point)
        refuse_finished(point, args.duration, args.steps)
        cfg = replace(session_config(args, workload=True), record_dir=point.dir.parent, name=point.dir.name,
                      resume=point)
    else:
        cfg = session_config(args, workload=True)
    every = args.progress if args.progress is not None else (10.0 if sys.stdout.isatty() else 60.0)
    run = ci.RunInfo(fail_on=fail_on, summary_json=args.summary_json, junit=args.junit, duration_s=args.duration,
                     previous_unrecovered=point.unrecovered if point else [], resumed=point is not None)
    with Session(cfg, on_status=_status if args.prometheus else None, workload_factory=factory) as s:
        _status(f"{s.gpu_note}; {s.model_note}")
        run.offset_s = s.resumed_after_s
        if point is not None:
            _status(f"resuming {point.dir} ({point.previous_close}) after {ci.hms(point.elapsed_s)} of run time, "
                    f"at step {', '.join(str(w.export_state()['step']) for w in s.workloads)}")
        elif s.recorder:
            _status(f"recording to {s.recorder.dir}")
        left = None if args.duration is None else max(0.0, args.duration - run.offset_s)
        s.ends_in(left)
        progress = ci.Progress(s, args.duration, run.offset_s) if every > 0 else None
        t0 = time.monotonic()
        why = s.wait(left, until_done=True, on_tick=progress, tick_s=every, on_hup=lambda: ci.detach(s))
        run.ran_s = time.monotonic() - t0
    if dist is not None:
        dist.shutdown()
    return ci.finish(s, why, run)


def cmd_train(args) -> int:
    return _cmd_train(args, _status)


def cmd_compact(args) -> int:
    from gpuwatch.recording.compact import compact_session

    _status(compact_session(args.session))
    return 0


def cmd_score(args) -> int:
    from gpuwatch.predict.model import load_model
    from gpuwatch.predict.scorer import alarms, guard_actions, score_source
    from gpuwatch.predict.usable import open_usable

    if args.no_model:
        raise UsageError("score needs a model (drop --no-model)")
    if args.output is not None:
        from gpuwatch.atomic import check_output_file

        check_output_file(args.output, "-o")
    model = load_model(args.model, trust=args.trust_model, threshold=args.risk_threshold)
    src = open_usable(args.session)  # the rule `train` uses too (predict/usable.py): else one line, exit 1
    if src.reader.meta.get("single_file"):
        _status(f"warning: {args.session} is one file: no steps or events beside it, so the risk is computed "
                "from what the file holds alone (score the session folder for the full picture)")
    for w in src.reader.warnings:  # a missing or unreadable table changes the alarms: say so
        _status(f"warning: {w}")
    if src.steps_df.is_empty():
        _status(f"warning: {args.session} has no steps: the risk is computed from the samples alone "
                "(fewer alarms than a session with its steps)")
    t0 = time.perf_counter()
    tl = score_source(src, model, stride=args.stride, progress=None if args.json else _status, jobs=args.jobs)
    if args.output:
        from gpuwatch.recording.writer import write_atomic

        write_atomic(tl, args.output)
    al = alarms(tl)
    actions = guard_actions(src.events_df)
    summary = {"session": str(args.session), "model": model.label, "threshold": model.threshold,
               "windows": tl.height, "seconds": round(time.perf_counter() - t0, 3),
               "max_risk": round(float(tl["risk"].max()), 4) if tl.height else None, "alarms": al,
               "actions": actions}
    if args.json:
        print(json.dumps(summary))
    else:
        top = "-" if summary["max_risk"] is None else summary["max_risk"]
        print(f"{tl.height} windows scored in {summary['seconds']} s with {model.label}; "
              f"max risk {top}; {len(al)} alarm(s)")
        for a in al:
            print(f"  {a['ts']}  GPU{a['gpu']}  {a['kind']}  risk {a['risk']:.2f}")
        if actions:
            print(f"{len(actions)} guard action(s) recorded in the session:")
            for a in actions:
                print(f"  {a['ts']}  GPU{a['gpu']}  {a['action']}  (risk {a['risk']})  {a['message']}")
    return 0


def cmd_report(args) -> int:
    from gpuwatch.report import run

    return run(args)


def cmd_tui(args) -> int:
    from gpuwatch.ui.launch import run_replay, run_tui

    if args.command == "replay":
        return run_replay(args.path, follow=args.follow, speed=args.speed, model=args.model, trust=args.trust_model,
                          no_model=args.no_model)
    workload = args.command in (None, "live")
    # watch: no workload and no guard wait on the ticks, and the screen redraws once a second, so the
    # sampler hands them over half a second at a time (fewer wake-ups); live keeps every tick at once
    cfg = session_config(args, workload=workload, deliver_s=0.0 if workload else 0.5)
    return run_tui(cfg, duration_s=args.duration, status=_status)


def _status(msg: str) -> None:
    print(f"gpuwatch: {msg}", file=sys.stderr, flush=True)


def _fix_negative_values(argv: list[str]) -> list[str]:
    """`--duration -1s` would read as an unknown flag ("expected one argument"); join such values to
    their flag so the value's own check says what is wrong with it."""
    out: list[str] = []
    for a in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and len(a) > 1 and a[0] == "-" and a[1].isdigit():
            out[-1] = f"{out[-1]}={a}"
        else:
            out.append(a)
    return out


class _Stopped(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum, _frame):
    raise _Stopped(signum)


def main(argv: list[str] | None = None) -> int:
    import signal

    argv = sys.argv[1:] if argv is None else argv
    for sig in (signal.SIGTERM, signal.SIGHUP):  # train/score/report: a clean one-line stop too
        signal.signal(sig, _raise_stopped)  # (a running session installs its own handlers while it waits)
    try:
        if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
            argv = ["live", *argv]
        args = build_parser().parse_args(_fix_negative_values(argv))
        handler = {"info": cmd_info, "record": cmd_record, "stress": cmd_stress, "train": cmd_train,
                   "score": cmd_score, "compact": cmd_compact, "report": cmd_report}.get(args.command, cmd_tui)
        return handler(args)
    except GpuwatchError as e:
        print(f"gpuwatch: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("gpuwatch: interrupted", file=sys.stderr)
        return 130
    except _Stopped as e:
        print(f"gpuwatch: stopped by {signal.Signals(e.signum).name}", file=sys.stderr)
        return 128 + e.signum
    except OSError as e:  # a fault outside any session (a file we were told to write, say)
        print(f"gpuwatch: error: {e.strerror or e}: {e.filename or ''}".rstrip(": "), file=sys.stderr)
        return 1
