"""Logging configuration; only the CLI entry points call this."""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Callable

from dlrover_hpc import environ
from dlrover_hpc.errors import DlroverHpcError, UsageError

log = logging.getLogger(__name__)
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class _ContextFilter(logging.Filter):
    def __init__(self, context: str) -> None:
        super().__init__()
        self.context = context

    def filter(self, record: logging.LogRecord) -> bool:
        record.ctx = self.context
        return True


#: The exit status of a command whose reader went away (``| head``): 128 + SIGPIPE, as a
#: command killed by the signal reports it in a shell.
BROKEN_PIPE = 141


def exit_code_of(prog: str | Callable[[], str], command: Callable[[], int]) -> int:
    """Run ``command``; bad usage or input exits 2, our other errors 1, Ctrl-C 130.

    Our errors are one line on stderr, ``PROG: error: ...`` (``prog``: the command's name, or
    a function that names it once it is known: ``dlrover-hpc master``), as the parsers print
    theirs.  So is an OSError about a named file (missing, not permitted, a directory): a path
    of the user's or the system's, not a bug; its traceback is logged at DEBUG.  Anything else
    is a bug and keeps its traceback.
    """

    def name() -> str:
        return prog if isinstance(prog, str) else prog()

    try:
        return int(command())
    except UsageError as exc:
        print(f"{name()}: error: {exc}", file=sys.stderr)
        return 2
    except DlroverHpcError as exc:
        print(f"{name()}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        raise  # quiet_pipe's
    except OSError as exc:
        if exc.filename is None or not exc.strerror:
            raise
        log.debug("command failed on a file", exc_info=True)
        what = exc.filename if exc.filename2 is None else f"{exc.filename} -> {exc.filename2}"
        print(
            f"{name()}: error: {what}: {exc.strerror.lower()}; check the path and its "
            f"permissions ({environ.LOG_LEVEL}=DEBUG shows where it failed)",
            file=sys.stderr,
        )
        return 1


def quiet_pipe(main: Callable[[], int]) -> int:
    """Run an entry point; when its reader goes away (``dlrover-hpc status --json | head -c1``)
    it ends quietly with :data:`BROKEN_PIPE`, no traceback.  Standard output is pointed at
    /dev/null, so that the interpreter's last flush at exit cannot fail again."""
    try:
        try:
            code = main()
        except SystemExit:  # --help, a usage error: its output is flushed here too
            sys.stdout.flush()
            raise
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):  # no file descriptor (a test's captured output)
            pass
        return BROKEN_PIPE


def setup_logging(role: str, *, level: str | None = None) -> None:
    job = os.environ.get("SLURM_JOB_ID", "")
    node = socket.gethostname().split(".")[0]
    context = f"{role}@{node}" + (f" job={job}" if job else "")
    handler = logging.StreamHandler()
    handler.addFilter(_ContextFilter(context))
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s [%(ctx)s] %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    name = (level or os.environ.get(environ.LOG_LEVEL) or "INFO").upper()
    if name not in _LEVELS:
        raise UsageError(
            f"log level {name!r} (--log-level or {environ.LOG_LEVEL}): expected one of "
            + ", ".join(_LEVELS)
        )
    root.setLevel(name)
