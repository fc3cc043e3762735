"""``dlrover-hpc batch-size N``: the workers' ElasticDataLoader takes the new size from the job
directory's parallelism config, which dlrover-run points them at."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cli.test_errors import one_line_error, run
from dlrover_hpc.agent.workers import worker_env
from dlrover_hpc.cli.run_args import build_parser, config_from_args
from dlrover_hpc.protocol.messages import Assignment, NodeStatus
from dlrover_hpc.trainer.elastic.dataloader import ElasticDataLoader

pytestmark = pytest.mark.timeout(120)


def test_a_running_jobs_loaders_take_the_new_batch_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DLROVER_PARAL_CONFIG_PATH", raising=False)
    assignment = Assignment(status=NodeStatus.ACTIVE, round=2, world_size=2, rank_offset=0)
    config = config_from_args(build_parser().parse_args(["--nproc-per-node=2", "train.py"]))
    env = worker_env(config, assignment, local_rank=1, extra={"DLROVER_HPC_JOB_DIR": str(tmp_path)})
    path = env["DLROVER_PARAL_CONFIG_PATH"]
    assert path == str(tmp_path / "paral_config.json") and env["DLROVER_HPC_ROUND"] == "2"
    monkeypatch.setenv("DLROVER_PARAL_CONFIG_PATH", path)
    loader = ElasticDataLoader(list(range(64)), batch_size=4)
    for size, version in ((8, 1), (16, 2)):
        done = run("dlrover-hpc", "batch-size", str(size), "--job-dir", str(tmp_path), cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert f"batch size {size} (config version {version})" in done.stdout
        loader.update_batch_size()  # what ElasticTrainer calls after each optimizer step
        assert len(next(iter(loader))) == size
    assert json.loads(Path(path).read_text()) == {"dataloader": {"version": 2, "batch_size": 16}}
    assert isinstance(next(iter(loader)), torch.Tensor)
    one_line_error(
        run("dlrover-hpc", "batch-size", "0", "--job-dir", str(tmp_path), cwd=tmp_path),
        2,
        "batch size 0: must be at least 1",
    )
