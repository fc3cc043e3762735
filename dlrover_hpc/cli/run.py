"""``dlrover-run``: the per-node agent, a drop-in for torchrun."""

from __future__ import annotations

import dataclasses
import logging
import socket
import sys
from collections.abc import Sequence

from dlrover_hpc import environ
from dlrover_hpc.cli.logsetup import exit_code_of, quiet_pipe, setup_logging
from dlrover_hpc.cli.run_args import parse_with_notices
from dlrover_hpc.config import RunConfig
from dlrover_hpc.errors import DlroverHpcError

log = logging.getLogger(__name__)

_START_MASTER = (
    "start the job master first ('dlrover-hpc master'; the sbatch templates do), or fix "
    f"--master / {environ.MASTER}"
)


def _run_agent(config: RunConfig) -> int:
    from dlrover_hpc.agent.launch import run_agent  # imports torch: only after parsing

    try:
        return run_agent(config)
    except ConnectionRefusedError as exc:
        raise DlroverHpcError(
            f"cannot reach the job master: {exc.strerror} (connection refused); {_START_MASTER}"
        ) from None
    except socket.gaierror as exc:
        raise DlroverHpcError(
            f"cannot resolve the job master's host ({exc.strerror}); {_START_MASTER}"
        ) from None


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)

    def command() -> int:
        config, notices = parse_with_notices(args)
        # The same interpreter and flags: the master relaunches this agent with it (srun -w NODE).
        launch = (sys.executable, "-m", "dlrover_hpc.cli.run", *args)
        config = dataclasses.replace(config, launch_argv=launch)
        setup_logging("agent")
        for notice in notices:  # once, at start: torchrun's flags that do nothing here
            log.warning(notice)
        return _run_agent(config)

    return quiet_pipe(lambda: exit_code_of("dlrover-run", command))


if __name__ == "__main__":
    sys.exit(main())
