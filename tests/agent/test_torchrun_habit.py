"""torchrun's habit: one node and nothing to join runs as ``--standalone`` at once; several
nodes with no way to find their master fail at once, naming the flags that give one."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlrover_hpc.agent.embedded import Without, master_json_live, without_master
from dlrover_hpc.cli import template

pytestmark = pytest.mark.timeout(120)

BIN = Path(sys.executable).parent
FIND, STANDALONE, FAIL = Without.FIND, Without.STANDALONE, Without.FAIL


@pytest.mark.parametrize(
    ("nnodes_max", "master", "slurm", "endpoint", "live", "expected"),
    [
        (1, False, False, False, False, STANDALONE),  # plain `dlrover-run train.py`
        (2, False, False, False, False, FAIL),
        (1, True, False, False, False, FIND),  # --master / DLROVER_HPC_MASTER
        (2, True, False, False, False, FIND),
        (1, False, True, False, False, FIND),  # a Slurm job: the embedded master and the rest
        (4, False, True, False, False, FIND),
        (1, False, False, True, False, FIND),  # --rdzv-endpoint: one agent hosts the master
        (2, False, False, True, False, FIND),
        (1, False, False, False, True, FIND),  # a live master.json: join that master
        (3, False, False, False, True, FIND),
    ],
)
def test_without_master(
    nnodes_max: int, master: bool, slurm: bool, endpoint: bool, live: bool, expected: Without
) -> None:
    got = without_master(
        nnodes_max=nnodes_max,
        master_given=master,
        in_slurm=slurm,
        endpoint=endpoint,
        live_master=live,
    )
    assert got is expected


def test_master_json_is_live_only_while_its_master_listens(tmp_path: Path) -> None:
    assert not master_json_live(tmp_path)  # none
    (tmp_path / "master.json").write_text("{not json")
    assert not master_json_live(tmp_path)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        (tmp_path / "master.json").write_text(json.dumps({"host": "127.0.0.1", "port": port}))
        assert master_json_live(tmp_path)
    assert not master_json_live(tmp_path)  # stale: nothing listens there any more


def _no_job_env() -> dict[str, str]:
    """This environment outside any job: no Slurm, no dlrover-hpc settings."""
    env = os.environ
    return {k: v for k, v in env.items() if not k.startswith(("SLURM_", "DLROVER_HPC_"))}


def test_several_nodes_and_no_master_fail_at_once_naming_the_flags(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print('never runs')\n")
    started = time.monotonic()
    proc = subprocess.run(
        [str(BIN / "dlrover-run"), "--nnodes=2", "--nproc-per-node=2", "train.py"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=_no_job_env(),
    )
    took = time.monotonic() - started
    assert took < 5.0, f"took {took:.1f} s: {proc.stderr}"
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "dlrover-run: error: --nnodes=2:2 needs a job master, and there is none to find: no "
        "Slurm job (SLURM_JOB_ID), no --rdzv-endpoint, no --master or DLROVER_HPC_MASTER, no "
        f"live {tmp_path}/.dlrover-hpc/standalone/master.json; run one node with --standalone, "
        "or give every node's dlrover-run the same --rdzv-endpoint=HOST:PORT (the agent on "
        "HOST hosts the master)"
    ]
    assert not (tmp_path / ".dlrover-hpc").exists()  # nothing started, no job dir made


def test_one_node_without_flags_runs_as_standalone(tmp_path: Path) -> None:
    """The torchrun habit: ``dlrover-run --nproc-per-node=2 train.py``, no --standalone."""
    (tmp_path / "train.py").write_text((template.TEMPLATES / "train.py").read_text())
    proc = subprocess.run(
        [str(BIN / "dlrover-run"), "--nproc-per-node=2", "train.py", "--steps=5"],
        capture_output=True,
        text=True,
        timeout=110,
        cwd=tmp_path,
        env=_no_job_env(),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "done: 5 steps, world size 2" in proc.stdout, proc.stdout
    said = [line for line in proc.stderr.splitlines() if "running as --standalone" in line]
    assert len(said) == 1, proc.stderr[-4000:]
    assert "as torchrun does" in said[0]
