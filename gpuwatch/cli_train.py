"""`gpuwatch train`: its flags and its handler, beside the one parser in cli.py (which calls
`add_train_parser` with its own argument types, so this module imports nothing of the CLI's).

Sessions: with none given, the shipped H200 set (predict/dataset.py `default_sessions`, what models/README.md
reproduces). A path given is a session when it is one (it has meta.json or data files): named, so one that
is unusable (predict/usable.py) is a one-line error before anything is read further; any other folder is
searched for sessions (`dataset.find_sessions`), and one found there that is unusable is skipped, one line
each. --since/--until/--host/--scenario keep the sessions whose meta.json says so.
"""

from __future__ import annotations

import argparse
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Callable

from gpuwatch.errors import UsageError

__all__ = ["add_train_parser", "cmd_train", "parse_when"]


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


def _path_or_url(text: str) -> Path | str:
    from gpuwatch.predict.remote import is_url

    return text if is_url(text) else Path(text)


def _dask(text: str) -> str:
    from gpuwatch.predict.parallel import parse_dask

    try:
        return parse_dask(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_train_parser(sub, pos_int: Callable, unit: Callable, dur: Callable) -> argparse.ArgumentParser:
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
    t.add_argument("--stride", type=pos_int, default=1, help="score every Nth sample (default 1 = every 100 ms)")
    t.add_argument("--no-eval", action="store_true", help="fit only; skip cross-validation and the card's figures")
    t.add_argument("--threshold", type=unit, default=None,
                   help="with --no-eval: the alarm threshold to write (e.g. the shipped model's)")
    t.add_argument("--horizon", type=dur, default=None, metavar="DUR",
                   help="predict failures this far ahead (default 5s)")
    t.add_argument("--threads", type=pos_int, default=None, metavar="N",
                   help="OpenMP threads per fit (default 2: the shipped model's bytes; 1 gives other bits)")
    t.add_argument("-j", "--jobs", type=pos_int, default=1, metavar="N",
                   help="processes for cutting windows and for the cross-validation folds (the same model for any N)")
    t.add_argument("--dask", type=_dask, metavar="ADDRESS",
                   help="run that work on the Dask cluster at ADDRESS (tcp://HOST:8786), or local:N for N worker "
                        "processes here (the same model; needs the extra gpuwatch[fleet])")
    t.add_argument("--no-sample", action="store_true",
                   help="fit on every window (default: the informative ones and a weighted sample of long quiet "
                        "stretches; evaluation always scores every window)")
    t.add_argument("--features", type=Path, metavar="DIR",
                   help="keep every window's features there, one Parquet file per GPU of a session")
    t.add_argument("--since", type=parse_when, metavar="WHEN", help="only sessions that started at or after WHEN")
    t.add_argument("--until", type=_until, metavar="WHEN",
                   help="only sessions that started before WHEN (a date: through that day)")
    t.add_argument("--host", action="append", metavar="PATTERN", help="only sessions recorded on a matching host")
    t.add_argument("--scenario", action="append", metavar="PATTERN",
                   help="only sessions of a matching kind of run (ramp-train, nearcap-*, leak, ...; the card lists them)")
    return t


def cmd_train(args, status: Callable[[str], None]) -> int:
    from gpuwatch.predict.remote import is_url, local_copies

    if any(is_url(p) for p in args.sessions):
        status("copying the sessions in object storage to a local folder for this run...")
    with local_copies(args.sessions) as given:
        return _train(args, given, status)


def _train(args, given: list[Path], status: Callable[[str], None]) -> int:
    from gpuwatch.predict.dataset import HORIZON_S, Filters, default_sessions, find_sessions
    from gpuwatch.predict.model import check_output
    from gpuwatch.predict.train import FIT_THREADS, train
    from gpuwatch.predict.usable import open_usable

    root = Path(__file__).resolve().parents[1]
    found = find_sessions(given or default_sessions(root), Filters(args.since, args.until, args.host,
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
        (f" --threads {args.threads}" if args.threads not in (None, FIT_THREADS) else "") + f" -o {args.output}" + \
        ("" if not args.sessions and not found.said else f" <{len(sessions)} sessions>")
    rep = train(sessions, args.output, progress=status, stride=args.stride, evaluate=not args.no_eval,
                horizon_s=args.horizon or HORIZON_S, threshold=args.threshold,
                counterfactual=not args.no_counterfactual, command=command, threads=args.threads or FIT_THREADS,
                jobs=args.jobs, dask=args.dask, sample=not args.no_sample, features_dir=args.features)
    m = rep.by_scenario
    if m is not None:
        print(f"{rep.model_path}: threshold {rep.threshold:.3f}; leave-one-scenario-out recall {m.recall or 0:.2f} "
              f"({m.caught}/{m.oom_events}), {m.false_alarms} false alarm(s) in {m.healthy_hours * 60:.1f} healthy min; "
              f"card {rep.card_path}")
    return 0
