"""DLRover's flash-checkpoint API (`dlrover_hpc.trainer.flash_checkpoint`), in one process.

Every DLRover argument is accepted, mapped or refused with its reason; the deletion strategies
delete the step directories DLRover's would; DLRover's save/load calls round-trip; and the
ported examples import nothing but what the README's mapping table names.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dlrover_hpc.checkpoint import LocalCommitCoordinator
from dlrover_hpc.checkpoint.env import WorkerEnv
from dlrover_hpc.checkpoint.testing import NullLink
from dlrover_hpc.checkpoint.trainer.saver_connection import InProcessSaver
from dlrover_hpc.localslurm import wait_for
from dlrover_hpc.trainer.flash_checkpoint.checkpointer import Checkpointer, StorageType
from dlrover_hpc.trainer.flash_checkpoint.ddp import DdpCheckpointer
from dlrover_hpc.trainer.flash_checkpoint.fsdp import FsdpFullCheckpointer, FsdpShardCheckpointer
from dlrover_hpc.trainer.storage import (
    CheckpointDeletionStrategy,
    KeepLatestStepStrategy,
    KeepStepIntervalStrategy,
    PosixDiskStorage,
    PosixStorageWithDeletion,
)

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "dlrover"


def _env(job: str, *, rank: int = 0, world: int = 1) -> WorkerEnv:
    return WorkerEnv.from_environ(
        {
            "DLROVER_HPC_JOB_ID": job,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
        }
    )


def _state(step: int) -> dict[str, Any]:
    torch.manual_seed(step)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(3, 16)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["step"] == b["step"] and all(
        torch.equal(a["model"][k], v) for k, v in b["model"].items()
    )


def _steps(root: Path) -> list[int]:
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit())


# ---------------------------------------------------------------------------- arguments
def test_constructors_accept_every_dlrover_argument(tmp_path: Path, job: str) -> None:
    d = str(tmp_path)
    # DLRover's positional order: checkpoint_dir, local_shard_num, global_shard_num,
    # comm_backend, deletion_strategy, save_timeout, replica_count
    ddp = DdpCheckpointer(d, 1, 1, "gloo", KeepLatestStepStrategy(3, d), 600, 1, env=_env(job))
    shard = FsdpShardCheckpointer(
        d + "/s",
        comm_backend="gloo",
        deletion_strategy=KeepStepIntervalStrategy(5, d + "/s"),
        save_timeout=60,
        env=_env(job),
        tag="s",
    )
    full = FsdpFullCheckpointer(
        d + "/f", "", None, 600, storage=PosixDiskStorage(), env=_env(job), tag="f"
    )
    older = DdpCheckpointer(
        d + "/o",
        storage=PosixStorageWithDeletion("dlrover_latest.txt", KeepLatestStepStrategy(2, d + "/o")),
        env=_env(job),
        tag="o",
    )
    try:
        assert all(isinstance(c, Checkpointer) for c in (ddp, shard, full, older))
        assert ddp.core.engine.keep_last == 3 and ddp.core.engine.keep_interval is None
        assert shard.core.engine.keep_interval == 5 and shard.core.engine.keep_last is None
        assert full.core.engine.keep_last is None and full.core.engine.keep_interval is None
        assert older.core.engine.keep_last == 2
        assert isinstance(ddp.storage, PosixStorageWithDeletion)  # DLRover's attribute
    finally:
        for c in (ddp, shard, full, older):
            c.close()


class _Custom(CheckpointDeletionStrategy):
    def clean_up(self, step: int, delete_func: Any) -> None:
        delete_func(str(step))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"replica_count": True}, "must be an integer >= 0"),
        ({"local_shard_num": 2, "global_shard_num": 4}, "needs every rank to save its part"),
        ({"local_shard_num": 1, "global_shard_num": 2}, "needs every rank to save its part"),
        ({"replica_count": -1}, "must be an integer >= 0"),
        ({"deletion_strategy": _Custom()}, "cannot run a strategy class of the training script"),
        ({"deletion_strategy": KeepLatestStepStrategy(2, "/elsewhere")}, "is not the checkpointer"),
        ({"storage": object()}, "only PosixDiskStorage and PosixStorageWithDeletion"),
        ({"comm_backend": 3}, "must be a backend name"),
        ({"save_timeout": 0}, "must be a positive number"),
        ({"deletion_strategy": KeepLatestStepStrategy(2, "."), "keep_last": 4}, "not both"),
    ],
)
def test_refusals_raise_with_the_reason(
    tmp_path: Path, job: str, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        DdpCheckpointer(str(tmp_path), env=_env(job, world=2), **kwargs)


def test_replica_count_reaches_the_engine_of_sharded_state_only(tmp_path: Path, job: str) -> None:
    env = _env(job, world=2)
    link = NullLink(env.prefix, str(tmp_path / "shm"))
    os.makedirs(link.shm_dir)
    sharded = DdpCheckpointer(str(tmp_path), 2, 2, replica_count=1, env=env, link=link)
    replicated = DdpCheckpointer(str(tmp_path), replica_count=1, env=env, link=link, tag="r")
    try:
        assert sharded.core.engine.replicas == 1 and replicated.core.engine.replicas == 0
        assert sharded.save_checkpoint(3, _state(3), storage_type=StorageType.MEMORY)
        assert [(os.path.basename(p), s, n) for p, s, n in link.replicated] == [
            (os.path.basename(sharded.core.engine.segment_path(0)), 3, 1)
        ]
    finally:
        sharded.close()
        replicated.close()


def test_call_refusals(tmp_path: Path, job: str) -> None:
    env = _env(job, world=2)
    link = InProcessSaver(env, commit=LocalCommitCoordinator())
    ckpt = DdpCheckpointer(str(tmp_path), 2, 2, env=env, link=link)
    try:
        with pytest.raises(ValueError, match="No support storage type"):
            ckpt.save_checkpoint(1, _state(1), storage_type="disk")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"pass <step directory>/rank_0\.pt"):
            ckpt.save_checkpoint(1, _state(1), str(tmp_path / "1" / "model.pt"))
    finally:
        ckpt.close()


# ---------------------------------------------------------------------------- retention
def test_strategies_clean_up_as_dlrover_s() -> None:
    deleted: list[str] = []
    latest = KeepLatestStepStrategy(max_to_keep=2, checkpoint_dir="/c")
    interval = KeepStepIntervalStrategy(keep_interval=3, checkpoint_dir="/c")
    for step in range(1, 7):  # DLRover calls clean_up with the step committed before
        latest.clean_up(step, deleted.append)
    assert deleted == ["/c/1", "/c/2", "/c/3", "/c/4", "/c/5"]
    deleted.clear()
    for step in range(1, 7):
        interval.clean_up(step, deleted.append)
    assert deleted == ["/c/1", "/c/2", "/c/4", "/c/5"]


@pytest.mark.parametrize(
    ("strategy", "steps", "kept"),
    [
        (KeepLatestStepStrategy, (2, range(1, 6)), [4, 5]),
        (KeepStepIntervalStrategy, (3, range(1, 8)), [3, 6, 7]),
    ],
)
def test_deletion_strategies_delete_the_right_step_directories(
    tmp_path: Path, job: str, strategy: Any, steps: Any, kept: list[int]
) -> None:
    number, saves = steps
    ckpt = DdpCheckpointer(
        str(tmp_path), deletion_strategy=strategy(number, str(tmp_path)), env=_env(job)
    )
    try:
        for step in saves:
            ckpt.save_checkpoint(step, _state(step))
            assert ckpt.wait_latest_checkpoint(30)
        # Retention runs in the saver right after the newest commit that the wait returns on:
        # wait for it (a loaded machine once listed step 3 still there), then check exactly.
        with contextlib.suppress(TimeoutError):
            wait_for(lambda: _steps(tmp_path) == kept, timeout_s=30, what="retention")
        assert _steps(tmp_path) == kept
        assert all(os.listdir(tmp_path / str(s)) == ["rank_0.pt"] for s in kept)
        assert (tmp_path / "dlrover_latest.txt").read_text().strip() == str(kept[-1])
    finally:
        ckpt.close()


# ---------------------------------------------------------------------------- DDP calls
def test_ddp_round_trip_through_dlrover_calls(tmp_path: Path, job: str) -> None:
    ckpt = DdpCheckpointer(str(tmp_path), env=_env(job))
    other = DdpCheckpointer(str(tmp_path), env=_env(job), tag="fresh")  # memory of its own
    try:
        assert ckpt.save_checkpoint(2, _state(2), storage_type=StorageType.MEMORY)
        assert ckpt.save_checkpoint(4, _state(4), storage_type=StorageType.DISK)
        assert ckpt.wait_latest_checkpoint(30)
        assert (tmp_path / "dlrover_latest.txt").read_text().strip() == "4"
        assert _same(torch.load(tmp_path / "4" / "rank_0.pt"), _state(4))  # DLRover's file
        assert not (tmp_path / "2").exists()  # a MEMORY save is not persisted
        assert ckpt.save_checkpoint(5, _state(5), storage_type=StorageType.MEMORY)

        assert _same(ckpt.load_checkpoint(), _state(5))  # memory first
        assert ckpt.last_restored == (5, "memory")
        resume = str(tmp_path / "4" / "rank_0.pt")
        assert _same(ckpt.load_checkpoint(resume_path=resume), _state(5))  # memory wins

        assert _same(other.load_checkpoint(resume_path=resume), _state(4))  # no memory: file
        assert other.load_checkpoint(resume_path=str(tmp_path / "missing.pt")) == {}
        assert _same(other.load_checkpoint(), _state(4))  # no memory: newest committed
        assert other.last_restored == (4, "storage")

        custom = str(tmp_path / "custom" / "model-6.pt")  # DLRover's explicit path
        assert ckpt.save_checkpoint(6, _state(6), custom)
        assert ckpt.wait_latest_checkpoint(30)
        assert _same(torch.load(custom), _state(6))
        assert _same(other.load_checkpoint(), _state(6))  # found by its commit record
    finally:
        ckpt.close()
        other.close()


def test_sharded_ddp_saves_one_file_per_rank(tmp_path: Path, job: str) -> None:
    envs = [_env(job, rank=r, world=2) for r in range(2)]
    link = InProcessSaver(envs[0], commit=LocalCommitCoordinator())
    ckpts = [DdpCheckpointer(str(tmp_path), 2, 2, env=e, link=link) for e in envs]
    try:
        for rank, ckpt in enumerate(ckpts):
            assert ckpt.save_checkpoint(3, _state(3 + rank))
        assert ckpts[1].wait_latest_checkpoint(30)
        assert sorted(os.listdir(tmp_path / "3")) == ["rank_0.pt", "rank_1.pt"]
        assert _same(torch.load(tmp_path / "3" / "rank_1.pt"), _state(4))
        resume = str(tmp_path / "3" / "rank_1.pt")
        fresh = DdpCheckpointer(str(tmp_path), 2, 2, env=envs[1], link=link, tag="fresh")
        try:
            assert _same(fresh.load_checkpoint(resume_path=resume), _state(4))
        finally:
            fresh.close()
    finally:
        for c in ckpts:
            c.close()


# ---------------------------------------------------------------------------- FSDP calls
@pytest.fixture
def one_rank_group(tmp_path: Path) -> Any:
    """A gloo process group of one rank (FSDP needs one), destroyed afterwards."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _fsdp_model() -> tuple[Any, torch.optim.Optimizer]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model = FSDP(net, device_id=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return model, opt


