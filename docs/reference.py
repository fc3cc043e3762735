"""The generated parts of docs/reference/: flags, TOML keys, environment variables, events and
exit codes, each made from the code that defines them.

- flags.md, config-keys.md and environment.md: the declarations of
  ``dlrover_hpc/settings.py`` (flags, kind, default, choices, section, variable, help,
  commands); environment.md also lists ``dlrover_hpc/environ.py``'s names, split into those a
  user may set (:data:`USER_SET`) and those dlrover-hpc's processes hand one another;
- events.md: ``dlrover_hpc/events.py``'s members with their comments;
- exit-codes.md: ``dlrover_hpc/errors.py``'s types and the exit code
  ``cli/logsetup.exit_code_of`` gives each.

Each page keeps its own prose; only the text between ``<!-- generated: NAME
(docs/reference.py) -->`` and ``<!-- end generated -->`` is made here.  ``python
docs/reference.py`` says which pages are stale, ``--write`` rewrites them, and tests/test_docs.py
fails while any is stale.
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from dlrover_hpc import environ, errors, settings  # noqa: E402
from dlrover_hpc.cli import parity  # noqa: E402
from dlrover_hpc.settings import Command, Kind, Setting  # noqa: E402

PAGES = REPO / "docs" / "reference"
END = "<!-- end generated -->"

#: environ.py's names a user may set (the rest are written by dlrover-hpc's own processes for
#: one another, and setting them by hand breaks the job).  tests/test_docs.py fails when a new
#: name of environ.py is in neither set, so each new variable is placed on purpose.
USER_SET = frozenset(
    {
        "MASTER",
        "JOB_DIR",
        "TOKEN",
        "FORWARD_TIMING",
        "INPROCESS_WAIT_S",
        "SHM_DIR",
        "SPILL_DIR",
        "CKPT_DEVICE_SNAPSHOT",
        "CONTINUE_OPTS",
        "EVENT_LOOP",
        "SLURM_BACKEND",
        "PRELOAD",
        "LOG_LEVEL",
        "PYTHON",
    }
)
INTERNAL = frozenset(
    {
        "JOB_ID",
        "NODE_NAME",
        "SAVER_SOCKET",
        "ROUND",
        "PROGRESS_FILE",
        "REQUEUE_BY",
        "LOCAL_CKPT_DIR",
        "AGENT_PREFIX",
        "CRASH_KILL_AT",
        "REPLACES",
        "SBATCH_SCRIPT",
        "CONTINUATION",
        "SLURM_NODE_ID",
    }
)

COMMAND_NAMES = {
    Command.RUN: "dlrover-run",
    Command.MASTER: "dlrover-hpc master",
    Command.LAUNCH: "dlrover-hpc launch",
    Command.FILES: "every command",
}


def begin(name: str) -> str:
    return f"<!-- generated: {name} (docs/reference.py) -->"


def cell(text: object) -> str:
    """Text fit for a Markdown table cell: one line, its bars escaped, the docstrings'
    reStructuredText roles and double backquotes as Markdown code."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", " ".join(str(text).split()))
    return text.replace("``", "`").replace("|", "\\|")


def code(text: object) -> str:
    return f"`{text}`" if text not in (None, "") else ""


def table(header: Iterable[str], rows: Iterable[Iterable[object]]) -> list[str]:
    head = list(header)
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out.extend("| " + " | ".join(cell(c) for c in row) + " |" for row in rows)
    return out


# ------------------------------------------------------------------ settings
def value_of(setting: Setting[object]) -> str:
    """What the flag takes: a switch nothing, else its choices or kind."""
    if setting.kind is Kind.SWITCH:
        return "switch"
    if setting.kind is Kind.ON_OFF:
        return "on/off (`--no-` form)"
    if setting.choices:
        return " | ".join(setting.choices)
    return {Kind.INT: "integer", Kind.FLOAT: "seconds or number", Kind.TEXT: "text"}[setting.kind]


def default_of(setting: Setting[object]) -> str:
    text = setting.text
    if text is None or text == "":
        return "(none)"
    if isinstance(text, bool):
        return "on" if text else "off"
    return code(text)


def toml_type(setting: Setting[object]) -> str:
    if setting.kind in (Kind.SWITCH, Kind.ON_OFF):
        return "boolean"
    if setting.kind is Kind.INT:
        return "integer"
    if setting.kind is Kind.FLOAT:
        return "number"
    return "string"


def flags_page() -> str:
    out: list[str] = []
    for command in (Command.RUN, Command.MASTER, Command.LAUNCH):
        declared = [s for s in settings.BY_COMMAND[command] if s.flags]
        out += ["", f"### `{COMMAND_NAMES[command]}`", ""]
        rows = []
        for s in declared:
            flags = ", ".join(code(f) for f in s.option_strings(command))
            torchrun = "yes" if s.torchrun else ""
            rows.append(
                (flags, value_of(s), default_of(s), code(s.env), torchrun, s.help_for(command))
            )
        header = ("flag", "value", "default", "variable", "torchrun's", "meaning")
        if command is not Command.RUN:
            header = header[:4] + header[5:]
            rows = [r[:4] + r[5:] for r in rows]
        out += table(header, rows)
    env_only = [s for s in settings.BY_COMMAND[Command.LAUNCH] if not s.flags]
    out += ["", "`dlrover-hpc launch` also reads, from the environment only:", ""]
    out += table(("variable", "default"), ((code(s.env), default_of(s)) for s in env_only))
    return "\n".join(out[1:])


