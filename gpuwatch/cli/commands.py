"""The commands: each turns its parsed flags (`gpuwatch.cli.parser`) into the typed configs of the layers
below (`gpuwatch.cli.configs`) and hands the work to the layer that does it (the composition root
`runtime.Session`, `ci.finish`, `recording.compact`, `report.run`, `predict`, `backfill`), nothing else.
Every import is lazy, so a command loads only what it runs."""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from gpuwatch import __version__
from gpuwatch.cli.configs import resumed_args, session_config, workload_spec
from gpuwatch.cli.output import status
from gpuwatch.errors import UsageError
from gpuwatch.extras import require
from gpuwatch.waiting import signals_deferred

__all__ = ["HANDLERS", "cmd_backfill", "cmd_compact", "cmd_eval", "cmd_info", "cmd_record", "cmd_report", "cmd_score",
           "cmd_stress", "cmd_train", "cmd_tui", "handler"]

REPO = Path(__file__).resolve().parents[2]  # a checkout's root: the shipped recordings/ (absent from a wheel)


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
    with Session(cfg, on_status=status if args.prometheus else None) as s:
        status(s.gpu_note)
        if s.recorder:
            status(f"recording to {s.recorder.dir}")
        why = s.wait(args.duration)
    from gpuwatch.ci import finish

    return finish(s, why)


def cmd_stress(args) -> int:
    from dataclasses import replace

    from gpuwatch import ci
    from gpuwatch.resume import load_resume, refuse_finished
    from gpuwatch.runtime import Session
    from gpuwatch.units import hms

    require("the workload", "workload")  # before torchrun is started or torch imported
    factory, dist = None, None
    if args.nproc or args.collectives or args.dp or os.environ.get("WORLD_SIZE", "1") != "1":
        from gpuwatch.workload import dist_init
        from gpuwatch.workload import distributed as dist

        if args.nproc:  # this command again, under torchrun
            return dist_init.relaunch(sys.argv[1:], args.nproc, args.dp, args.mode)
        ctx = dist_init.join(args.device, args.resume, args.collectives, args.dp, args.mode)
        if not ctx.leader:  # the workload only: its steps and events go to rank 0's session
            return dist.run_rank(ctx, workload_spec(args), args.collectives, args.peak_gbps, args.dp)
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
        args = resumed_args(args, point)
        refuse_finished(point, args.duration, args.steps)
        cfg = replace(session_config(args, workload=True), record_dir=point.dir.parent, name=point.dir.name,
                      resume=point)
    else:
        cfg = session_config(args, workload=True)
    every = args.progress if args.progress is not None else (10.0 if sys.stdout.isatty() else 60.0)
    run = ci.RunInfo(fail_on=fail_on, summary_json=args.summary_json, junit=args.junit, duration_s=args.duration,
                     previous_unrecovered=point.unrecovered if point else [], resumed=point is not None)
    with ExitStack() as ending:
        with Session(cfg, on_status=status if args.prometheus else None, workload_factory=factory) as s:
            status(f"{s.gpu_note}; {s.model_note}")
            run.offset_s = s.resumed_after_s
            if point is not None:
                status(f"resuming {point.dir} ({point.previous_close}) after {hms(point.elapsed_s)} of run time, "
                       f"at step {', '.join(str(w.export_state()['step']) for w in s.workloads)}")
            elif s.recorder:
                status(f"recording to {s.recorder.dir}")
            left = None if args.duration is None else max(0.0, args.duration - run.offset_s)
            s.ends_in(left)
            progress = ci.Progress(s, args.duration, run.offset_s) if every > 0 else None
            t0 = time.monotonic()
            why = s.wait(left, until_done=True, on_tick=progress, tick_s=every, on_hup=lambda: ci.detach(s))
            run.ran_s = time.monotonic() - t0
            if dist is not None:  # rank 0 of a job: torchrun sends SIGTERM the moment another rank fails; it
                # waits until the recording is closed and the summary printed (torchrun's later SIGKILL does not)
                ending.enter_context(signals_deferred())
        if dist is not None:
            dist.shutdown(ctx)
        return ci.finish(s, why, run)


def cmd_train(args) -> int:
    """With no sessions, the shipped H200 set (predict/dataset.py `default_sessions`). A path given is a
    session when it is one (it has meta.json or data files): named, so one that is unusable
    (predict/usable.py) is a one-line error before anything is read further; any other folder is searched
    for sessions (`dataset.find_sessions`), and one found there that is unusable is skipped, one line each."""
    from gpuwatch.predict.remote import is_url, local_copies

    if any(is_url(p) for p in args.sessions):
        status("copying the sessions in object storage to a local folder for this run...")
    with local_copies(args.sessions) as given:
        return _train(args, given)