def _snapshot(model: Any, opt: torch.optim.Optimizer) -> tuple[list[torch.Tensor], Any]:
    state = opt.state_dict()["state"]
    return [p.detach().clone() for p in model.parameters()], {
        k: {n: t.clone() for n, t in v.items()} for k, v in state.items()
    }


def _matches(model: Any, opt: torch.optim.Optimizer, snap: tuple[list[torch.Tensor], Any]) -> bool:
    params, state = snap
    now = opt.state_dict()["state"]
    return all(torch.equal(p, q) for p, q in zip(model.parameters(), params, strict=True)) and all(
        torch.equal(now[k][n], t) for k, v in state.items() for n, t in v.items()
    )


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_fsdp_checkpointers_load_into_model_and_optimizer(
    tmp_path: Path, job: str, one_rank_group: None
) -> None:
    model, opt = _fsdp_model()
    snap = _snapshot(model, opt)
    shard = FsdpShardCheckpointer(str(tmp_path / "shard"), env=_env(job), tag="s")
    fresh = FsdpShardCheckpointer(str(tmp_path / "other"), env=_env(job), tag="o")
    full = FsdpFullCheckpointer(str(tmp_path / "full"), env=_env(job), tag="f")
    try:
        assert shard.save_checkpoint(3, model, opt, {"step": 3})
        assert full.save_checkpoint(3, model, opt, {"step": 3, "epoch": 1})
        assert shard.wait_latest_checkpoint(30) and full.wait_latest_checkpoint(30)
        assert (tmp_path / "shard" / "3" / ".metadata").exists()
        assert os.listdir(tmp_path / "full" / "3") == ["rank_0.pt"]

        def scramble() -> None:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            for v in opt.state_dict()["state"].values():
                v["exp_avg"].zero_()

        scramble()
        assert shard.load_checkpoint(model, opt) == {"step": 3}
        assert shard.last_restored == (3, "memory") and _matches(model, opt, snap)
        scramble()
        resume = str(tmp_path / "shard" / "3")
        assert fresh.load_checkpoint(model, opt, resume_path=resume) == {"step": 3}
        assert _matches(model, opt, snap)
        assert fresh.load_checkpoint(model, opt) == {}  # nothing in memory or storage
        scramble()
        assert full.load_checkpoint(model, opt) == {"step": 3, "epoch": 1}
        assert _matches(model, opt, snap)
    finally:
        for c in (shard, fresh, full):
            c.close()


