"""`python -m gpuwatch.report SESSION [-o PATH] [--format html|md]`: `gpuwatch report`, whose parser is the
CLI's (one parser, one set of one-line errors); an entry point, so it may import the CLI above it."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from gpuwatch.cli import main as cli_main

    return cli_main(["report", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
