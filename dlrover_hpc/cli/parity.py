"""The torchrun parity table: how ``dlrover-run`` treats each of torchrun's flags, made from
their declarations (:attr:`dlrover_hpc.settings.Setting.torchrun`).

docs/reference/torchrun.md holds it between :data:`BEGIN` and :data:`END`;
``python -m dlrover_hpc.cli.parity --write`` rewrites it there, ``--check`` fails when it is stale
(tests/cli/test_torchrun_parity.py checks it too).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from dlrover_hpc import settings
from dlrover_hpc.settings import Command, Treatment

BEGIN = "<!-- generated: torchrun parity -->"
END = "<!-- end generated -->"
#: The page, in a source checkout (a wheel has no docs/).
PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "torchrun.md"

_WHAT = {
    Treatment.SAME: "same",
    Treatment.DIFFERENT: "**different**",
    Treatment.IGNORED: "**ignored** (warned)",
    Treatment.REFUSED: "**refused** (exit 2)",
}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def table() -> str:
    """The markdown table: one row per torchrun flag, in dlrover-run's ``--help`` order."""
    rows = [
        "| torchrun flag | dlrover-run | default here | how it differs, or why |",
        "|---|---|---|---|",
    ]
    for setting in settings.BY_COMMAND[Command.RUN]:
        parity = setting.torchrun
        if parity is None:
            continue
        flags = ", ".join(f"`{flag}`" for flag in setting.flags)
        default = setting.text
        shown = "off" if default is False else "none" if default is None else f"`{default}`"
        if default == "":
            shown = '`""`'
        rows.append(
            f"| {flags} | {_WHAT[parity.treatment]} | {shown} | {_cell(parity.why) or '-'} |"
        )
    return "\n".join(rows) + "\n"


def render(page: str) -> str:
    """``page`` with the table between its markers; ValueError when a marker is missing."""
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{PAGE}: expected the markers {BEGIN!r} and then {END!r}")
    return page[: start + len(BEGIN)] + "\n\n" + table() + "\n" + page[end:]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m dlrover_hpc.cli.parity",
        description=f"print the torchrun parity table, or rewrite/check it in {PAGE}",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the page's table")
    mode.add_argument("--check", action="store_true", help="exit 1 when the page is stale")
    args = p.parse_args(argv)
    if not (args.write or args.check):
        sys.stdout.write(table())
        return 0
    try:
        page = PAGE.read_text()
        fresh = render(page)
    except (OSError, ValueError) as exc:
        print(f"parity: error: {exc}", file=sys.stderr)
        return 2
    if args.write:
        if fresh != page:
            PAGE.write_text(fresh)
        return 0
    if fresh != page:
        print(
            f"{PAGE}: the torchrun parity table is stale; run python -m dlrover_hpc.cli.parity "
            "--write",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
