"""Site and user configuration files (TOML): defaults of ``dlrover-run``'s and ``dlrover-hpc
master``'s flags.

Where a flag's value comes from, the first found wins:

1. the flag on the command line;
2. the flag's environment variable (:data:`dlrover_hpc.settings.PREFIX` and the key in
   capitals, unless its declaration names another; an empty value counts as unset);
3. the file named by ``--config FILE``, else by ``--config``'s variable;
4. the user's file, ``$XDG_CONFIG_HOME/dlrover-hpc/config.toml`` (default ``~/.config``);
5. the site's file, ``/etc/dlrover-hpc/config.toml`` (the site-config variable names
   another; set empty: none);
6. the flag's built-in default.

A file has one section per command, ``[run]`` (dlrover-run) and ``[master]`` (dlrover-hpc
master); its keys are the long flags with underscores (``max_restarts = 7``,
``network_check = true``).  Every file is read and checked against the commands' own parsers
(keys, the flags' types and choices) before any value is used; an error names FILE:LINE and the
fix.  Strings may use ``$VAR`` / ``${VAR}`` (environment variables, expanded when read; an unset
one stays as written) and a leading ``~``.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import enum
import json
import os
import re
import tomllib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dlrover_hpc import settings
from dlrover_hpc.cli.toml_lines import locate
from dlrover_hpc.errors import ConfigError
from dlrover_hpc.settings import Kind, Setting

SITE_FILE = "/etc/dlrover-hpc/config.toml"
SITE_ENV = settings.SITE_CONFIG.env
CONFIG_ENV = settings.CONFIG.env
#: The sections of a file and the command whose flags each sets.
COMMANDS = {
    settings.Command.RUN.value: "dlrover-run",
    settings.Command.MASTER.value: "dlrover-hpc master",
}
#: A switch set by the environment: these turn an off switch on, those an on switch off.
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
#: Names that are a command's own arguments, not settings: why they have no place in a file.
_NOT_SETTINGS = {
    "training_script": "the training script is given on the command line",
    "training_script_args": "the training script's arguments are given on the command line",
    "config": f"a file cannot name another; pass --config FILE or set {CONFIG_ENV}",
    "version": "--version prints the version and exits; there is nothing to set",
    "help": "not a setting",
}

Scalar = str | int | float | bool


class Layer(enum.Enum):
    SITE = "site"
    USER = "user"
    CONFIG = "config"


class Source(enum.Enum):
    DEFAULT = "default"
    ENV = "env"
    FILE = "file"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Entry:
    """One ``key = value`` of a file's section, checked against its flag."""

    section: str
    key: str
    value: Scalar  # as the file has it
    text: str  # as the flag would be given it (variables expanded); "true"/"false" for a switch
    path: str
    line: int

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    def shown(self) -> str:
        return f"[{self.section}] {self.key} = {toml_value(self.value)}"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ConfigFile:
    layer: Layer
    path: str
    named_by: str | None  # the flag or variable that named it; None: the standard place
    found: bool
    entries: tuple[Entry, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ConfigFiles:
    """The files, lowest precedence first (site, user, --config); every entry checked."""

    files: tuple[ConfigFile, ...] = ()

    def entry(self, section: str, key: str) -> Entry | None:
        for file in reversed(self.files):
            for entry in file.entries:
                if (entry.section, entry.key) == (section, key):
                    return entry
        return None

    def config_path(self) -> str | None:
        """The ``--config`` file (the flag's, or its variable's), absolute; None without one."""
        return next((os.path.abspath(f.path) for f in self.files if f.layer is Layer.CONFIG), None)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Origin:
    """A flag's default and where it came from."""

    value: str | bool | None
    source: Source
    env: str  # the variable that sets it
    entry: Entry | None = None

    def describe(self) -> str:
        if self.entry is not None:
            return self.entry.where
        return f"env {self.env}" if self.source is Source.ENV else "default"

    def hint(self) -> str:
        if self.entry is not None:
            return f"from {self.entry.where}: {self.entry.shown()}"
        return f"from {self.env}={self.value}" if self.source is Source.ENV else ""


class Defaults:
    """The default of each flag of one section: the environment, else the files (the highest
    layer that sets it), else the built-in one.  ``origins`` records each, for ``config show``
    and error messages; a parser keeps it as its ``origins`` default."""

    def __init__(
        self, section: str, files: ConfigFiles | None = None, env: Mapping[str, str] | None = None
    ) -> None:
        self.section = section
        self.files = files or ConfigFiles()
        self.env = os.environ if env is None else env
        self.origins: dict[str, Origin] = {}

    def value(self, setting: Setting[Any]) -> str | None:
        """A flag's default: its variable, else the files, else its built-in text."""
        key, name, builtin = setting.key, setting.env, setting.text
        entry = self.files.entry(self.section, key)
        if self.env.get(name):
            origin = Origin(value=self.env[name], source=Source.ENV, env=name)
        elif entry is not None:
            origin = Origin(value=entry.text, source=Source.FILE, env=name, entry=entry)
        else:
            origin = Origin(value=builtin, source=Source.DEFAULT, env=name)
        self.origins[key] = origin
        return typing.cast(str | None, origin.value)

    def switch(self, setting: Setting[bool]) -> bool:
        """A switch (``key = true``); the environment turns it on with 1/true/yes/on, or off
        with 0/false/no/off; any other value is a ConfigError naming the variable."""
        key, name, builtin = setting.key, setting.env, setting.default
        entry = self.files.entry(self.section, key)
        text = self.env.get(name, "").strip().lower()
        if text:
            origin = Origin(value=env_switch(name, text), source=Source.ENV, env=name)
        elif entry is not None:
            origin = Origin(value=bool(entry.value), source=Source.FILE, env=name, entry=entry)
        else:
            origin = Origin(value=builtin, source=Source.DEFAULT, env=name)
        self.origins[key] = origin
        return bool(origin.value)

    def add(self, group: argparse._ActionsContainer, setting: Setting[Any]) -> None:
        """``setting``'s flag, its default from here (the section's command's spellings)."""
        command = settings.Command(self.section)
        flags, help = setting.flags_in(command), setting.help_for(command)
        if setting.kind is Kind.SWITCH:
            group.add_argument(
                *flags,
                dest=setting.key,
                action="store_true",
                default=self.switch(setting),
                help=help,
            )
            return
        if setting.kind is Kind.ON_OFF:
            group.add_argument(
                *flags,
                dest=setting.key,
                action=argparse.BooleanOptionalAction,
                default=self.switch(setting),
                help=help,
            )
            return
        kind: Any = _TYPES.get(setting.kind)  # None: the text as it is
        group.add_argument(
            *flags,
            dest=setting.key,
            type=kind,
            choices=list(setting.choices) if setting.choices is not None else None,
            default=self.value(setting) if setting.in_file else None,
            metavar=setting.metavar,
            help=help,
        )


_TYPES: dict[Kind, type] = {Kind.INT: int, Kind.FLOAT: float}


def env_switch(name: str, value: str) -> bool:
    """A switch's variable, as strict as a file's ``key = true``: 1/true/yes/on or
    0/false/no/off (any case); anything else is a ConfigError naming the variable."""
    text = value.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(
        f"{name}={value}: expected a switch: {'/'.join(_TRUE)} or {'/'.join(_FALSE)}; fix: "
        f"export {name}=1 (or 0), or unset it"
    )


def config_values(args: argparse.Namespace, command: settings.Command) -> dict[str, Any]:
    """The config's fields that ``command``'s settings set, each through its parser (in the
    order of the flags, so that the first bad one is the one named); None stays None."""
    values: dict[str, Any] = {}
    for setting in settings.BY_COMMAND[command]:
        field = setting.config_field
        if field is None:
            continue
        value = getattr(args, setting.key)
        if setting.parse is not None and value is not None:
            value = setting.parse(str(value))
        values[field] = value
    return values


# ------------------------------------------------------------------ finding and reading files
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Place:
    layer: Layer
    path: str
    named_by: str | None  # None: the standard place, which may be absent


def places(config: str | None, env: Mapping[str, str] | None = None) -> list[Place]:
    """Where the files are, lowest precedence first."""
    env = os.environ if env is None else env
    site = env.get(SITE_ENV)
    out = []
    if site is None:
        out.append(Place(layer=Layer.SITE, path=SITE_FILE, named_by=None))
    elif site:
        out.append(Place(layer=Layer.SITE, path=site, named_by=SITE_ENV))
    xdg = env.get("XDG_CONFIG_HOME", "")
    base = xdg if os.path.isabs(xdg) else os.path.join(_home(env), ".config")
    out.append(
        Place(
            layer=Layer.USER, path=os.path.join(base, "dlrover-hpc", "config.toml"), named_by=None
        )
    )
    if config:
        out.append(Place(layer=Layer.CONFIG, path=config, named_by="--config"))
    elif env.get(CONFIG_ENV):
        out.append(Place(layer=Layer.CONFIG, path=env[CONFIG_ENV], named_by=CONFIG_ENV))
    return out


def load(
    config: str | None,
    sections: Mapping[str, argparse.ArgumentParser],
    env: Mapping[str, str] | None = None,
) -> ConfigFiles:
    """Read and check every file (``config``: the ``--config`` flag's); raises ConfigError
    naming the file, the line and the fix.  ``sections``: the parser of each section's flags."""
    env = os.environ if env is None else env
    settings = {name: settings_of(parser) for name, parser in sections.items()}
    return ConfigFiles(
        files=tuple(_load_one(place, settings, env) for place in places(config, env))
    )


def settings_of(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """A parser's flags that a file may set, by key (the flag's dest)."""
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest not in _NOT_SETTINGS}


def _home(env: Mapping[str, str]) -> str:
    return env.get("HOME") or os.path.expanduser("~")


_LABEL = {
    Layer.SITE: "site configuration",
    Layer.USER: "user configuration",
    Layer.CONFIG: "configuration",
}
_READ_FIX = {
    Layer.SITE: f"make it readable to all (chmod a+r), or set {SITE_ENV} to another file "
    "(empty: no site file)",
    Layer.USER: "make it readable (chmod u+r), or remove it",
    Layer.CONFIG: f"check the file given to --config or {CONFIG_ENV}",
}


def _load_one(
    place: Place, settings: Mapping[str, Mapping[str, argparse.Action]], env: Mapping[str, str]
) -> ConfigFile:
    path, named = place.path, f" (named by {place.named_by})" if place.named_by else ""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        if place.named_by is None:
            return ConfigFile(layer=place.layer, path=path, named_by=None, found=False)
        raise ConfigError(
            f"{path}: no such configuration file{named}; fix: check the path, or drop "
            f"{place.named_by}"
        ) from None
    except OSError as exc:
        raise ConfigError(
            f"{path}: cannot read this {_LABEL[place.layer]} file{named} "
            f"({exc.strerror}); fix: {_READ_FIX[place.layer]}"
        ) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text; fix: save the file as UTF-8") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(_syntax_error(path, str(exc))) from None
    entries = _entries(path, data, locate(text), settings, env)
    return ConfigFile(
        layer=place.layer, path=path, named_by=place.named_by, found=True, entries=entries
    )


def _syntax_error(path: str, message: str) -> str:
    match = re.search(r"\s*\(at line (\d+), column (\d+)\)$", message)
    if match:
        where = f"{path}:{match.group(1)}"
        what = f"{message[: match.start()]} (column {match.group(2)})"
    else:
        where, what = path, message.replace(" (at end of document)", " at the end of the file")
    return (
        f"{where}: not valid TOML: {what}; fix: write key = value lines under [run] or "
        '[master], strings in quotes, e.g. drain = "quarantine"'
    )


# ------------------------------------------------------------------ checking a file's contents
def _entries(
    path: str,
    data: Mapping[str, object],
    lines: Mapping[tuple[str, ...], int],
    settings: Mapping[str, Mapping[str, argparse.Action]],
    env: Mapping[str, str],
) -> tuple[Entry, ...]:
    found = []
    for section, table in data.items():
        line = lines.get((section,), 1)
        if section not in settings:
            raise ConfigError(_outside(path, line, section, table, settings))
        if not isinstance(table, dict):
            raise ConfigError(
                f"{path}:{line}: {section} = {toml_value(table)}: [{section}] is a section; "
                f"fix: write [{section}] on a line of its own and its keys below it"
            )
        for key, value in table.items():
            at = lines.get((section, key), line)
            action = settings[section].get(key)
            if action is None:
                raise ConfigError(_unknown_key(path, at, section, key, settings[section]))
            text = _flag_text(value, action, env)
            if isinstance(text, _Bad):
                shown = f"[{section}] {key} = {toml_value(value)}"
                raise ConfigError(
                    f"{path}:{at}: {shown}: {_flag(action)}: {text.what}; fix: {text.fix}"
                )
            scalar = typing.cast(Scalar, value)  # _flag_text took only these
            found.append(
                Entry(section=section, key=key, value=scalar, text=text, path=path, line=at)
            )
    return tuple(sorted(found, key=lambda e: e.line))


def _outside(
    path: str,
    line: int,
    name: str,
    value: object,
    settings: Mapping[str, Mapping[str, argparse.Action]],
) -> str:
    if isinstance(value, dict):
        close = difflib.get_close_matches(name, list(settings), n=1, cutoff=0.5)
        guess = f"did you mean [{close[0]}]? " if close else ""
        return (
            f"{path}:{line}: unknown section [{name}]; fix: {guess}the sections are {_sections()}"
        )
    owners = [f"[{s}]" for s, keys in settings.items() if name in keys]
    where = " or ".join(owners) if owners else _sections()
    return (
        f"{path}:{line}: {name} = {toml_value(value)} is outside a section; fix: put it under "
        f"{where}"
    )


def _sections() -> str:
    return ", ".join(f"[{s}] ({c})" for s, c in COMMANDS.items())


def _unknown_key(
    path: str, line: int, section: str, key: str, keys: Mapping[str, argparse.Action]
) -> str:
    command = COMMANDS.get(section, section)
    if key in _NOT_SETTINGS:
        return f"{path}:{line}: [{section}] {key}: {_NOT_SETTINGS[key]}; fix: remove this line"
    under = key.replace("-", "_")
    if under in keys:
        fix = f"write it with underscores: {under}"
    else:
        close = difflib.get_close_matches(key, list(keys), n=1, cutoff=0.6)
        fix = (
            f"did you mean {close[0]}?"
            if close
            else f"the keys are {command}'s long flags with underscores "
            f"(see 'dlrover-hpc config show {section}')"
        )
    return f"{path}:{line}: [{section}] {key}: {command} has no such flag; fix: {fix}"


@dataclasses.dataclass(frozen=True, slots=True)
class _Bad:
    what: str
    fix: str


def _flag(action: argparse.Action) -> str:
    return next((s for s in action.option_strings if s.startswith("--")), action.option_strings[0])


def _flag_text(value: object, action: argparse.Action, env: Mapping[str, str]) -> str | _Bad:
    """The string the flag would be given for ``value``, checked as argparse checks the flag's
    own (its type and choices); the checks of how values combine run when the command runs."""
    key = action.dest
    if action.nargs == 0:  # a switch
        if isinstance(value, bool):
            return "true" if value else "false"
        return _Bad("a switch takes true or false", f"write {key} = true (or false)")
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        return _Bad(f"expected {_kind(action)}, not {_type_name(value)}", _fix(action))
    text = _expand(value, env) if isinstance(value, str) else repr(value)
    converted: object = text
    if callable(action.type):
        try:
            converted = action.type(text)
        except (TypeError, ValueError):
            name = getattr(action.type, "__name__", repr(action.type))
            return _Bad(f"invalid {name} value: {text!r}", _fix(action))
    if action.choices is not None and converted not in action.choices:
        choices = ", ".join(repr(c) for c in action.choices)
        return _Bad(f"invalid choice: {text!r} (choose from {choices})", _fix(action))
    return text


def _kind(action: argparse.Action) -> str:
    if action.choices is not None:
        return "one of " + ", ".join(json.dumps(str(c)) for c in action.choices)
    if action.type is int:
        return "a whole number"
    return "a number" if action.type is float else "a string"


def _fix(action: argparse.Action) -> str:
    key = action.dest
    if action.choices is not None:
        return f"write {_kind(action)}, e.g. {key} = {json.dumps(str(next(iter(action.choices))))}"
    if action.type is int:
        return f"write a whole number, e.g. {key} = {_example(action, '3')}"
    if action.type is float:
        return f"write a number, e.g. {key} = {_example(action, '30')}"
    return f'write a string in quotes, e.g. {key} = "{_example(action, "...")}"'


def _example(action: argparse.Action, fallback: str) -> str:
    default = action.default
    return str(default) if default not in (None, "") else fallback


def _type_name(value: object) -> str:
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, list | dict):
        return "a list" if isinstance(value, list) else "a table"
    return type(value).__name__


