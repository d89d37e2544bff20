"""Command line: `main` runs one command. The parser (every command's flags and their checks) is
`cli/parser.py`, the typed configs made from them `cli/configs.py`, the commands `cli/commands.py`.

  gpuwatch                      live dashboard + DeepSeek workload on the embedded default, recording on
  gpuwatch watch                live dashboard, no workload
  gpuwatch replay PATH          replay a session (time travel); --follow attaches to one being written
  gpuwatch info                 GPUs, driver, and what each metric reads on this machine
  gpuwatch record               headless recording
  gpuwatch stress               headless DeepSeek workload, recorded, risk-scored and guarded
  gpuwatch train                train the failure-risk model on recordings; writes it and its card
  gpuwatch eval                 score a model on held-out sessions (the card's held-out figures)
  gpuwatch score SESSION        the risk timeline of a recorded session
  gpuwatch report SESSION       a self-contained HTML (or Markdown) test report
  gpuwatch compact SESSION      a killed recording's files -> one Parquet file per table
  gpuwatch backfill SESSION...  fill the lookahead columns of sessions recorded before them

Errors: a user error (bad flag, unreadable input, a missing optional extra) exits 2 with one line; a
runtime fault exits 1 with one line; a signal ends a headless run cleanly (recording closed) with 128 +
the signal's number.
"""

from __future__ import annotations

import sys

from gpuwatch.errors import GpuwatchError, MissingExtra, StopSignal

__all__ = ["main"]


def _raise_stopped(signum, _frame):
    raise StopSignal(signum)


def main(argv: list[str] | None = None) -> int:
    import signal

    from gpuwatch.cli.commands import handler
    from gpuwatch.cli.parser import build_parser, fix_negative_values

    argv = sys.argv[1:] if argv is None else argv
    for sig in (signal.SIGTERM, signal.SIGHUP):  # train/score/report: a clean one-line stop too
        signal.signal(sig, _raise_stopped)  # (a running session installs its own handlers while it waits)
    try:
        if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
            argv = ["live", *argv]
        args = build_parser().parse_args(fix_negative_values(argv))
        return handler(args.command)(args)
    except MissingExtra as e:  # not the user's mistake: what to install, in one line
        print(f"gpuwatch: {e}", file=sys.stderr)
        return e.exit_code
    except GpuwatchError as e:
        print(f"gpuwatch: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("gpuwatch: interrupted", file=sys.stderr)
        return 130
    except StopSignal as e:
        print(f"gpuwatch: stopped by {signal.Signals(e.signum).name}", file=sys.stderr)
        return 128 + e.signum
    except OSError as e:  # a fault outside any session (a file we were told to write, say)
        print(f"gpuwatch: error: {e.strerror or e}: {e.filename or ''}".rstrip(": "), file=sys.stderr)
        return 1
