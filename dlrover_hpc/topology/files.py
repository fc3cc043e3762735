"""Reading topology files of any supported format, writing them atomically."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from pathlib import Path

from dlrover_hpc.errors import TopologyError
from dlrover_hpc.topology.blocks import (
    BLOCK_KEY,
    SCONTROL_BLOCK_KEY,
    parse_scontrol_blocks,
    render_block_conf,
    scan_block_conf,
)
from dlrover_hpc.topology.model import Problem, Topology, TopologyFormat, TopologyProblems
from dlrover_hpc.topology.scontrol import parse_scontrol_topology
from dlrover_hpc.topology.slurm_conf import logical_lines, render_slurm_conf, scan_slurm_conf
from dlrover_hpc.topology.switch_list import render_switch_list, scan_switch_list

_KEY_VALUE = re.compile(r"^\s*([A-Za-z]+\s*=|include\s)", re.IGNORECASE)
_SCONTROL_LEVEL = re.compile(r"(^|\s)Level=\d", re.IGNORECASE)
STDIN = "-"


def detect_format(text: str) -> TopologyFormat:
    """SLURM when the first non-comment line is KEY=VALUE or an Include (SCONTROL when it has
    Level=; BLOCK when it starts with BlockName= or BlockSizes=, SCONTROL_BLOCK when it also
    has BlockIndex=), SWITCH_LIST otherwise. Text with no content counts as an (empty)
    topology.conf."""
    for ll in logical_lines(text):
        if not ll.text:
            continue
        if SCONTROL_BLOCK_KEY.match(ll.text):
            return TopologyFormat.SCONTROL_BLOCK
        if BLOCK_KEY.match(ll.text):
            return TopologyFormat.BLOCK
        if _KEY_VALUE.match(ll.text):
            if _SCONTROL_LEVEL.search(ll.text):
                return TopologyFormat.SCONTROL
            return TopologyFormat.SLURM
        return TopologyFormat.SWITCH_LIST
    return TopologyFormat.SLURM


def scan(text: str, *, source: str) -> tuple[Topology, list[Problem]]:
    """Parse text of any format; returns what could be parsed and every problem found."""
    fmt = detect_format(text)
    if fmt is TopologyFormat.SWITCH_LIST:
        return scan_switch_list(text, source=source)
    if fmt is TopologyFormat.BLOCK:
        return scan_block_conf(text, source=source)
    if fmt in (TopologyFormat.SCONTROL, TopologyFormat.SCONTROL_BLOCK):
        parse = parse_scontrol_blocks if fmt.is_block else parse_scontrol_topology
        try:
            return parse(text, source=source), []
        except TopologyProblems as exc:
            return Topology(switches=(), source=source, format=fmt), list(exc.problems)
    return scan_slurm_conf(text, source=source)


def loads(text: str, *, source: str = "<string>") -> Topology:
    """Parse text of any format; raises TopologyError with one `FILE:LINE:` line per problem."""
    topology, problems = scan(text, source=source)
    if problems:
        raise TopologyProblems(problems)
    return topology


def read_text(path: str | os.PathLike[str]) -> tuple[str, str]:
    """(text, source name) of a topology file; `-` reads stdin. Raises TopologyError."""
    name = os.fspath(path)
    if name == STDIN:
        return sys.stdin.read(), "<stdin>"
    try:
        return Path(name).read_text(encoding="utf-8"), name
    except FileNotFoundError:
        raise TopologyError(
            f"{name}: no such topology file; check the path (examples are in topology/)"
        ) from None
    except IsADirectoryError:
        raise TopologyError(f"{name}: is a directory; give the topology file inside it") from None
    except UnicodeDecodeError as exc:
        raise TopologyError(
            f"{name}: is not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8"
        ) from None
    except OSError as exc:
        raise TopologyError(f"{name}: cannot read it ({exc.strerror})") from None


def load(path: str | os.PathLike[str]) -> Topology:
    """Read a topology.conf, a block.conf, a switch list or saved `scontrol show topology`
    output (tree or block plugin).

    The format is detected from the content. Raises TopologyError whose message has one
    `FILE:LINE: what is wrong; how to fix it` line per problem.
    """
    text, source = read_text(path)
    return loads(text, source=source)


def render(topology: Topology, fmt: TopologyFormat, *, header: str = "") -> str:
    """Text of `topology` in `fmt` (SLURM, BLOCK or SWITCH_LIST)."""
    if fmt is TopologyFormat.BLOCK:
        return render_block_conf(topology, header=header)
    if fmt is TopologyFormat.SWITCH_LIST:
        return render_switch_list(topology, header=header)
    if fmt is TopologyFormat.SLURM:
        return render_slurm_conf(topology, header=header)
    raise TopologyError(f"cannot write format '{fmt.value}'; choose slurm, block or switch-list")


def write_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Replace `path` with `text` so that readers see the old or the new file, never a part.

    Writes a temporary file in the same directory, fsyncs it, renames it over `path` and fsyncs
    the directory. An existing file's permission bits are kept; a new file gets 0666 & ~umask.
    Where `path` is a symlink, the file it points to is replaced and the link kept.
    """
    target = Path(os.path.realpath(path))  # through a symlink: replace the file it names
    directory = target.parent
    try:
        mode = target.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = 0o666 & ~_current_umask()
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise TopologyError(f"{target}: cannot write next to it ({exc.strerror})") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
            handle.write(text)
            handle.flush()
            os.fchmod(handle.fileno(), mode)
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _current_umask() -> int:
    """The process umask, read without changing it (Linux); 0o022 where it cannot be read."""
    try:
        status = Path("/proc/self/status").read_text(encoding="ascii")
    except OSError:
        return 0o022
    match = re.search(r"^Umask:\s*([0-7]+)", status, re.MULTILINE)
    return int(match.group(1), 8) if match else 0o022
