"""A framework's files through shared memory (`FileSetCheckpointer`), one process with the
in-process saver, on the real /dev/shm: the persisted files are what torch.save and
safetensors would have written (read back by torch.load and safetensors), and a step held only
in memory is written out by `restore_files()`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dlrover_hpc.checkpoint import LocalCommitCoordinator, StorageType
from dlrover_hpc.checkpoint.env import WorkerEnv
from dlrover_hpc.checkpoint.trainer.file_set import FileSetCheckpointer, SafetensorsFile
from dlrover_hpc.checkpoint.trainer.saver_connection import InProcessSaver

pytestmark = pytest.mark.timeout(120)


def _files(seed: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    weights = {
        "a.weight": torch.randn(7, 5, generator=g),
        "b.bias": torch.randn(3, generator=g).to(torch.bfloat16),
        "c.count": torch.arange(5, dtype=torch.int64),
        "d.mask": torch.tensor([True, False, True]),
        "e.half": torch.randn(2, 3, generator=g).to(torch.float16)[:, 1:],  # not contiguous
    }
    return {
        "model.safetensors": SafetensorsFile(weights, {"format": "pt"}),
        "optimizer.pt": {"state": {0: {"exp_avg": torch.randn(4, generator=g)}}, "lr": 0.1},
        "trainer_state.json": json.dumps({"global_step": seed}).encode(),
        "sub/rng_state_0.pth": {"cpu": torch.random.get_rng_state(), "python": (3, (1, 2))},
    }


def _check(directory: Path, seed: int) -> None:
    want = _files(seed)
    st = want["model.safetensors"]
    assert isinstance(st, SafetensorsFile)
    loaded = load_file(directory / "model.safetensors")
    assert loaded.keys() == st.tensors.keys()
    for name, tensor in st.tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    with open(directory / "model.safetensors", "rb") as f:
        assert f.read(8)  # a header length, then the header: safetensors read it above
    opt = torch.load(directory / "optimizer.pt")
    assert opt["lr"] == 0.1
    assert torch.equal(opt["state"][0]["exp_avg"], want["optimizer.pt"]["state"][0]["exp_avg"])  # type: ignore[index]
    assert json.loads((directory / "trainer_state.json").read_text()) == {"global_step": seed}
    rng = torch.load(directory / "sub" / "rng_state_0.pth", weights_only=False)
    assert rng["python"] == (3, (1, 2)) and torch.equal(rng["cpu"], torch.random.get_rng_state())


def test_files_persist_as_the_framework_writes_them_and_memory_steps_are_written_out(
    tmp_path: Path, job: str
) -> None:
    env = WorkerEnv.from_environ(
        {"DLROVER_HPC_JOB_ID": job, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
         "LOCAL_WORLD_SIZE": "1"}
    )  # fmt: skip
    link = InProcessSaver(env, commit=LocalCommitCoordinator())
    ckpt = FileSetCheckpointer(str(tmp_path), env=env, link=link)
    try:
        assert ckpt.save_files(10, _files(10), str(tmp_path / "checkpoint-10"), StorageType.DISK)
        assert ckpt.wait_latest_checkpoint(30)
        assert (tmp_path / "dlrover_latest.txt").read_text() == "10\n"
        _check(tmp_path / "checkpoint-10", 10)
        # a memory-only step: nothing on storage until restore_files() writes it out
        assert ckpt.save_files(11, _files(11), str(tmp_path / "checkpoint-11"), StorageType.MEMORY)
        assert not (tmp_path / "checkpoint-11").exists()
        assert ckpt.restore_files() == (11, str(tmp_path / "checkpoint-11"))
        _check(tmp_path / "checkpoint-11", 11)
        assert ckpt.newest_committed() == 10  # written out, not committed by this call
    finally:
        ckpt.close()
