"""``dlrover-run``: the per-node agent, a drop-in for torchrun."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from dlrover_hpc.cli.logsetup import setup_logging
from dlrover_hpc.cli.run_args import parse
from dlrover_hpc.errors import DlroverHpcError, UsageError


def main(argv: Sequence[str] | None = None) -> int:
    config = parse(argv)
    setup_logging("agent")
    from dlrover_hpc.agent.launch import run_agent  # imports torch: only after parsing

    try:
        return run_agent(config)
    except UsageError as exc:
        print(f"dlrover-run: error: {exc}", file=sys.stderr)
        return 2
    except DlroverHpcError as exc:
        print(f"dlrover-run: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
