"""The argument parser of every command: a usage error is one line, not the whole usage; every
flag's help shows its default; a wrong flag names the subcommand's help and the nearest flag."""

from __future__ import annotations

import argparse
import difflib
import functools
import os
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from dlrover_hpc import settings
from dlrover_hpc.errors import UsageError


class DefaultsShown(argparse.HelpFormatter):
    """Every flag's help ends with its default (unless it says it already, or has none), so a
    new flag cannot leave it out."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or not action.option_strings
            or default in (None, False, "", argparse.SUPPRESS)
            or action.nargs == 0  # a switch: off unless given (on: its help says so)
        ):
            return text
        return f"{text} (default: %(default)s)"


@functools.cache
def _shows_defaults(base: type[argparse.HelpFormatter]) -> type[argparse.HelpFormatter]:
    if issubclass(base, DefaultsShown):
        return base
    return type(f"{base.__name__}WithDefaults", (DefaultsShown, base), {})


class Parser(argparse.ArgumentParser):
    """``PROG: error: what is wrong; see 'PROG --help'`` on stderr, exit 2.

    Exit codes: docs/design/architecture.md section 4.

    Sub-command parsers are made with the parser's own class, so they answer the same way; an
    unknown flag after a subcommand is that subcommand's error (its help, its nearest flag).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # No abbreviations, in subcommands too: --max-restart is a typo, not --max-restarts.
        kwargs.setdefault("allow_abbrev", False)
        kwargs["formatter_class"] = _shows_defaults(
            kwargs.get("formatter_class", argparse.HelpFormatter)
        )
        super().__init__(*args, **kwargs)

    def _print_message(self, message: str, file: Any = None) -> None:
        """As argparse's, but a closed pipe is not hidden: the entry point ends quietly with
        141 (``logsetup.quiet_pipe``), as for any other output."""
        if message:
            (file or sys.stderr).write(message)

    #: raise a UsageError instead of printing and exiting (``config show`` parses the
    #: commands' flags to check their values, and reports under its own name)
    raise_errors = False

    def error(self, message: str) -> NoReturn:
        hint = self._default_hint(message) or _env_hint(message) or _choice_hint(message)
        if self.raise_errors:
            raise UsageError(f"{message}{hint}")
        self.exit(2, f"{self.prog}: error: {message}{hint}; see '{self.prog} --help'\n")

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            chosen = chosen_parser(self, parsed)
            chosen.error(f"unrecognized arguments: {' '.join(extras)}{_nearest(chosen, extras)}")
        return parsed

    def _default_hint(self, message: str) -> str:
        """A bad value that came from a flag's default: name the variable or the file and line
        that set it (the ``origins`` default of a parser built with ``site_config.Defaults``)."""
        match = re.match(r"argument ([\w-]+)", message)
        origins = self.get_default("origins")
        action = self._option_string_actions.get(match.group(1)) if match else None
        origin = origins.get(action.dest) if origins and action else None
        if origin is None or not origin.hint() or f"'{origin.value}'" not in message:
            return ""
        return f" ({origin.hint()})"


def _env_hint(message: str) -> str:
    """A bad value that came from a flag's variable (flag defaults): name the variable."""
    match = re.match(r"argument --([\w-]+)", message)
    if not match:
        return ""
    name = settings.PREFIX + match.group(1).replace("-", "_").upper()
    value = os.environ.get(name)
    return f" (from {name}={value})" if value is not None and f"'{value}'" in message else ""


def chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Any:
    """The (sub)parser of the subcommand that ``args`` chose (``dlrover-hpc topology order``)."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, subs[0].dest, None) if subs and subs[0].dest else None
        if not subs or name not in subs[0].choices:
            return parser
        parser = subs[0].choices[name]


def _nearest(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """`` (did you mean --flag?)`` for the first unknown flag close to one of the parser's."""
    flags = [f for f in parser._option_string_actions if f.startswith("--")]
    for word in extras:
        if word.startswith("-"):
            close = difflib.get_close_matches(word.split("=", 1)[0], flags, n=1, cutoff=0.6)
            if close:
                return f" (did you mean {close[0]}?)"
    return ""


def _choice_hint(message: str) -> str:
    """`` (did you mean 'master'?)`` for a mistyped subcommand or choice."""
    match = re.match(r".*invalid choice: '([^']*)' \(choose from (.*)\)$", message)
    if not match:
        return ""
    choices = re.findall(r"'([^']*)'", match.group(2))
    close = difflib.get_close_matches(match.group(1), choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def add_everywhere(parser: argparse.ArgumentParser, *flags: str, **kwargs: Any) -> None:
    """A flag of the command that its subcommands take too (``--log-level`` before or after
    the subcommand): the subcommands' copies set it only when given."""
    parser.add_argument(*flags, **kwargs)
    below = {**kwargs, "default": argparse.SUPPRESS}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases: one parser
                add_everywhere(sub, *flags, **below)
