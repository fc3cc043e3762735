"""``--persist-every`` on the node: the saver persists each rank's first save at or after a
step straight from shared memory, for workers that save only to memory (issue 49)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlrover_hpc.checkpoint import LocalCommitCoordinator, SaverHost
from dlrover_hpc.checkpoint.event_sinks import ListEventSink
from dlrover_hpc.checkpoint.saver.commit_records import CheckpointDir
from dlrover_hpc.checkpoint.saver.persist_at import first_at_or_after
from dlrover_hpc.checkpoint.saver.storage import Storage
from dlrover_hpc.checkpoint.testing import remove_job_segments
from dlrover_hpc.localslurm import wait_for

pytestmark = pytest.mark.timeout(180)
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("held", "step", "chosen"),
    [
        ([], 5, None),  # nothing saved yet: wait for the save
        ([3, 4], 5, None),  # not there yet
        ([4, 5], 5, 5),  # the step itself
        ([5, 6], 5, 5),
        ([4, 6], 5, 6),  # 6 is the first at or after 5: 4 came before it
        ([6, 7], 5, None),  # past it by two saves: 5 may have been overwritten
        ([6], 5, None),
        ([5], 5, 5),
        ([8, 10], 9, 10),  # a save every second step
    ],
)
def test_first_at_or_after(held: list[int], step: int, chosen: int | None) -> None:
    assert first_at_or_after(held, step) == chosen


WORKER = """
import json, os, sys, time
sys.path.insert(0, {repo!r})
from dlrover_hpc.checkpoint import RankCheckpointer, StorageType
from dlrover_hpc.checkpoint.testing import filled_state
rank = int(os.environ["RANK"])
ckpt = RankCheckpointer({ckpt_dir!r})
go = {go!r}
for step in range(1, 9):
    if step == 4:  # steps 1-3 saved: wait for the test
        print(json.dumps({{"ready": 3}}), flush=True)
        while not os.path.exists(go):
            time.sleep(0.02)
    state = filled_state(step * 10 + rank)
    assert ckpt.save_checkpoint(step, state, storage_type=StorageType.MEMORY)
print(json.dumps({{"done": 8}}), flush=True)
time.sleep(120)
"""


SINK = "sink"


@pytest.fixture
def host(tmp_path: Path) -> Iterator[SaverHost]:
    job = f"p{uuid.uuid4().hex[:10]}"
    saver = SaverHost(
        job_id=job,
        node_name="nodeA",
        socket_path=str(tmp_path / "sock" / "saver.sock"),
        commit=LocalCommitCoordinator(),
        events=(sink := ListEventSink()),
        saved_events=ListEventSink(),  # as under an agent: the workers report their saves
    )
    setattr(saver, SINK, sink)
    saver.start()
    yield saver
    saver.close()
    assert not remove_job_segments(job)


def _read_json(proc: subprocess.Popen[str], key: str) -> object:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("{"):
            data = json.loads(line)
            if key in data:
                return data[key]
    raise AssertionError(
        f"worker exited without {key!r}: {proc.stderr.read() if proc.stderr else ''}"
    )


def test_memory_only_saves_are_persisted_at_the_asked_step(tmp_path: Path, host: SaverHost) -> None:
    """Two ranks save only to memory.  Asked for step 2 after saving 1-3, the saver takes 2
    from their buffers at once; asked for 5 before they get there, it takes each rank's save
    of 5 as its report comes; both steps commit, and nothing else is persisted."""
    ckpt_dir, go = tmp_path / "ckpt", tmp_path / "go"
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(repo=str(REPO), ckpt_dir=str(ckpt_dir), go=str(go)))
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    env = {
        **os.environ,
        "DLROVER_HPC_SAVER_SOCKET": host.socket_path,
        "DLROVER_HPC_JOB_ID": host.job_id,
        "DLROVER_HPC_JOB_DIR": str(job_dir),  # the workers report their saves
        "DLROVER_HPC_NODE_NAME": "nodeA",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "OMP_NUM_THREADS": "1",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    cdir = CheckpointDir(str(ckpt_dir), Storage(str(ckpt_dir)))
    try:
        assert [_read_json(p, "ready") for p in procs] == [3, 3]
        assert sorted(host.persist_step(2)) == [0, 1]  # held: submitted at once
        wait_for(lambda: cdir.newest_step() == 2, timeout_s=60, what="step 2 committed")
        assert host.persist_step(5) == []  # not saved yet
        go.touch()
        assert [_read_json(p, "done") for p in procs] == [8, 8]
        wait_for(lambda: cdir.newest_step() == 5, timeout_s=60, what="step 5 committed")
        assert host.wait_idle(30)
        sink: ListEventSink = getattr(host, SINK)
        persisted = sorted({e["step"] for e in sink.named("checkpoint_persisted")})
        assert persisted == [2, 5]
        assert cdir.newest_step() == 5
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)
