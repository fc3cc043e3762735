"""``dlrover-hpc``: the job master, topology tools, drain, launch, status, stacks, config and
local-slurm."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from dlrover_hpc import version_line
from dlrover_hpc.cli import (
    commands,
    config_command,
    control,
    launch,
    local_slurm,
    template,
    topology,
)
from dlrover_hpc.cli.logsetup import exit_code_of, quiet_pipe, setup_logging
from dlrover_hpc.cli.parser import Parser, add_everywhere, chosen_parser
from dlrover_hpc.cli.run_args import section_parsers
from dlrover_hpc.cli.site_config import ConfigFiles, Defaults, load

log = logging.getLogger(__name__)


def build_parser(files: ConfigFiles | None = None) -> argparse.ArgumentParser:
    """``files``: the TOML files the ``master`` flags' defaults come from (None: none)."""
    parser = Parser(
        prog="dlrover-hpc",
        description="Fault-tolerant, elastic PyTorch training on Slurm and bare metal. "
        "Agents are started with dlrover-run; this command runs the job master and the tools.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.register_master(sub, Defaults("master", files))
    topology.register(sub)
    commands.register_drain(sub)
    launch.register_launch(sub)
    commands.register_status(sub)
    commands.register_stacks(sub)
    commands.register_report(sub)
    control.register_batch_size(sub)
    control.register_stop(sub)
    config_command.register(sub)
    local_slurm.register(sub)
    template.register(sub)
    # before or after the subcommand: `dlrover-hpc status --log-level DEBUG` too
    add_everywhere(parser, "--log-level", default=None, help="DEBUG, INFO (default), WARNING")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    return quiet_pipe(lambda: _main(args))


def _main(argv: list[str]) -> int:
    prog = "dlrover-hpc"  # the subcommand's, once it is known: errors start with it

    def command() -> int:
        nonlocal prog
        parser = build_parser()
        args = parser.parse_args(argv)
        prog = chosen_parser(parser, args).prog
        if args.command == "master":
            # The first pass found --config; every file is checked before any value is used.
            args = build_parser(load(args.config, section_parsers())).parse_args(argv)
        setup_logging(args.command, level=args.log_level)
        return int(args.func(args))

    return exit_code_of(lambda: prog, command)


if __name__ == "__main__":
    sys.exit(main())
