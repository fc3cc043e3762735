"""The documentation says what the code does: the README stays a five-minute read with its
blocks in place, the generated reference pages (docs/reference.py) are current, and the guide's
command examples marked ``<!-- run -->`` run and exit 0."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from dlrover_hpc import environ, events

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
RUN_MARK = "<!-- run -->"


def _reference() -> ModuleType:
    spec = importlib.util.spec_from_file_location("reference", DOCS / "reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fenced_after(text: str, marker: str) -> list[str]:
    """The fenced ``bash`` blocks directly preceded by the line ``marker``."""
    pattern = re.escape(marker) + r"\n```bash\n(.*?)\n```"
    return re.findall(pattern, text, flags=re.S)


# ------------------------------------------------------------------ the README
def test_the_readme_is_a_five_minute_read() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail into docs/"


@pytest.mark.parametrize("block", ["install", "first-run"])
def test_the_readme_has_its_install_and_first_run_blocks(block: str) -> None:
    found = fenced_after(README.read_text(), f"<!-- block: {block} -->")
    assert len(found) == 1, f"README.md: one ```bash block after <!-- block: {block} -->"
    if block == "install":
        assert "pip install torch" in found[0] and "dlrover_hpc-*.whl" in found[0]
    else:
        assert "dlrover-hpc template train > train.py" in found[0]
        assert "dlrover-run --nproc-per-node=2 train.py" in found[0]


def test_the_development_section_names_the_make_targets_ci_runs() -> None:
    text = README.read_text()
    section = text[text.index("## Development") :]
    makefile = (REPO / "Makefile").read_text()
    for target in ("venv", "test", "test-fast", "lint", "docs"):
        assert f"make {target} " in section, f"README's Development: make {target}"
        assert re.search(rf"^{re.escape(target)}:", makefile, re.M), f"Makefile: {target}"
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_every_relative_link_of_the_readme_points_at_a_file() -> None:
    for target in re.findall(r"\]\(([^)#]+)\)", README.read_text()):
        if "://" not in target:
            assert (REPO / target).exists(), f"README.md links to {target}, which is not there"


# ------------------------------------------------------------------ the generated reference
def test_the_generated_reference_pages_are_current() -> None:
    stale = ", ".join(str(path.relative_to(REPO)) for path in _reference().stale())
    assert not stale, f"stale: {stale}; run: python docs/reference.py --write"


def test_every_environ_name_is_placed_as_user_set_or_internal() -> None:
    reference = _reference()
    names = {attr for attr, *_ in reference.environ_names()}
    assert names == {k for k, v in vars(environ).items() if k.isupper() and k != "PREFIX"
                     and isinstance(v, str) and v.startswith(environ.PREFIX)}  # fmt: skip
    assert not reference.USER_SET & reference.INTERNAL
    unplaced = names - reference.USER_SET - reference.INTERNAL
    assert not unplaced, f"docs/reference.py: put {sorted(unplaced)} in USER_SET or INTERNAL"


def test_every_event_is_on_the_events_page() -> None:
    page = (DOCS / "reference" / "events.md").read_text()
    missing = [e.value for e in events.EventName if f"| `{e.value}` |" not in page]
    assert not missing


def test_a_stale_block_is_rewritten_and_a_missing_marker_named() -> None:
    reference = _reference()
    begin = reference.begin("flags")
    text = f"intro\n{begin}\nold\n{reference.END}\nafter\n"
    assert reference.with_generated(text, "flags", "new") == (
        f"intro\n{begin}\nnew\n{reference.END}\nafter\n"
    )
    with pytest.raises(ValueError, match="generated: events"):
        reference.with_generated("no markers", "events", "x")


# ------------------------------------------------------------------ runnable examples
def runnable_blocks() -> list[tuple[str, str]]:
    """(page, block) for each ```bash block marked <!-- run --> in the README and docs/."""
    pages = [README, *sorted(DOCS.rglob("*.md"))]
    return [
        (str(page.relative_to(REPO)), block)
        for page in pages
        for block in fenced_after(page.read_text(), RUN_MARK)
    ]


def _job_dir(root: Path) -> None:
    """A small finished job's events.jsonl: two nodes, a worker killed, a restore."""
    t0 = 1_800_000_000.0
    rows = [
        (0, "job_started", {"job_id": "1234", "nnodes": "2:2"}),
        (1, "node_joined", {"node": "node1", "agent": "node1-1"}),
        (1, "node_joined", {"node": "node2", "agent": "node2-2"}),
        (2, "rendezvous_complete", {"round": 1, "nodes": ["node1", "node2"]}),
        *((3 + 2 * i, "training_progress", {"round": 1, "step": 10 * i}) for i in range(5)),
        (11.5, "worker_failed", {"node": "node2", "rank": 1, "classification": "software"}),
        (13, "rendezvous_complete", {"round": 2, "nodes": ["node1", "node2"]}),
        (13, "workers_restarted", {"round": 2, "restart_count": 1}),
        (14, "checkpoint_restored", {"node": "node1", "rank": 0, "step": 30, "source": "memory"}),
        *((14 + 2 * i, "training_progress", {"round": 2, "step": 30 + 10 * i}) for i in range(4)),
        (21, "job_finished", {"exit_code": 0, "restart_count": 1}),
    ]
    path = root / ".dlrover-hpc" / "1234" / "events.jsonl"
    path.parent.mkdir(parents=True)
    lines = []
    for t, name, fields in rows:
        if name == "training_progress":
            fields = {**fields, "at": t0 + t}
        lines.append(json.dumps({"time": t0 + t, "event": name, **fields}))
    path.write_text("\n".join(lines) + "\n")


def test_the_guide_marks_runnable_examples_of_each_kind() -> None:
    commands = "\n".join(block for _, block in runnable_blocks())
    for kind in ("--help", "dlrover-hpc topology ", "dlrover-hpc config ", "dlrover-hpc report "):
        assert kind in commands, f"no <!-- run --> example runs {kind.strip()}"


@pytest.mark.parametrize(
    ("page", "block"), runnable_blocks(), ids=lambda v: v if v.endswith(".md") else ""
)
def test_a_runnable_example_exits_0(page: str, block: str, tmp_path: Path) -> None:
    """Run in a directory with the repository's topology/ files and a job directory
    ``.dlrover-hpc/1234``; no site or user configuration file is read."""
    shutil.copytree(REPO / "topology", tmp_path / "topology")
    _job_dir(tmp_path)
    bindir = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        "PATH": bindir + os.pathsep + os.environ.get("PATH", ""),
        "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
        environ.PREFIX + "SITE_CONFIG": "",
        "MPLBACKEND": "Agg",
    }
    env.pop(environ.PREFIX + "CONFIG", None)
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"{page}: exit {done.returncode}\n{block}\n{done.stderr[-2000:]}"
