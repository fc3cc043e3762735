"""Two real ranks (gloo): memory or storage is one decision all ranks make together.

One rank's shared memory is lost (segments removed) or unreadable (its meta no longer matches
the model: the read fails before, or inside, DCP's collectives).  Every rank must then load
the same step from storage, nobody hangs, and the job goes on saving and restoring from
memory again.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from dlrover_hpc.checkpoint.testing import remove_job_segments

pytestmark = pytest.mark.timeout(180)
REPO = Path(__file__).resolve().parents[2]

PREAMBLE = """
import json, os, sys
from datetime import timedelta
sys.path.insert(0, {repo!r})
import torch, torch.distributed as dist
from dlrover_hpc.checkpoint import DdpCheckpointer, FsdpShardCheckpointer, StorageType
from dlrover_hpc.checkpoint.saver.segments import Segment

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank = dist.get_rank()
root = {root!r}
out = []

def damage(ck, edit):
    # rewrite this rank's segments' meta (with valid CRCs): the step is still listed as held
    for b in (0, 1):
        path = ck.engine.segment_path(b)
        if not os.path.exists(path):
            continue
        seg = Segment(path, writable=True)
        seg.lock(exclusive=True)
        try:
            h = seg.header()
            if h is not None:
                meta = dict(h.meta)
                edit(meta)
                raw = json.dumps(meta).encode()
                seg.finish_write(seq=h.seq, step=h.step, image_len=h.image_len, meta=raw)
        finally:
            seg.unlock()
            seg.close()

def lose_memory(ck):
    for b in (0, 1):
        path = ck.engine.segment_path(b)
        if os.path.exists(path):
            os.unlink(path)

def finish():
    with open(root + f"/out{{rank}}.json", "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()
"""

FSDP_SCRIPT = """
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

mesh = init_device_mesh("cpu", (2,))
full = torch.arange(64, dtype=torch.float32).reshape(8, 8)

def make(scale):
    return {{"w": distribute_tensor(full * scale, mesh, [Shard(0)]), "step": scale}}

def restore(label):
    target = make(0)
    ck.load_checkpoint(target)
    step = ck.last_restored[0]
    ok = torch.equal(target["w"].to_local(), (full * step).chunk(2)[rank])
    out.append([label, ck.last_restored, bool(ok and target["step"] == step)])

ck = FsdpShardCheckpointer(root + "/fsdp")
for s in (1, 2, 3):
    assert ck.save_checkpoint(s, make(s), storage_type=StorageType.DISK)
assert ck.wait_latest_checkpoint(60)
dist.barrier()
if rank == 1:  # this rank's node lost its memory
    lose_memory(ck)
restore("one_rank_lost_memory")
assert ck.save_checkpoint(4, make(4), storage_type=StorageType.MEMORY)
restore("memory_again")
dist.barrier()
if rank == 1:  # fails on this rank alone, before DCP's collectives
    damage(ck, lambda meta: meta.pop("restore"))
restore("unreadable_before_dcp")
assert ck.save_checkpoint(5, make(5), storage_type=StorageType.MEMORY)
dist.barrier()
if rank == 1:  # fails inside DCP's load on this rank
    damage(ck, lambda meta: meta.get("restore") and meta["restore"].update(items=[]))
restore("unreadable_inside_dcp")
assert ck.save_checkpoint(6, make(6), storage_type=StorageType.DISK)
assert ck.wait_latest_checkpoint(60)
restore("job_goes_on")
ck.close()
finish()
"""

DDP_SCRIPT = """
def state(step):
    return {{"w": torch.full((16,), float(step)), "step": step}}

def restore(label):
    got = ck.load_checkpoint(state_dict=state(0))
    step = ck.last_restored[0]
    ok = got["step"] == step and bool((got["w"] == float(step)).all())
    out.append([label, ck.last_restored, ok])

ck = DdpCheckpointer(root + "/ddp")  # each rank is the leader of its own node
for s in (1, 2):
    assert ck.save_checkpoint(s, state(s), storage_type=StorageType.DISK)
assert ck.wait_latest_checkpoint(60)
dist.barrier()
if rank == 1:
    damage(ck, lambda meta: meta.pop("restore"))
restore("unreadable_on_one_node")
dist.barrier()
if rank == 1:
    lose_memory(ck)
restore("one_node_lost_memory")
assert ck.save_checkpoint(3, state(3), storage_type=StorageType.MEMORY)
restore("memory_again")
ck.close()
finish()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_two_ranks(tmp_path: Path, body: str, *, own_nodes: bool) -> list[list[object]]:
    """Runs `body` on two gloo ranks; each rank is its own node when `own_nodes`."""
    job = f"a{uuid.uuid4().hex[:10]}"
    script = tmp_path / "rank.py"
    text = PREAMBLE.format(repo=str(REPO), root=str(tmp_path)) + body.format()
    script.write_text(textwrap.dedent(text))
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "DLROVER_HPC_JOB_ID": job,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "RANK": str(rank),
            "LOCAL_RANK": "0" if own_nodes else str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "1" if own_nodes else "2",
            "DLROVER_HPC_NODE_NAME": f"node{rank}" if own_nodes else "node0",
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)], env=env, stderr=subprocess.PIPE, text=True
            )
        )
    errors = []
    try:
        for p in procs:
            try:
                errors.append(p.communicate(timeout=150)[1])
            except subprocess.TimeoutExpired:
                errors.append("timed out: a rank hung (collectives did not match)")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        leaked = remove_job_segments(job)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(e[-3000:] for e in errors)
    assert not leaked, f"segments left behind: {leaked}"
    outs = [json.loads((tmp_path / f"out{rank}.json").read_text()) for rank in range(2)]
    assert outs[0] == outs[1], f"the ranks restored differently: {outs}"
    return outs[0]


def test_fsdp_ranks_fall_back_to_storage_together(tmp_path: Path) -> None:
    pytest.importorskip("numpy", reason="multi-rank torch.distributed.checkpoint needs numpy")
    assert _run_two_ranks(tmp_path, FSDP_SCRIPT, own_nodes=False) == [
        ["one_rank_lost_memory", [3, "storage"], True],
        ["memory_again", [4, "memory"], True],
        ["unreadable_before_dcp", [3, "storage"], True],
        ["unreadable_inside_dcp", [3, "storage"], True],
        ["job_goes_on", [6, "memory"], True],
    ]


def test_ddp_nodes_fall_back_to_storage_together(tmp_path: Path) -> None:
    assert _run_two_ranks(tmp_path, DDP_SCRIPT, own_nodes=True) == [
        ["unreadable_on_one_node", [2, "storage"], True],
        ["one_node_lost_memory", [2, "storage"], True],
        ["memory_again", [3, "memory"], True],
    ]
