"""From parsed flags to a running dashboard (live, watch, replay, follow)."""

from __future__ import annotations

import sys

from gpuwatch.recording.source import GpuMeta, LiveSource, ReplaySource


def _gpu_meta(session) -> list[GpuMeta]:
    if session.gpu is None:
        return []
    return [GpuMeta(g.index, g.name, g.mem_total_bytes, g.power_limit_w, g.temp_slowdown_c) for g in session.gpu.gpus]


def run_tui(args) -> int:
    from gpuwatch.ui.app import make_app

    if args.command == "replay":
        source = ReplaySource(args.path, follow=args.follow, speed=args.speed)
        for w in source.reader.warnings:  # skipped files: said after the screen closes, and shown in it
            print(f"gpuwatch: warning: {w}", file=sys.stderr)
        app = make_app(source)
        app.call_later(lambda: [app.notify(w, severity="warning", timeout=15) for w in source.reader.warnings])
        app.run()
        return 0
    from gpuwatch.runtime import Session

    session = Session(interval=args.interval, record_dir=args.output if args.record else None,
                      source=args.source, sampler=args.sampler)
    if args.command in (None, "live"):
        print("gpuwatch: loading torch and building the workload...", file=sys.stderr)
        _attach_workloads(session, args)
    label = getattr(session.gpu, "label", None) or "CPU-only"
    source = LiveSource(session.bus, _gpu_meta(session), label)
    session.start()
    try:
        app = make_app(source, session=session, interval_s=args.interval)
        if args.duration:
            app.call_later(lambda: app.set_timer(args.duration, app.exit))
        app.run()
    finally:
        session.stop()
    if session.recorder:
        r = session.recorder
        print(f"recording: {r.dir} ({r.rows} rows, {r.bytes} bytes)" + (f"; ERROR {r.error}" if r.error else ""))
    return 0


def _attach_workloads(session, args) -> None:
    """A workload that cannot start (no torch, bad config) is an event; the dashboard still runs."""
    from gpuwatch.errors import UsageError

    try:
        from gpuwatch.workload.cli import make_workloads

        for w in make_workloads(args, session.bus):
            session.attach_workload(w)
    except UsageError:
        raise
    except ImportError as e:
        session.bus.emit("workload_error", f"workload unavailable: {e}", "error")