def config_keys_page() -> str:
    out: list[str] = []
    for command in (Command.RUN, Command.MASTER):
        out += ["", f"### `[{command.value}]` ({COMMAND_NAMES[command]})", ""]
        rows = [
            (
                code(s.key),
                toml_type(s),
                " | ".join(f'"{c}"' for c in s.choices) if s.choices else "",
                default_of(s),
                code(s.flag),
                code(s.env),
            )
            for s in settings.BY_COMMAND[command]
            if s.in_file and s.flags
        ]
        out += table(("key", "type", "choices", "default", "flag", "variable"), rows)
    return "\n".join(out[1:])


def environ_names() -> list[tuple[str, str, str, str]]:
    """environ.py's names in source order: (attribute, section, variable, comment)."""
    source = inspect.getsource(environ).splitlines()
    found, section, comment = [], "", []
    for line in source:
        heading = re.match(r"# -{10,}\s*(.+)", line)
        if heading:
            section = heading.group(1).strip()
            continue
        if line.startswith("#:"):
            comment.append(line[2:].strip())
            continue
        assign = re.match(r"([A-Z][A-Z0-9_]*) = PREFIX \+ ", line)
        if assign:
            attr = assign.group(1)
            found.append((attr, section, getattr(environ, attr), " ".join(comment)))
        comment = []
    return found


def environment_page() -> str:
    out = ["### Settings: each flag's variable", ""]
    rows = []
    for s in settings.ALL:
        commands = ", ".join(COMMAND_NAMES[c] for c in settings.commands_of(s))
        flag = code(s.flag) if s.flags else "(environment only)"
        rows.append((code(s.env), flag, commands, default_of(s)))
    out += table(("variable", "flag", "read by", "default"), sorted(rows))
    names = environ_names()
    out += ["", "### Others a user may set (`dlrover_hpc/environ.py`)", ""]
    out += table(
        ("variable", "what it does"),
        ((code(v), c) for a, _, v, c in names if a in USER_SET),
    )
    out += [
        "",
        "### Set by dlrover-hpc for its own processes (do not set them)",
        "",
    ]
    out += table(
        ("variable", "where", "what it carries"),
        ((code(v + ("*" if a == "AGENT_PREFIX" else "")), w, c) for a, w, v, c in names
         if a not in USER_SET),
    )  # fmt: skip
    return "\n".join(out)


# ------------------------------------------------------------------ events
def events_page() -> str:
    """Every member of EventName in source order, under the source's group comments."""
    from dlrover_hpc import events

    source = inspect.getsource(events.EventName).splitlines()
    out: list[str] = []
    rows: list[tuple[str, str]] = []
    comment: list[str] = []

    def flush() -> None:
        if rows:
            out.extend(table(("event", "what it records"), rows))
            out.append("")
            rows.clear()

    for line in source[1:]:
        text = line.strip()
        if text.startswith("#:"):
            comment.append(text[2:].strip())
        elif text.startswith("#"):
            flush()
            out += [f"**{text[1:].strip().rstrip('.')}**", ""]
        else:
            member = re.match(r'([A-Z_]+) = "([a-z_]+)"\s*(?:#\s*(.*))?', text)
            if member:
                note = " ".join([*comment, member.group(3) or ""]).strip()
                rows.append((code(member.group(2)), note))
            comment = []
    flush()
    return "\n".join(out).rstrip()


# ------------------------------------------------------------------ exit codes
def error_types() -> list[type[BaseException]]:
    tree = ast.parse(inspect.getsource(errors))
    names = [node.name for node in tree.body if isinstance(node, ast.ClassDef)]
    return [getattr(errors, n) for n in names]


def exit_code_of_error(kind: type[BaseException]) -> int:
    """The exit code cli/logsetup.exit_code_of gives an error of this type."""
    return 2 if issubclass(kind, errors.UsageError) else 1


def exit_codes_page() -> str:
    from dlrover_hpc.cli import logsetup

    doc = inspect.getdoc(logsetup.exit_code_of) or ""
    out = [f"`cli/logsetup.exit_code_of`: {' '.join(doc.split())}", ""]
    rows = []
    for kind in error_types():
        base = kind.__mro__[1].__name__
        rows.append(
            (code(kind.__name__), code(base), exit_code_of_error(kind), inspect.getdoc(kind))
        )
    out += table(("error", "is a", "exit code", "when"), rows)
    return "\n".join(out)


GENERATORS: dict[str, tuple[str, Callable[[], str]]] = {
    "flags": ("flags.md", flags_page),
    "config-keys": ("config-keys.md", config_keys_page),
    "environment": ("environment.md", environment_page),
    "events": ("events.md", events_page),
    "exit-codes": ("exit-codes.md", exit_codes_page),
    "torchrun": ("torchrun.md", lambda: "\n" + parity.table()),
}


def with_generated(text: str, name: str, body: str) -> str:
    """``text`` with its block ``name`` replaced by ``body``; an error names a missing marker."""
    start_marker = begin(name)
    if start_marker not in text:
        raise ValueError(f"no line {start_marker!r}: put it where the generated text goes")
    start = text.index(start_marker) + len(start_marker)
    end = text.index(END, start)
    return text[:start] + "\n" + body + "\n" + text[end:]


def stale() -> dict[Path, str]:
    """Each page whose generated part is not what the code says, with its new text."""
    out = {}
    for name, (page, make) in GENERATORS.items():
        path = PAGES / page
        text = path.read_text()
        new = with_generated(text, name, make())
        if new != text:
            out[path] = new
    return out


def main(argv: list[str]) -> int:
    changed = stale()
    if argv == ["--write"]:
        for path, text in changed.items():
            path.write_text(text)
            print(f"wrote {path.relative_to(REPO)}")
        return 0
    for path in changed:
        print(f"stale: {path.relative_to(REPO)} (run: python docs/reference.py --write)")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
