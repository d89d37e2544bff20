"""`python -m gpuwatch.report SESSION [-o PATH] [--format html|md]`: the report without the full CLI."""

from __future__ import annotations

import argparse
import sys

from gpuwatch.errors import GpuwatchError, UsageError
from gpuwatch.report import register


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, as in gpuwatch.cli
        raise UsageError(f"{self.prog}: {message} (see --help)")


def main(argv: list[str] | None = None) -> int:
    try:
        p = _Parser(prog="gpuwatch")
        register(p.add_subparsers(dest="command", parser_class=_Parser, required=True))
        args = p.parse_args(["report", *(sys.argv[1:] if argv is None else argv)])
        return args.handler(args)
    except GpuwatchError as e:
        print(f"gpuwatch: error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
