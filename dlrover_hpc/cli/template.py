"""``dlrover-hpc template sbatch|train``: the files a new job starts from, written out.

The sbatch template is written for the installation that writes it: the bin directory of its
``dlrover-run`` and ``dlrover-hpc`` goes into the script, so that the job runs them on every
node whatever the job's shell has on ``PATH``, and the replacement jobs' template is the one
installed beside it.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path

from dlrover_hpc.errors import ConfigError

#: The templates, package data of the wheel (``sbatch/`` in a checkout links to them).
TEMPLATES = Path(__file__).resolve().parent.parent / "templates"

#: The sbatch template's lines that the writer fills in, as they stand in the template.
INSTALL_BIN = 'install_bin=""'
INSTALL_TEMPLATES = 'install_templates=""'
#: The GPU lines, off (``##SBATCH``) in the template; ``--gpus`` turns them on.
GPU_OPTIONS = ("--gpus-per-node=", "--cpus-per-task=", "--time=")


def scripts_dir(candidates: Sequence[Path]) -> Path:
    """The first of ``candidates`` that holds ``dlrover-run``; the first one when none does."""
    for path in candidates:
        if (path / "dlrover-run").exists():
            return path
    return candidates[0]


def installation_bin() -> Path:
    """Where this installation's ``dlrover-run`` and ``dlrover-hpc`` are: beside the command
    that runs (``dlrover-hpc``), else the interpreter's scripts directory (a venv's bin)."""
    candidates = [Path(sys.argv[0]).absolute().parent] if sys.argv and sys.argv[0] else []
    candidates += [Path(sysconfig.get_path("scripts")), Path(sys.executable).parent]
    return scripts_dir(candidates)


def fill_line(text: str, line: str, value: str, *, template: str) -> str:
    """``text`` with its one line ``line`` (``name=""``) set to ``value``."""
    lines = text.splitlines(keepends=True)
    found = [i for i, have in enumerate(lines) if have.rstrip("\n") == line]
    if len(found) != 1:
        raise ConfigError(
            f"{template}: expected the line {line!r} once, found it {len(found)} times; "
            "the installation's template was edited: reinstall dlrover-hpc"
        )
    name = line.split("=", 1)[0]
    lines[found[0]] = f'{name}="{value}"\n'
    return "".join(lines)


def enable_gpu_lines(text: str) -> str:
    """``##SBATCH --gpus-per-node=...`` and its kin, switched on."""
    out = []
    for line in text.splitlines(keepends=True):
        if line.startswith("##SBATCH ") and line[9:].startswith(GPU_OPTIONS):
            line = line[1:]
        out.append(line)
    return "".join(out)


def sbatch_text(*, gpus: bool, bin_dir: Path, templates: Path) -> str:
    """The sbatch template for the installation at ``bin_dir`` (pure but for the read)."""
    path = templates / "train.sbatch"
    text = path.read_text()
    text = fill_line(text, INSTALL_BIN, str(bin_dir), template=str(path))
    text = fill_line(text, INSTALL_TEMPLATES, str(templates), template=str(path))
    return enable_gpu_lines(text) if gpus else text


def write(text: str, output: str | None, *, executable: bool) -> None:
    if output is None or output == "-":
        sys.stdout.write(text)
        return
    try:
        Path(output).write_text(text)
        if executable:
            os.chmod(output, 0o755)
    except OSError as exc:
        raise ConfigError(
            f"-o {output}: cannot write it ({exc.strerror}); pick another path"
        ) from None


def run_sbatch(args: argparse.Namespace) -> int:
    text = sbatch_text(gpus=args.gpus, bin_dir=installation_bin(), templates=TEMPLATES)
    write(text, args.output, executable=True)
    return 0


def run_train(args: argparse.Namespace) -> int:
    write((TEMPLATES / "train.py").read_text(), args.output, executable=False)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "template",
        help="write a starting sbatch script or training script",
        description="Write a file a new job starts from, to stdout or -o FILE.",
    )
    kinds = p.add_subparsers(dest="template", required=True, metavar="KIND")
    s = kinds.add_parser(
        "sbatch",
        help="the sbatch script of a fault-tolerant job, for this installation",
        description="The sbatch script that runs the job master and one dlrover-run per node, "
        "with the dlrover-run of this installation (its bin directory is written in). "
        "Submit it as: sbatch -N2 train.sbatch --nnodes=2 --nproc-per-node=8 train.py",
    )
    s.add_argument(
        "--gpus",
        action="store_true",
        help="turn on the GPU cluster's lines (--gpus-per-node, --cpus-per-task, --time); "
        "default: off, commented in the script",
    )
    s.add_argument("-o", "--output", default=None, help="write here (default: stdout)")
    s.set_defaults(func=run_sbatch)
    t = kinds.add_parser(
        "train",
        help="a small DDP training script (CPU gloo / GPU NCCL) that runs under torchrun too",
        description="A small DDP training script: a few seconds on CPU, unchanged under "
        "torchrun, dlrover-run and the sbatch template; saves a checkpoint only with "
        "--ckpt-dir or CKPT_DIR.",
    )
    t.add_argument("-o", "--output", default=None, help="write here (default: stdout)")
    t.set_defaults(func=run_train)
