"""The torchrun parity table: how ``dlrover-run`` treats each of torchrun's flags, made from
their declarations (:attr:`dlrover_hpc.settings.Setting.torchrun`).

docs/reference.py puts it into docs/reference/torchrun.md with the other generated reference
pages (``python docs/reference.py --write``; tests/test_docs.py fails when a page is stale).
"""

from __future__ import annotations

from dlrover_hpc import settings
from dlrover_hpc.settings import Command, Treatment

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
