"""``--version`` and ``dlrover-hpc template sbatch|train``: what a new user installs and runs."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import dlrover_hpc
from dlrover_hpc.cli import template
from dlrover_hpc.errors import ConfigError

pytestmark = pytest.mark.timeout(60)

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]


def run(program: str, *argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / program), *argv], capture_output=True, text=True, timeout=60, cwd=cwd
    )


def test_version_comes_from_the_installed_metadata() -> None:
    assert dlrover_hpc.__version__ == metadata.version("dlrover-hpc")
    torch_version = metadata.version("torch")
    assert dlrover_hpc.version_line() == (
        f"dlrover-hpc {dlrover_hpc.__version__} (torch {torch_version})"
    )


@pytest.mark.parametrize("program", ["dlrover-run", "dlrover-hpc"])
def test_version_flag_prints_one_line_and_exits_0(program: str) -> None:
    proc = run(program, "--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == dlrover_hpc.version_line() + "\n"
    assert proc.stdout.startswith(f"dlrover-hpc {dlrover_hpc.__version__} (torch ")


def test_the_checkouts_sbatch_directory_links_to_the_package_templates() -> None:
    for name in ("train.sbatch", "replacement.sbatch"):
        assert (REPO / "sbatch" / name).resolve() == template.TEMPLATES / name
    assert not (REPO / "sbatch" / "train-spares.sbatch").exists()  # folded into train.sbatch


def test_sbatch_template_is_written_for_this_installation(tmp_path: Path) -> None:
    out = tmp_path / "train.sbatch"
    proc = run("dlrover-hpc", "template", "sbatch", "-o", str(out), cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout == "", proc.stderr
    assert os.access(out, os.X_OK)
    text = out.read_text()
    bin_line = next(line for line in text.splitlines() if line.startswith("install_bin="))
    bin_dir = Path(bin_line.split("=", 1)[1].strip('"'))
    assert (bin_dir / "dlrover-run").exists() and (bin_dir / "dlrover-hpc").exists()
    assert f'install_templates="{template.TEMPLATES}"' in text.splitlines()
    assert (template.TEMPLATES / "replacement.sbatch").exists()
    # What a GPU cluster needs is there and explained; the GPU lines are off without --gpus.
    for line in ("#SBATCH --requeue", "#SBATCH --signal=B:USR1@120", "#SBATCH --output="):
        assert any(have.startswith(line) for have in text.splitlines()), line
    for option in ("--gpus-per-node=", "--cpus-per-task=", "--time="):
        assert f"##SBATCH {option}" in text
    assert 'export CKPT_DIR="${CKPT_DIR:-' in text
    assert subprocess.run(["bash", "-n", str(out)], timeout=10).returncode == 0
    # The same to stdout; --gpus turns the GPU lines on and changes nothing else.
    plain = run("dlrover-hpc", "template", "sbatch").stdout
    gpus = run("dlrover-hpc", "template", "sbatch", "--gpus").stdout
    assert plain == text
    for option in ("--gpus-per-node=", "--cpus-per-task=", "--time="):
        assert f"\n#SBATCH {option}" in gpus and f"##SBATCH {option}" not in gpus
    back = gpus
    for option in ("--gpus-per-node=", "--cpus-per-task=", "--time="):
        back = back.replace(f"\n#SBATCH {option}", f"\n##SBATCH {option}")
    assert back == plain


def test_sbatch_template_fill_refuses_an_edited_template() -> None:
    with pytest.raises(ConfigError, match=r"t.sbatch: expected the line 'install_bin=\"\"' once"):
        template.fill_line("#!/bin/bash\n", template.INSTALL_BIN, "/x", template="t.sbatch")
    assert template.fill_line('a\ninstall_bin=""\n', template.INSTALL_BIN, "/x", template="t") == (
        'a\ninstall_bin="/x"\n'
    )


def test_scripts_dir_is_the_first_that_holds_dlrover_run(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    assert template.scripts_dir([first, second]) == first  # none holds it: the first
    (second / "dlrover-run").touch()
    assert template.scripts_dir([first, second]) == second


def test_train_template_is_the_package_file(tmp_path: Path) -> None:
    proc = run("dlrover-hpc", "template", "train")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (template.TEMPLATES / "train.py").read_text()
    out = tmp_path / "train.py"
    assert run("dlrover-hpc", "template", "train", "-o", str(out)).returncode == 0
    assert out.read_text() == proc.stdout
    compile(proc.stdout, "train.py", "exec")


def test_template_to_an_unwritable_path_is_one_line(tmp_path: Path) -> None:
    proc = run("dlrover-hpc", "template", "train", "-o", str(tmp_path / "no" / "train.py"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"dlrover-hpc template train: error: -o {tmp_path / 'no' / 'train.py'}: cannot write it "
        "(No such file or directory); pick another path"
    ]