def _train(args, given: list) -> int:
    from gpuwatch.predict.dataset import HORIZON_S, Filters, default_sessions, find_sessions
    from gpuwatch.predict.model import check_output
    from gpuwatch.predict.budget import MAX_WINDOWS
    from gpuwatch.predict.train import FIT_THREADS, train
    from gpuwatch.predict.usable import open_usable

    found = find_sessions(given or default_sessions(REPO), Filters(args.since, args.until, args.host,
                                                                             args.scenario))
    sessions = found.sessions
    if not sessions:
        raise UsageError("no sessions given and none shipped under recordings/")
    check_output(args.output, args.force)
    for p in found.named if args.sessions else []:  # named: unusable is the reader's (or the rule's) line, exit 1
        open_usable(p)
    for line in found.said:
        status(line)
    command = "gpuwatch train" + (f" --stride {args.stride}" if args.stride != 1 else "") + \
        (" --no-counterfactual" if args.no_counterfactual else "") + (" --no-sample" if args.no_sample else "") + \
        (f" --threads {args.threads}" if args.threads not in (None, FIT_THREADS) else "") + \
        (f" --max-windows {args.max_windows}" if args.max_windows not in (None, MAX_WINDOWS) else "") + \
        f" -o {args.output}" + \
        ("" if not args.sessions and not found.said else f" <{len(sessions)} sessions>")
    rep = train(sessions, args.output, progress=status, stride=args.stride, evaluate=not args.no_eval,
                horizon_s=args.horizon or HORIZON_S, threshold=args.threshold,
                counterfactual=not args.no_counterfactual, command=command, threads=args.threads or FIT_THREADS,
                jobs=args.jobs, dask=args.dask, sample=not args.no_sample, features_dir=args.features,
                max_windows=args.max_windows or MAX_WINDOWS)
    m = rep.by_scenario
    if m is not None:
        print(f"{rep.model_path}: threshold {rep.threshold:.3f}; leave-one-scenario-out recall {m.recall or 0:.2f} "
              f"({m.caught}/{m.oom_events}), {m.false_alarms} false alarm(s) in {m.healthy_hours * 60:.1f} healthy min; "
              f"card {rep.card_path}")
    return 0


def cmd_eval(args) -> int:
    """The model card's figures on sessions no training or design choice saw (predict/heldout.py), or
    with --first-step the shape library's word on each first step (predict/first_step.py)."""
    from gpuwatch.predict import heldout
    from gpuwatch.predict.dataset import sessions_under
    from gpuwatch.predict.model import DEFAULT_MODEL

    model_path = args.model or DEFAULT_MODEL
    if args.output is not None:
        from gpuwatch.atomic import check_output_file

        check_output_file(args.output, "-o")
    paths = list(args.sessions)
    for d in args.sets:
        found = sessions_under(d)
        if not found:
            raise UsageError(f"--set {d}: no sessions under it")
        paths += found
    paths = paths or heldout.heldout_sessions(REPO)
    if args.first_step:
        from gpuwatch.predict import first_step
        from gpuwatch.predict.dataset import default_sessions

        out = first_step.report(default_sessions(REPO), paths, model_path, say=print)
    elif not paths:
        raise UsageError("no sessions given and none held out under recordings/heldout-*/")
    else:
        out = heldout.evaluate(paths, model_path, stride=args.stride, use_prior=not args.no_prior, say=print,
                               warn=lambda w: status(f"warning: {w}"))
    if args.output is not None:
        from gpuwatch.atomic import write_file

        write_file(args.output, json.dumps(out, indent=1, default=float))
    return 0


def cmd_backfill(args) -> int:
    from gpuwatch import backfill
    from gpuwatch.cli.parser import parse_recorded

    for s in args.sessions:
        print(backfill.run(s, args.check or args.compare, args.compare, args.refill, parse=parse_recorded), flush=True)
    return 0


def cmd_compact(args) -> int:
    from gpuwatch.recording.compact import compact_session

    status(compact_session(args.session))
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
        status(f"warning: {args.session} is one file: no steps or events beside it, so the risk is computed "
               "from what the file holds alone (score the session folder for the full picture)")
    for w in src.reader.warnings:  # a missing or unreadable table changes the alarms: say so
        status(f"warning: {w}")
    if src.steps_df.is_empty():
        status(f"warning: {args.session} has no steps: the risk is computed from the samples alone "
               "(fewer alarms than a session with its steps)")
    t0 = time.perf_counter()
    tl = score_source(src, model, stride=args.stride, progress=None if args.json else status, jobs=args.jobs)
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
    return run_tui(cfg, duration_s=args.duration, status=status)


HANDLERS = {"info": cmd_info, "record": cmd_record, "stress": cmd_stress, "train": cmd_train, "eval": cmd_eval,
            "score": cmd_score, "compact": cmd_compact, "backfill": cmd_backfill, "report": cmd_report}


def handler(command: str | None):
    """The function that runs `command` (live, watch and replay: the dashboard's)."""
    return HANDLERS.get(command, cmd_tui)