# ---------------------------------------------------------------------------- examples
def _mapping() -> dict[str, str]:
    """The README's module mapping: `| dlrover module | dlrover_hpc module |` rows."""
    row = r"^\|\s*`(dlrover\.[\w.]+)`\s*\|\s*`(dlrover_hpc\.[\w.]+)`\s*\|"
    rows = re.findall(row, _readme(), re.M)
    return {hpc: upstream for upstream, hpc in rows}


def _readme() -> str:
    return (EXAMPLES / "README.md").read_text()


def test_examples_import_only_modules_of_the_readme_mapping() -> None:
    mapping = _mapping()
    assert len(mapping) >= 6, mapping
    for ours, theirs in mapping.items():
        # one substitution per module path, as the package docstring says
        prefixes = [
            ("dlrover.trainer.torch.flash_checkpoint", "dlrover_hpc.trainer.flash_checkpoint"),
            ("dlrover.trainer.torch.elastic", "dlrover_hpc.trainer.elastic"),
            ("dlrover.python.common.storage", "dlrover_hpc.trainer.storage"),
        ]
        assert any(theirs.replace(a, b, 1) == ours for a, b in prefixes if theirs.startswith(a))
    scripts = sorted(EXAMPLES.rglob("*.py"))
    assert {p.name for p in scripts} >= {"train.py", "fsdp_train.py", "cnn_train.py"}
    seen = set()
    for script in scripts:
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = [(node.module, [a.name for a in node.names])]
            elif isinstance(node, ast.Import):
                modules = [(a.name, []) for a in node.names]
            else:
                continue
            for module, names in modules:
                assert not module.startswith("dlrover."), f"{script.name}: {module} not ported"
                if not module.startswith("dlrover_hpc"):
                    continue
                assert module in mapping, f"{script.name}: {module} is not in the README"
                imported = importlib.import_module(module)
                missing = [n for n in names if not hasattr(imported, n)]
                assert not missing, f"{script.name}: {module} lacks {missing}"
                seen.add(module)
    assert seen >= {
        "dlrover_hpc.trainer.flash_checkpoint.ddp",
        "dlrover_hpc.trainer.flash_checkpoint.fsdp",
        "dlrover_hpc.trainer.elastic.trainer",
    }
