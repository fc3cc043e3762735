"""A newcomer's way in: build the wheel, install it in a fresh venv as the README says, run the
README's first job; and the sbatch script ``dlrover-hpc template sbatch`` writes, on Slurm.

The README's blocks are the ```bash blocks right after ``<!-- block: install -->`` and
``<!-- block: first-run -->``; they run as written, in a directory that holds only the wheel,
with the fresh venv active (no checkout on ``PYTHONPATH``, none of this venv's commands on
``PATH``).  torch comes from this machine's disk: the venv gets torch 2.13.0 first (the test
machines' one), so the block's ``pip install torch`` finds it there.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from runtime_helpers import REPO, run_env, wait_job

from dlrover_hpc.localslurm import LocalSlurm

pytestmark = pytest.mark.runtime

PIP_WHEEL = (sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q")
TWO_NODES = ("--nnodes=2", "--nproc-per-node=1", "train.py", "--steps=20")
BLOCK = re.compile(r"^<!-- block: ([\w-]+) -->\n```bash\n(.*?)^```", re.MULTILINE | re.DOTALL)


def readme_blocks(text: str) -> dict[str, str]:
    """The README's marked bash blocks, by name (pure)."""
    return {name: body for name, body in BLOCK.findall(text)}


def test_readme_blocks_are_found() -> None:
    text = (
        "a\n<!-- block: install -->\n```bash\npip install x\n```\n<!-- block: b -->\n```bash\n```\n"
    )
    assert readme_blocks(text) == {"install": "pip install x\n", "b": ""}
    blocks = readme_blocks((REPO / "README.md").read_text())
    assert {"install", "first-run"} <= set(blocks), sorted(blocks)


def _source_copy(scratch: Path) -> Path:
    """What the package is built from, copied (no build/ or egg-info left in the checkout)."""
    src = scratch / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(REPO / "dlrover_hpc", src / "dlrover_hpc", ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    return src


def _build_wheel(out: Path, scratch: Path) -> Path:
    """The wheel of this checkout."""
    src = _source_copy(scratch)
    subprocess.run(
        [*PIP_WHEEL, "-w", str(out), str(src)],
        check=True,
        timeout=120,
        capture_output=True,
    )
    (wheel,) = out.glob("dlrover_hpc-*.whl")
    return wheel


def test_the_sdist_and_the_wheel_carry_the_templates(tmp_path: Path) -> None:
    src = _source_copy(tmp_path)
    build = f"from setuptools import build_meta as b; print(b.build_sdist({str(tmp_path)!r}))"
    name = subprocess.run(
        [sys.executable, "-c", build],
        cwd=src,
        check=True,
        timeout=120,
        capture_output=True,
        text=True,
    ).stdout.split()[-1]
    with tarfile.open(tmp_path / name) as sdist:
        names = sdist.getnames()
    wheel = _build_wheel(tmp_path / "wheel", tmp_path / "again")
    with zipfile.ZipFile(wheel) as zipped:
        in_wheel = zipped.namelist()
    for template in ("train.sbatch", "replacement.sbatch", "train.py"):
        assert f"{name.removesuffix('.tar.gz')}/dlrover_hpc/templates/{template}" in names
        assert f"dlrover_hpc/templates/{template}" in in_wheel


def _fresh_env(home: Path) -> dict[str, str]:
    """The environment of a login shell with nothing of this checkout's: no venv active, none
    of this venv's commands on ``PATH``, ``HOME`` a fresh directory."""
    ours = {str(Path(sys.executable).parent), str(Path(sys.prefix) / "bin")}
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p not in ours]
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "DLROVER_HPC_", "PYTHON", "VIRTUAL_ENV", "PYTEST"))
    }
    env["PATH"] = os.pathsep.join(path)
    env["HOME"] = str(home)
    return env


