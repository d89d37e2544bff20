"""Errors that the CLI turns into one line on stderr and a non-zero exit code."""


class GpuwatchError(Exception):
    """A fatal, user-facing problem: printed as one line, exit code 1."""

    exit_code = 1


class UsageError(GpuwatchError):
    """A bad flag or value: exit code 2, like argparse."""

    exit_code = 2


class RecordingError(GpuwatchError):
    """A recording that cannot be opened (names the file)."""
