"""Command line: parses arguments and calls factories, nothing else.

  gpuwatch                      live dashboard + DeepSeek workload on the embedded default, recording on
  gpuwatch watch                live dashboard, no workload
  gpuwatch replay PATH          replay a session (time travel); --follow attaches to one being written
  gpuwatch info                 GPUs, driver, and what each metric reads on this machine
  gpuwatch record               headless recording
  gpuwatch stress               headless DeepSeek workload, recorded
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from gpuwatch import __version__
from gpuwatch.errors import GpuwatchError, UsageError
from gpuwatch.units import parse_duration, parse_size


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, never a usage dump or traceback
        raise UsageError(f"{self.prog}: {message} (see --help)")


def _dur(text: str) -> float:
    try:
        return parse_duration(text)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _pos_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return v


def _interval(text: str) -> float:
    v = _dur(text)
    if not 0.01 <= v <= 60:
        raise argparse.ArgumentTypeError(f"interval {text!r} out of range 10ms..60s")
    return v


def _common(p: argparse.ArgumentParser, record_default: bool) -> None:
    p.add_argument("--interval", type=_interval, default=0.1, metavar="DUR",
                   help="sampling interval (default 100ms)")
    p.add_argument("-o", "--output", type=Path, default=Path("recordings"), metavar="DIR",
                   help="where session folders are written (default recordings/)")
    p.add_argument("--record", action=argparse.BooleanOptionalAction, default=record_default,
                   help=f"write a recording (default: {'on' if record_default else 'off'})")
    p.add_argument("--sampler", choices=["process", "thread"], default="process",
                   help="sample in a child process (default; keeps 100 ms under a busy GIL) or a thread")
    p.add_argument("--source", metavar="SESSION",
                   help="replay a recorded session as if it were live (demo/tests; labelled REPLAY)")


def _workload_args(p: argparse.ArgumentParser) -> None:
    from gpuwatch.workload.presets import MODES, PRECISIONS, PRESETS, SCHEDULES

    p.add_argument("--preset", choices=sorted(PRESETS), help="model size (default: largest that fits)")
    p.add_argument("--mode", choices=MODES, default="prefill")
    p.add_argument("--schedule", choices=SCHEDULES, default="steady")
    p.add_argument("--precision", choices=PRECISIONS, default=None, help="default bf16 on GPU, fp32 on CPU")
    p.add_argument("--batch", type=_pos_int, help="batch size (default from preset)")
    p.add_argument("--seq-len", type=_pos_int, help="sequence length (default from preset)")
    p.add_argument("--max-batch", type=_pos_int, help="upper batch for sweep/ramp")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--gpus", default=None, help="'all' = one workload per GPU, or a list like 0,1")
    p.add_argument("--gpu-memory-limit", type=_size, metavar="SIZE",
                   help="make the GPU behave like a smaller card, e.g. 40GiB")
    p.add_argument("--leak-mib", type=float, default=0.0, help="fault: keep N MiB per step")
    p.add_argument("--fragment", action="store_true", help="fault: random sequence lengths")
    p.add_argument("--fp16-overflow", action="store_true", help="fault: scale activations to overflow fp16")
    p.add_argument("--integrity-every", type=_pos_int, default=50, metavar="STEPS",
                   help="run the same input twice every N steps and compare")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any DeepseekV3Config field, e.g. --set num_hidden_layers=4")
    p.add_argument("--seed", type=int, default=0)


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
    r.add_argument("path", type=Path)
    r.add_argument("--follow", action="store_true", help="attach to a session still being recorded")
    r.add_argument("--speed", type=float, default=1.0)
    sub.add_parser("info", help="GPUs, driver and what each metric reads here")
    rec = sub.add_parser("record", help="headless recording")
    _common(rec, record_default=True)
    rec.add_argument("--duration", type=_dur, default=None, metavar="DUR", help="stop after DUR (default: Ctrl-C)")
    s = sub.add_parser("stress", help="headless DeepSeek workload, recorded")
    _common(s, record_default=True)
    _workload_args(s)
    s.add_argument("--duration", type=_dur, default=None, metavar="DUR", help="stop after DUR")
    s.add_argument("--steps", type=_pos_int, default=None, help="stop after N steps")
    return p


def cmd_info(args) -> int:
    from gpuwatch.recording.backends import make_gpu_backend
    from gpuwatch.runtime import versions

    gpu, note = make_gpu_backend()
    print(f"gpuwatch {__version__}: {note}")
    if gpu is not None:
        print(f"driver {gpu.driver_version}, NVML {getattr(gpu, 'nvml_version', None)}")
        for g in gpu.gpus:
            print(f"GPU {g.index}: {g.name}  {g.pci_bus_id}  {g.uuid}")
            for field, how in gpu.probe(g.index).items():
                print(f"  {field:28s} {how}")
        gpu.close()
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions().items() if v))
    return 0


def _wait_until(deadline: float | None, done=None, poll_s: float = 0.5) -> None:
    """Sleep until the deadline, SIGTERM/Ctrl-C, or `done()` (checked every `poll_s`); one wake-up per
    poll, so a headless recorder costs nothing while it waits."""
    import threading

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.is_set():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0 or done is not None and done():
                return
            timeout = left
            if done is not None:
                timeout = poll_s if left is None else min(left, poll_s)
            stop.wait(timeout)
    except KeyboardInterrupt:
        pass


def cmd_record(args) -> int:
    from gpuwatch.runtime import Session

    # Nothing reads the ticks here but the recorder, which writes once a second: take them a second at
    # a time (one wake-up a second in this process instead of ten).
    s = Session(interval=args.interval, record_dir=args.output if args.record else None, source=args.source,
                sampler=args.sampler, deliver_s=1.0)
    print(f"gpuwatch: {s.gpu_note}", file=sys.stderr)
    s.start()
    if s.recorder:
        print(f"recording to {s.recorder.dir}", file=sys.stderr)
    _wait_until(time.monotonic() + args.duration if args.duration else None)
    s.stop()
    if s.recorder:
        r = s.recorder
        print(f"{r.dir}: {r.rows} rows, {r.bytes} bytes, {r.dropped} dropped, "
              f"{s.sampler.late_ticks} late ticks" + (f"; ERROR {r.error}" if r.error else ""))
        return 1 if r.error else 0
    return 0


def cmd_stress(args) -> int:
    from gpuwatch.workload.cli import run_stress

    return run_stress(args)


def cmd_tui(args) -> int:
    from gpuwatch.ui.launch import run_tui

    return run_tui(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
            argv = ["live", *argv]
        args = build_parser().parse_args(argv)
        handler = {"info": cmd_info, "record": cmd_record, "stress": cmd_stress}.get(args.command, cmd_tui)
        return handler(args)
    except GpuwatchError as e:
        print(f"gpuwatch: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
