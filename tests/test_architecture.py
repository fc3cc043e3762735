"""docs/design/architecture.md's layer diagram is the import-linter contracts' (docs/layers.py)."""

from __future__ import annotations

import importlib.util
import pkgutil
from pathlib import Path

import dlrover_hpc

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _layers_module():
    spec = importlib.util.spec_from_file_location("layers", DOCS / "layers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_page_shows_the_contracts_as_they_are() -> None:
    layers = _layers_module()
    page = layers.PAGE.read_text()
    assert layers.page_with_diagram(page) == page, "run: python docs/layers.py --write"


def test_every_package_and_top_level_module_is_in_the_diagram() -> None:
    layers = _layers_module()
    drawn = {name for row in layers.layers() for name in row}
    top = {m.name for m in pkgutil.iter_modules(dlrover_hpc.__path__)}
    assert top == drawn
    diagram = layers.diagram()
    assert all(f" {name} " in diagram for name in top)
