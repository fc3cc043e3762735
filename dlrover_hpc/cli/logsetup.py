"""Logging configuration; only the CLI entry points call this."""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Callable

from dlrover_hpc.errors import DlroverHpcError, UsageError


class _ContextFilter(logging.Filter):
    def __init__(self, context: str) -> None:
        super().__init__()
        self.context = context

    def filter(self, record: logging.LogRecord) -> bool:
        record.ctx = self.context
        return True


def exit_code_of(prog: str, command: Callable[[], int]) -> int:
    """Run ``command``; bad usage or input exits 2, our other errors 1, Ctrl-C 130."""
    try:
        return int(command())
    except UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except DlroverHpcError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


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
    root.setLevel(level or os.environ.get("DLROVER_HPC_LOG_LEVEL", "INFO"))
