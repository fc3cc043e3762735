"""``dlrover-hpc config``: the TOML configuration files, each flag's effective value and where
it came from (``show``), and single values for scripts (``get``; the sbatch templates)."""

from __future__ import annotations

import argparse
import difflib
import re

from dlrover_hpc import settings
from dlrover_hpc.cli import commands, run_args
from dlrover_hpc.cli.parser import Parser
from dlrover_hpc.cli.run_args import section_parser, section_parsers
from dlrover_hpc.cli.site_config import (
    COMMANDS,
    CONFIG_ENV,
    SITE_ENV,
    ConfigFiles,
    Layer,
    Origin,
    attribute,
    load,
    settings_of,
)
from dlrover_hpc.errors import ConfigError, UsageError

PRECEDENCE = f"flag > env {settings.PREFIX}<FLAG> > config > user > site > default"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "config",
        help="the TOML configuration: each flag's value and where it comes from",
        description="dlrover-run's and dlrover-hpc master's flags can be set in TOML files: "
        f"the site's (/etc/dlrover-hpc/config.toml, or ${SITE_ENV}), the user's "
        "($XDG_CONFIG_HOME/dlrover-hpc/config.toml, default ~/.config) and --config FILE (or "
        f"${CONFIG_ENV}), under [run] and [master], keys named as the long flags with "
        f"underscores (max_restarts = 7). Precedence: {PRECEDENCE}.",
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = actions.add_parser(
        "show",
        help="every setting: its value and where it came from",
        description="Read and check the files, then print each setting of dlrover-run "
        "([run]) and dlrover-hpc master ([master]): its value and where it came from (the "
        "built-in default, an environment variable, or FILE:LINE).",
    )
    show.add_argument("--config", metavar="FILE", help=f"the --config file (default ${CONFIG_ENV})")
    show.add_argument(
        "section", nargs="?", choices=list(COMMANDS), help="only this section (default: both)"
    )
    show.set_defaults(func=_show)
    get = actions.add_parser(
        "get",
        help="values of settings, one a line (for scripts)",
        description="Print the value of each SECTION.KEY (e.g. run.max_restarts), one a line, "
        "empty for none. After '--', dlrover-run's arguments: the run.* values are then what "
        "dlrover-run resolves with them, and their --config is the --config file. run.config "
        "prints the --config file's absolute path (empty: none).",
    )
    get.add_argument("--config", metavar="FILE", help=f"the --config file (default ${CONFIG_ENV})")
    get.add_argument(
        "words",
        nargs=argparse.REMAINDER,
        metavar="SECTION.KEY ... [-- DLROVER_RUN_ARGS]",
        help="settings to print, e.g. run.max_restarts master.drain",
    )
    get.set_defaults(func=_get)


def check(section: str, files: ConfigFiles) -> None:
    """The checks its command runs on the merged values (``max_restarts = -3``, ``nnodes =
    "4:2"``): a ConfigError naming FILE:LINE or the variable, as the command would.

    A check that names two flags (``--node-unit=2`` larger than ``--nnodes``) is about how
    values combine, which the command line may settle (a site's ``node_unit = 8`` and a job's
    ``--nnodes=16``): those flags are set back to their built-in defaults and the rest checked.
    """
    parser = section_parser(section, files)
    if isinstance(parser, Parser):
        parser.raise_errors = True
    args = parser.parse_args(["train.py"] if section == "run" else [])
    actions = settings_of(parser)
    for _ in range(len(actions)):
        try:
            _build(section, args)
            return
        except ConfigError as exc:
            named = {f.replace("-", "_") for f in re.findall(r"--([a-z][a-z0-9-]*)", str(exc))}
            if len(named) < 2 or not named <= set(actions):
                raise
            for key in named:
                setattr(args, key, _builtin(section, actions[key]))


def _build(section: str, args: argparse.Namespace) -> None:
    if section != "run":
        commands.master_config(args)  # names the file and line itself
        return
    try:
        run_args.config_from_args(args)
    except ConfigError as exc:
        raise ConfigError(attribute(str(exc), args)) from None


def _builtin(section: str, action: argparse.Action) -> object:
    """The flag's built-in default, as its parser would have made it."""
    setting = next(
        s for s in settings.BY_COMMAND[settings.Command(section)] if s.key == action.dest
    )
    text = setting.text
    return action.type(text) if isinstance(text, str) and callable(action.type) else text


def _show(args: argparse.Namespace) -> int:
    files = load(args.config, section_parsers())
    for section in [args.section] if args.section else list(COMMANDS):
        check(section, files)
    print("files, lowest precedence first:")
    for line in describe_files(files):
        print(f"  {line}")
    print(f"precedence: {PRECEDENCE}")
    print()
    rows = [("section", "key", "value", "source")]
    for section in [args.section] if args.section else list(COMMANDS):
        origins: dict[str, Origin] = section_parser(section, files).get_default("origins")
        rows += [(section, key, _shown(o.value), o.describe()) for key, o in origins.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join([*(cell.ljust(w) for cell, w in zip(row, widths, strict=False)), row[3]]))
    return 0


def describe_files(files: ConfigFiles) -> list[str]:
    lines = []
    for file in files.files:
        state = "" if file.found else " (not found)"
        named = f" ({file.named_by})" if file.named_by else ""
        lines.append(f"{file.layer.value:<7} {file.path}{named}{state}")
    if not any(f.layer is Layer.CONFIG for f in files.files):
        lines.append(f"{Layer.CONFIG.value:<7} none (--config FILE or ${CONFIG_ENV})")
    return lines


def _shown(value: object) -> str:
    if value is None:
        return "(none)"
    return '""' if value == "" else plain(value)


def plain(value: object) -> str:
    """A value as a script reads it: true/false, empty for none."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _get(args: argparse.Namespace) -> int:
    words: list[str] = list(args.words)
    cut = words.index("--") if "--" in words else len(words)
    keys = [_check_key(word) for word in words[:cut]]
    if not keys:
        raise UsageError("name at least one SECTION.KEY, e.g. run.max_restarts")
    run = run_args.parse_args(words[cut + 1 :], config=args.config) if cut < len(words) else None
    files = load((run.config if run else None) or args.config, section_parsers())
    for section in dict.fromkeys(section for section, _ in keys):
        if section == "run" and run is not None:
            try:
                run_args.config_from_args(run)
            except ConfigError as exc:
                raise ConfigError(attribute(str(exc), run)) from None
        else:
            check(section, files)
    origins = {s: section_parser(s, files).get_default("origins") for s in COMMANDS}
    for section, key in keys:
        if key == "config":
            value: object = files.config_path()
        elif section == "run" and run is not None:
            value = getattr(run, key)
        else:
            value = origins[section][key].value
        print(plain(value))
    return 0


def _check_key(word: str) -> tuple[str, str]:
    section, dot, key = word.partition(".")
    if not dot or section not in COMMANDS:
        raise UsageError(
            f"{word}: expected SECTION.KEY, SECTION one of "
            f"{', '.join(COMMANDS)} (e.g. run.max_restarts)"
        )
    keys = [*settings_of(section_parser(section)), "config"]
    if key not in keys:
        close = difflib.get_close_matches(key.replace("-", "_"), keys, n=1, cutoff=0.6)
        fix = (
            f"did you mean {section}.{close[0]}?"
            if close
            else f"see 'dlrover-hpc config show {section}'"
        )
        raise UsageError(f"{word}: {COMMANDS[section]} has no such flag; fix: {fix}")
    return section, key
