"""The layer diagram of docs/design/architecture.md, drawn from the import-linter contracts.

The rows are ``pyproject.toml``'s layers contract, top to bottom; each package's line is the
first sentence of its own docstring.  ``python docs/layers.py`` prints the diagram,
``--write`` puts it into docs/design/architecture.md between its markers, and
tests/test_architecture.py fails when the page and the contracts disagree.
"""

from __future__ import annotations

import ast
import re
import sys
import textwrap
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "design" / "architecture.md"
BEGIN, END = "<!-- layers: begin (docs/layers.py) -->", "<!-- layers: end -->"
WIDTH = 100


def contracts() -> list[dict]:
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    return data["tool"]["importlinter"]["contracts"]


def layers() -> list[list[str]]:
    """The layers contract's rows, top first, each a list of independent packages."""
    (contract,) = [c for c in contracts() if c["type"] == "layers"]
    return [[name.strip() for name in row.split("|")] for row in contract["layers"]]


def summary(package: str) -> str:
    """The first sentence of the package's (or module's) docstring."""
    base = REPO / "dlrover_hpc"
    path = base / package / "__init__.py"
    if not path.exists():
        path = base / f"{package}.py"
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    first = " ".join(doc.split("\n\n")[0].split())
    first = re.sub(r":\w+:`([^`]+)`", r"\1", first).replace("``", "")
    match = re.match(r"(.+?\.)(\s|$)", first)
    return (match.group(1) if match else first).rstrip(".")


def diagram() -> str:
    out = ["```"]
    rows = layers()
    for i, row in enumerate(rows):
        if len(row) > 1:
            out.append(" " + " | ".join(row))
        for name in row:
            indent = "   " if len(row) > 1 else " "
            lead = f"{indent}{name:<12} "
            wrapped = textwrap.wrap(
                summary(name),
                WIDTH - len(lead),
                initial_indent="",
                subsequent_indent="",
            )
            out.append(lead + wrapped[0])
            out.extend(" " * len(lead) + line for line in wrapped[1:])
        if i < len(rows) - 1:
            out.append("  │")
    out.append("```")
    rules = [c for c in contracts() if c["type"] == "forbidden"]
    out.append("")
    out.append("Beside the layers, `lint-imports` keeps these contracts:")
    out.append("")
    for c in rules:
        sources = ", ".join(f"`{s.removeprefix('dlrover_hpc.')}`" for s in c["source_modules"])
        banned = ", ".join(f"`{s.removeprefix('dlrover_hpc.')}`" for s in c["forbidden_modules"])
        out.append(f"- **{c['name']}**: {sources} never import {banned}.")
    return "\n".join(out)


def page_with_diagram(text: str) -> str:
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n" + diagram() + "\n" + text[end:]


def main(argv: list[str]) -> int:
    if argv == ["--write"]:
        PAGE.write_text(page_with_diagram(PAGE.read_text()))
        return 0
    print(diagram())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
