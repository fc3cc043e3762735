"""DLRover's own example scripts (nanogpt DDP and FSDP, the mnist CNN), their import lines
changed and nothing else but a CPU FSDP branch and synthetic data (examples/dlrover/README.md),
run under dlrover-run on the real local Slurm: two nodes each, at the same time, and a second
run of the nanogpt script resumes from the step the first committed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from runtime_helpers import REPO, events, named, sbatch, wait_job

from dlrover_hpc.localslurm import LocalSlurm

pytestmark = pytest.mark.slurm
EXAMPLES = REPO / "examples" / "dlrover"
TINY = ["--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--block_size", "32"]
TINY += ["--batch_size", "4", "--save_memory_interval", "10", "--save_storage_interval", "30"]


def _committed(job_dir: Path) -> list[int]:
    return sorted(
        e["step"] for e in named(events(job_dir), "checkpoint_persisted") if e.get("committed")
    )


@pytest.mark.timeout(600)  # a hang guard: it takes 165 s beside the suite
def test_dlrover_examples_run_with_only_their_imports_changed(
    local_slurm: LocalSlurm, shared_tmp: Path
) -> None:
    work = shared_tmp
    data = work / "nanogpt"
    prepare = [EXAMPLES / "nanogpt" / "prepare.py", "--output_dir", data / "data"]
    for argv in (
        [EXAMPLES / "make_nanogpt_text.py", "--out", data / "input.txt"],
        [*prepare, "--src_data_path", data / "input.txt"],
    ):
        subprocess.run([sys.executable, *map(str, argv)], check=True, timeout=120, cwd=work)
    nano = [f"--data_dir={data / 'data'}", *TINY, "--max_iters", "60"]
    run = ("--nnodes=2", "--nproc-per-node=1")
    jobs = {
        "ddp": sbatch(
            work, 2, *run, str(EXAMPLES / "nanogpt" / "train.py"), *nano,
            "--save_dir", str(work / "ckpt-ddp"),
        ),
        "fsdp": sbatch(
            work, 2, *run, str(EXAMPLES / "nanogpt" / "fsdp_train.py"), *nano,
            "--save_dir", str(work / "ckpt-fsdp"),
        ),
        "mnist": sbatch(
            work, 2, *run, str(EXAMPLES / "mnist" / "cnn_train.py"),
            "--num_epochs", "1", "--batch_size", "32",
            env={"MNIST_CKPT_DIR": str(work / "ckpt-mnist"), "SYNTHETIC_MNIST_TRAIN": "3200"},
        ),
    }  # fmt: skip
    for name, job in jobs.items():
        fields = wait_job(job, timeout_s=420)
        out = (work / f"slurm-{job}.out").read_text()
        assert fields["JobState"] == "COMPLETED", (name, out[-4000:])
    committed = {name: _committed(work / ".dlrover-hpc" / job) for name, job in jobs.items()}
    assert committed["ddp"] == [30, 60] and committed["fsdp"] == [30, 60], committed
    assert committed["mnist"], committed  # its disk save at the end of the epoch
    assert (work / "ckpt-ddp" / "60" / "rank_0.pt").is_file()
    assert (work / "ckpt-fsdp" / "60" / ".metadata").is_file()

    again = sbatch(
        work, 2, *run, str(EXAMPLES / "nanogpt" / "train.py"),
        f"--data_dir={data / 'data'}", *TINY, "--max_iters", "90",
        "--save_dir", str(work / "ckpt-ddp"),
    )  # fmt: skip
    fields = wait_job(again, timeout_s=300)
    out = (work / f"slurm-{again}.out").read_text()
    assert fields["JobState"] == "COMPLETED", out[-4000:]
    restored = named(events(work / ".dlrover-hpc" / again), "checkpoint_restored")
    assert restored and all(e["step"] == 60 for e in restored), restored
    assert _committed(work / ".dlrover-hpc" / again) == [90]
