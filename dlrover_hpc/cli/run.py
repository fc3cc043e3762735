"""``dlrover-run``: the per-node agent, a drop-in for torchrun."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from dlrover_hpc.cli.logsetup import exit_code_of, setup_logging
from dlrover_hpc.cli.run_args import parse


def main(argv: Sequence[str] | None = None) -> int:
    config = parse(argv)
    setup_logging("agent")
    from dlrover_hpc.agent.launch import run_agent  # imports torch: only after parsing

    return exit_code_of("dlrover-run", lambda: run_agent(config))


if __name__ == "__main__":
    sys.exit(main())
