"""Errors that the CLI turns into one line on stderr and a non-zero exit code."""


class GpuwatchError(Exception):
    """A fatal, user-facing problem: printed as one line, exit code 1."""

    exit_code = 1


class UsageError(GpuwatchError):
    """A bad flag or value: exit code 2, like argparse."""

    exit_code = 2


class RecordingError(GpuwatchError):
    """A recording that cannot be opened (names the file)."""


class MissingExtra(UsageError, ModuleNotFoundError):
    """An optional dependency that a command or an import needs is not installed (`gpuwatch.extras`):
    one line naming the extra to install, exit code 2. A ModuleNotFoundError too, so a library import
    guarded by it is caught where a missing module is."""

    def __init__(self, message: str) -> None:
        UsageError.__init__(self, message)


class StopSignal(BaseException):
    """SIGTERM or SIGHUP while a command runs (the CLI's handler raises it): a BaseException like Ctrl-C's
    KeyboardInterrupt, so no `except Exception` swallows it and every reader's catch-all lets it through
    (`FATAL`) - a stop that cut into reading a Parquet file was reported as "columns of the wrong type". The
    CLI prints it as one line and exits 128 + the signal's number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


# what a catch-all around reading or writing must let through: Ctrl-C, a stop signal, interpreter exit
FATAL = (KeyboardInterrupt, StopSignal, SystemExit, GeneratorExit)
