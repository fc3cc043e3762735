"""``dlrover-run`` flags: every torchrun flag, plus dlrover-hpc's own.

Each torchrun flag declares how dlrover-run treats it (:class:`dlrover_hpc.settings.Parity`):
with torchrun's meaning, with a meaning of its own, ignored (a warning at start names it), or
refused (exit 2 naming it and what to do instead).  docs/reference/torchrun.md is the table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Sequence

from dlrover_hpc import injections, settings, version_line
from dlrover_hpc.agent import health
from dlrover_hpc.cli import site_config
from dlrover_hpc.cli.commands import master_parser
from dlrover_hpc.cli.parser import Parser
from dlrover_hpc.cli.site_config import ConfigFiles, Defaults
from dlrover_hpc.config import RunConfig, parse_hang_timeout
from dlrover_hpc.errors import ConfigError
from dlrover_hpc.settings import Command, Setting, Treatment

DESCRIPTION = """\
Start one dlrover-hpc agent on this node: join the job master's rendezvous, spawn
--nproc-per-node workers with torchrun's environment, supervise and restart them, and host
the node's flash-checkpoint saver.  Accepts torchrun's flags: the few it ignores or
refuses say so (docs/reference/torchrun.md).

examples:
  dlrover-run --standalone --nproc-per-node=2 train.py --steps 100
  srun dlrover-run --nnodes=3:4 --nproc-per-node=2 --max-restarts=3 train.py
"""


def build_parser(defaults: Defaults | None = None) -> argparse.ArgumentParser:
    """dlrover-run's parser; ``defaults``: the flags' defaults (environment only when None)."""
    defaults = defaults or Defaults(Command.RUN.value)
    p = Parser(
        prog="dlrover-run",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("--version", action="version", version=version_line())
    t = p.add_argument_group("torchrun's flags (docs/reference/torchrun.md: where they differ)")
    d = p.add_argument_group("dlrover-hpc flags")
    for setting in settings.BY_COMMAND[Command.RUN]:
        defaults.add(d if setting.torchrun is None else t, setting)
    p.add_argument("training_script", help="the training script (or module with -m)")
    p.add_argument(
        "training_script_args", nargs=argparse.REMAINDER, help="arguments of the training script"
    )
    p.set_defaults(origins=defaults.origins)  # where each default came from, for error messages
    return p


def section_parser(section: str, files: ConfigFiles | None = None) -> argparse.ArgumentParser:
    """The parser whose flags a section of the TOML files sets, with the files' defaults."""
    defaults = Defaults(section, files)
    return build_parser(defaults) if section == "run" else master_parser(defaults)


def section_parsers() -> dict[str, argparse.ArgumentParser]:
    return {section: section_parser(section) for section in site_config.COMMANDS}


def _given(args: argparse.Namespace, treatment: Treatment) -> list[tuple[Setting[object], str]]:
    """The torchrun flags of ``treatment`` that were given a value other than their built-in
    default (on the command line, in the environment or a file), each with the value as given."""
    given = []
    for setting in settings.BY_COMMAND[Command.RUN]:
        parity = setting.torchrun
        value = getattr(args, setting.key, None)
        if parity is not None and parity.treatment is treatment and value != _builtin(setting):
            given.append((setting, "" if isinstance(value, bool) else f"={value}"))
    return given


def _builtin(setting: Setting[object]) -> object:
    """The built-in default as the parser reads it (an int flag's "-1" is -1)."""
    text = setting.text
    if isinstance(text, str) and setting.kind in (settings.Kind.INT, settings.Kind.FLOAT):
        return (int if setting.kind is settings.Kind.INT else float)(text)
    return text


def refuse(args: argparse.Namespace) -> None:
    """A refused torchrun flag, given, is a ConfigError naming it, why and what to do."""
    for setting, value in _given(args, Treatment.REFUSED):
        assert setting.torchrun is not None
        raise ConfigError(f"{setting.flag}{value} (torchrun's): {setting.torchrun.why}")


def ignored_notices(args: argparse.Namespace) -> tuple[str, ...]:
    """One warning for each ignored torchrun flag that was given, naming it and why."""
    return tuple(
        f"{setting.flag}{value} ignored (torchrun's flag): {setting.torchrun.why}"
        for setting, value in _given(args, Treatment.IGNORED)
        if setting.torchrun is not None
    )


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """Parsed flags as a :class:`RunConfig`; raises ConfigError (exit 2) naming the flag and fix."""
    refuse(args)
    hang_timeout_s = parse_hang_timeout(str(args.hang_timeout))
    if args.standalone and args.rdzv_endpoint:
        raise ConfigError(
            f"--standalone runs its own in-process master on this node; drop "
            f"--rdzv-endpoint={args.rdzv_endpoint}, or drop --standalone for a multi-node job"
        )
    values = site_config.config_values(args, Command.RUN)
    values["hang_timeout_s"] = hang_timeout_s  # checked first, as before
    return RunConfig(
        **values,
        training_script=args.training_script,
        training_script_args=tuple(args.training_script_args),
        off=frozenset(i.name for i in injections.ALL if args.transparent or getattr(args, i.key)),
    )


def check_script(config: RunConfig) -> None:
    """A missing script would fail every worker and spend the restarts: say so before starting."""
    script = config.training_script
    if config.module:
        return  # a module is found by the worker's Python (its sys.path), not here
    if config.no_python:
        found = os.path.isfile(script) if os.sep in script else shutil.which(script) is not None
        if not found:
            raise ConfigError(
                f"{script}: no such program (--no-python runs the script as an executable); "
                "check the name, or drop --no-python to run a Python script"
            )
        return
    if not os.path.isfile(script):
        where = "" if os.path.isabs(script) else f" in {os.getcwd()}"
        raise ConfigError(
            f"training script {script}: no such file{where}; check the path, or run a module "
            "with -m (e.g. dlrover-run -m pkg.train)"
        )


def parse_args(argv: Sequence[str], *, config: str | None = None) -> argparse.Namespace:
    """The flags over their environment variables over the TOML files (exit 2 on an error).

    The first pass finds ``--config`` (the training script's own flags are not dlrover-run's);
    the second parses again with the files' defaults, once every file has been checked.
    ``config``: the file when the flags name none (``dlrover-hpc config get``'s).
    """
    first = build_parser()
    args = first.parse_args(argv)
    try:
        files = site_config.load(
            args.config or config, {"run": first, "master": section_parser("master")}
        )
    except ConfigError as exc:
        first.exit(2, f"dlrover-run: error: {exc}\n")
    return section_parser("run", files).parse_args(argv)


def parse(argv: Sequence[str] | None = None) -> RunConfig:
    return parse_with_notices(argv)[0]


def parse_with_notices(argv: Sequence[str] | None = None) -> tuple[RunConfig, tuple[str, ...]]:
    """The config, and the warnings to log once at start (:func:`ignored_notices`)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = config_from_args(args)
        check_script(config)
        health.check_program(config.health_check)
    except ConfigError as exc:
        print(f"dlrover-run: error: {site_config.attribute(str(exc), args)}", file=sys.stderr)
        raise SystemExit(2) from None
    return config, ignored_notices(args)