_VAR = re.compile(r"\$(?:(\w+)|\{(\w+)\})")


def _expand(text: str, env: Mapping[str, str]) -> str:
    """``$VAR`` / ``${VAR}`` from ``env`` (an unset one stays as written), a leading ``~``."""
    text = _VAR.sub(lambda m: env.get(m.group(1) or m.group(2), m.group(0)), text)
    if text == "~" or text.startswith("~/"):
        text = _home(env) + text[1:]
    return text


def toml_value(value: object) -> str:
    """``value`` as a file would spell it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, dict):
        return "{...}"
    if isinstance(value, list):
        return "[...]"
    return str(value)


# ------------------------------------------------------------------ errors found later
def attribute(message: str, args: argparse.Namespace) -> str:
    """A command's check failed (``--nnodes=4:2: ...``): when the named flag's value came from a
    file or the environment, not the command line, say where, and how to fix it there."""
    origins: Mapping[str, Origin] = getattr(args, "origins", None) or {}
    for flag in re.findall(r"--([a-z][a-z0-9-]*)", message):
        dest = flag.replace("-", "_")
        origin = origins.get(dest)
        if origin is None or origin.source is Source.DEFAULT:
            continue
        if not _same(origin.value, getattr(args, dest, None)):
            continue  # the command line gave another value
        if origin.entry is not None:
            return (
                f"{origin.entry.where}: {origin.entry.shown()}: {message}; fix: change it "
                f"there, or override it with --{flag}"
            )
        return f"{message} (from {origin.env}={origin.value})"
    return message


def _same(default: str | bool | None, parsed: object) -> bool:
    """Whether the parsed value is the default as its flag's type reads it."""
    if not isinstance(parsed, int | float | str) or isinstance(parsed, bool) or default is None:
        return parsed == default
    try:
        return type(parsed)(default) == parsed
    except ValueError:
        return False