@pytest.mark.timeout(700)  # a hang guard: it takes 165 s beside the suite
def test_readme_install_and_first_run_from_the_wheel(tmp_path: Path) -> None:
    """The two blocks run as written, one after the other in one shell (the install block
    makes and activates the venv the first run uses), in a directory holding only the wheel."""
    blocks = readme_blocks((REPO / "README.md").read_text())
    work = tmp_path / "work"
    work.mkdir()
    wheel = _build_wheel(work, tmp_path)
    assert wheel.parent == work and list(work.iterdir()) == [wheel]  # the wheel, nothing else
    home = tmp_path / "home"
    home.mkdir()
    env = _fresh_env(home)
    marker = "=== first-run ==="
    script = (
        "set -euo pipefail\n"
        + blocks["install"]
        + 'echo "venv=$VIRTUAL_ENV"\n'
        + f"echo '{marker}'; echo '{marker}' >&2\n"
        + blocks["first-run"]
    )
    shell = subprocess.run(
        ["bash", "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=600
    )
    out = shell.stdout + shell.stderr
    assert shell.returncode == 0, out[-4000:]
    install_out, first_out = shell.stdout.split(marker + "\n", 1)
    install_err, first_err = shell.stderr.split(marker + "\n", 1)
    venv = Path(re.findall(r"^venv=(.+)$", install_out, re.MULTILINE)[-1])
    assert venv.is_relative_to(home), venv  # the README's own venv, not this checkout's
    # The venv's own package, and torch as the README's line installed it.
    probe = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import dlrover_hpc, torch; "
            "print(dlrover_hpc.__file__, dlrover_hpc.__version__, torch.__version__)",
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    assert probe[0].startswith(str(venv)), probe
    assert probe[2].startswith("2.13.0"), probe
    assert f"dlrover-hpc {probe[1]} (torch {probe[2]})" in install_out + install_err

    assert (work / "train.py").read_text().startswith('"""A small DDP training script')
    assert re.search(r"^done: \d+ steps, world size 2$", first_out, re.MULTILINE), out[-4000:]
    assert "running as --standalone, as torchrun does" in first_err, first_err[-3000:]
    # The installed sbatch template names this venv's commands and templates.
    sbatch = subprocess.run(
        [str(venv / "bin" / "dlrover-hpc"), "template", "sbatch"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.splitlines()
    assert f'install_bin="{venv / "bin"}"' in sbatch
    templates = next(line for line in sbatch if line.startswith("install_templates="))
    assert templates.startswith(f'install_templates="{venv}/lib/'), templates


@pytest.mark.slurm
def test_the_written_sbatch_template_runs_a_two_node_job(
    local_slurm: LocalSlurm, shared_tmp: Path
) -> None:
    """``dlrover-hpc template sbatch`` and ``template train``, submitted as the README says,
    with none of the installation on the job's PATH: the script finds it itself."""
    env = run_env()
    dlrover_hpc = [sys.executable, "-m", "dlrover_hpc.cli.main"]
    script = shared_tmp / "train.sbatch"
    subprocess.run([*dlrover_hpc, "template", "sbatch", "-o", str(script)], check=True, env=env)
    subprocess.run(
        [*dlrover_hpc, "template", "train", "-o", str(shared_tmp / "train.py")], check=True, env=env
    )
    ours = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != ours)
    assert shutil.which("dlrover-run", path=env["PATH"]) is None
    job = (
        subprocess.run(
            ["sbatch", "--parsable", "-N2", str(script), *TWO_NODES],
            cwd=shared_tmp,
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        .stdout.strip()
        .split(";")[0]
    )
    fields = wait_job(job, timeout_s=180)
    out = (shared_tmp / f"dlrover-hpc-{job}.out").read_text()  # the template's --output
    assert fields["JobState"] == "COMPLETED", out[-4000:]
    assert "done: 20 steps, world size 2" in out, out[-4000:]
    # The template's CKPT_DIR: the script saved where a requeued job resumes from.
    assert (shared_tmp / "checkpoints" / "checkpoint.pt").exists(), out[-4000:]


def _gloo_exit_abort(out: subprocess.CompletedProcess[str]) -> bool:
    """torch 2.13's own teardown bug, not the template's: with every step done, the last line
    printed and ``destroy_process_group`` returned on every rank, a rank's interpreter exit
    ends in ``std::terminate`` (a joinable thread destroyed).  Reproduced with plain torchrun
    and the template beside two or three busy loops: 4 runs in 96 (1 in 22 as it is, 1 in 14
    with a barrier before the teardown, 2 in 60 with a line printed after it, which showed
    where it happens).  CI: the second run of this test."""
    return (
        out.returncode != 0
        and "done: 5 steps" in out.stdout
        and "terminate called without an active exception" in out.stderr
        and "(SIGABRT)" in out.stderr
    )


def test_the_train_template_runs_under_torchrun_and_resumes(tmp_path: Path) -> None:
    """``dlrover-hpc template train`` is torchrun's too; with --ckpt-dir a second run resumes."""
    (tmp_path / "train.py").write_text(
        (REPO / "dlrover_hpc" / "templates" / "train.py").read_text()
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DLROVER_HPC_"))}
    env.pop("CKPT_DIR", None)
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node=2", "train.py"]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        for _ in range(3):
            out = subprocess.run(
                [*torchrun, "--steps=5", *args],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            if not _gloo_exit_abort(out):
                return out
            print("torch's gloo teardown aborted a rank after its last step; run again")
        return out

    first = run()
    assert first.returncode == 0, first.stderr[-3000:]
    assert "done: 5 steps, world size 2" in first.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.py"]  # saves nothing
    ckpt = tmp_path / "ckpt"
    saved = run(f"--ckpt-dir={ckpt}")
    assert saved.returncode == 0, saved.stderr[-3000:]
    assert (ckpt / "checkpoint.pt").exists()
    again = run(f"--ckpt-dir={ckpt}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {ckpt / 'checkpoint.pt'} at step 5" in again.stdout, again.stdout
