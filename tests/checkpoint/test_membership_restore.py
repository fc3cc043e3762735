"""Restore after a membership change (issue 12, item 7), with real processes and /dev/shm.

Three processes play the workers of a job whose world re-forms several times.  In the first
world (nodes n0, n1, n2) they save step 1 to storage and step 2 to memory only, with a DDP, a
per-rank and a DCP checkpointer.  Each later world is a new process group whose ranks sit on
other nodes (a node is its segments' name prefix): one node gone, a new node, nodes swapped,
only new nodes, and damaged memory.  Every rank reports its source (`checkpoint_restored`),
its step, whether the state is exactly what was saved, and how many checkpoint files it read
from storage.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import uuid
from pathlib import Path

import pytest
from harness.ports import free_port
from warm_python import WarmPython

from dlrover_hpc.checkpoint import RankCheckpointer, StorageType
from dlrover_hpc.checkpoint.env import WorkerEnv
from dlrover_hpc.checkpoint.testing import (
    NullLink,
    filled_state,
    job_segments,
    remove_job_segments,
)

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.runtime,
]
REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, os, sys
from datetime import timedelta
sys.path.insert(0, {repo!r})
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from dlrover_hpc.checkpoint import (
    DdpCheckpointer, FsdpShardCheckpointer, RankCheckpointer, StorageType)
from dlrover_hpc.checkpoint.env import WorkerEnv, current_user
from dlrover_hpc.checkpoint.event_sinks import ListEventSink
from dlrover_hpc.checkpoint.saver.segments import Segment
from dlrover_hpc.checkpoint.testing import NullLink, check_filled, filled_state

proc, root, job, ports = int(sys.argv[1]), {root!r}, {job!r}, {ports!r}
FULL = torch.arange(72, dtype=torch.float32).reshape(9, 8)
out = {{}}

def worker_env(rank, world, node, phase):
    return WorkerEnv(
        rank=rank, local_rank=0, world_size=world, local_world_size=1, group_rank=rank,
        job_id=job, node_name=node, user=current_user(), saver_socket=None, job_dir=None,
        shm_dir="/dev/shm", run_id=job, restart_count=phase)

def dtensors(scale, world):
    mesh = init_device_mesh("cpu", (world,))
    return {{"w": distribute_tensor(FULL * scale, mesh, [Shard(0)]), "step": scale}}

def checkpointers(env, **kw):
    return {{
        "ddp": DdpCheckpointer(root + "/ddp", tag="ddp", env=env, **kw),
        "rank": RankCheckpointer(root + "/rank", tag="rank", env=env, **kw),
        "dcp": FsdpShardCheckpointer(root + "/dcp", tag="dcp", env=env, **kw),
    }}

def save_phase():
    # world 1: n0, n1, n2; step 1 on storage, step 2 in memory only
    env = worker_env(proc, 3, f"n{{proc}}", 0)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    cks = checkpointers(env)
    states = {{
        "ddp": lambda s: filled_state(s),
        "rank": lambda s: filled_state(10 * s + proc),
        "dcp": lambda s: dtensors(s, 3),
    }}
    for kind, ck in cks.items():
        assert ck.save_checkpoint(1, states[kind](1), storage_type=StorageType.DISK)
        assert ck.wait_latest_checkpoint(60)
        assert ck.save_checkpoint(2, states[kind](2), storage_type=StorageType.MEMORY)
        ck.close(remove_segments=False)
    dist.destroy_process_group()

def restore(label, ck, kind, rank, world, events):
    reads = []
    storage = ck.engine.storage
    real = storage.map_file
    storage.map_file = lambda path: reads.append(path) or real(path)
    if kind == "dcp":
        target = dtensors(0, world)
        ck.load_checkpoint(target)
        step = target["step"]
        want = (FULL * step).tensor_split(world)[rank]
        ok = torch.equal(target["w"].to_local(), want)
    else:
        state = ck.load_checkpoint(state_dict=filled_state(0))
        step = state["step"] if kind == "ddp" else state["step"] // 10
        check_filled(state, step if kind == "ddp" else 10 * step + rank)
        ok = True
    (event,) = [e for e in events.events if e["event"] == "checkpoint_restored"]
    events.events.clear()
    assert ck.last_restored == (step, event["source"]), (ck.last_restored, event)
    out.setdefault(label, {{}})[kind] = [event["source"], step, bool(ok), len(reads)]

def damage(path, edit):
    seg = Segment(path, writable=True)
    seg.lock(exclusive=True)
    try:
        edit(seg)
    finally:
        seg.unlock()
        seg.close()

def drop_restore_info(seg):  # header intact: listed as held, fails when loaded
    h = seg.header()
    meta = dict(h.meta)
    meta.pop("restore")
    raw = json.dumps(meta).encode()
    seg.finish_write(seq=h.seq, step=h.step, image_len=h.image_len, meta=raw)

def flip_header_crc(seg):  # a torn header: not listed at all
    seg.mm[60] ^= 0xFF

def restore_phase(phase, label, nodes, kinds, before=None):
    if proc >= len(nodes):
        return
    world = len(nodes)
    env = worker_env(proc, world, nodes[proc], phase)
    init = f"tcp://127.0.0.1:{{ports[phase]}}"
    dist.init_process_group(
        "gloo", init_method=init, rank=proc, world_size=world, timeout=timedelta(seconds=60))
    events = ListEventSink()
    cks = checkpointers(env, link=NullLink(env.prefix), events=events)
    if before is not None:
        before(cks)
    dist.barrier()
    for kind in kinds:
        restore(label, cks[kind], kind, proc, world, events)
    for ck in cks.values():
        ck.close()
    dist.destroy_process_group()

def break_memory(cks):
    if proc == 0:  # n0's DDP copy is torn, n1's newest DDP copy is gone
        damage(cks["ddp"].engine.segment_path(1), flip_header_crc)
    if proc == 1:
        os.unlink(cks["ddp"].engine.segment_path(1))
        damage(cks["rank"].engine.segment_path(1), drop_restore_info)

save_phase()
ALL = ["ddp", "rank", "dcp"]
restore_phase(1, "n1_lost", ["n0", "n2"], ALL)
restore_phase(2, "new_node", ["n0", "n9", "n2"], ["ddp", "rank"])
restore_phase(3, "nodes_swapped", ["n2", "n0", "n1"], ALL)
restore_phase(4, "only_new_nodes", ["n8", "n9"], ["ddp"])
restore_phase(5, "damaged", ["n0", "n1", "n2"], ["ddp", "rank"], before=break_memory)
with open(root + f"/out{{proc}}.json", "w") as f:
    json.dump(out, f)
"""


@pytest.fixture(scope="module")
def restored(
    tmp_path_factory: pytest.TempPathFactory, warm_python: WarmPython
) -> list[dict[str, dict[str, list[object]]]]:
    """What each of the three processes restored in each world (one run for all tests)."""
    pytest.importorskip("numpy", reason="multi-rank torch.distributed.checkpoint needs numpy")
    root = tmp_path_factory.mktemp("membership")
    job = f"m{uuid.uuid4().hex[:10]}"
    ports = [free_port() for _ in range(6)]
    script = root / "worker.py"
    script.write_text(
        textwrap.dedent(SCRIPT.format(repo=str(REPO), root=str(root), job=job, ports=ports))
    )
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(ports[0]),
        "RANK": "0",
        "WORLD_SIZE": "3",
        "OMP_NUM_THREADS": "1",
    }
    procs = [
        subprocess.Popen(
            warm_python([str(script), str(p)]),
            env={**env, "RANK": str(p)},
            stderr=subprocess.PIPE,
            text=True,
        )
        for p in range(3)
    ]
    errors = []
    try:
        for p in procs:
            try:
                errors.append(p.communicate(timeout=150)[1])
            except subprocess.TimeoutExpired:
                errors.append("timed out: a rank hung (collectives or transfers did not match)")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        leaked = remove_job_segments(job)
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(e[-3000:] for e in errors)
    assert leaked, "the first world's segments should have stayed in /dev/shm until the end"
    return [json.loads((root / f"out{p}.json").read_text()) for p in range(3)]


def _by_rank(restored: list[dict[str, dict[str, list[object]]]], label: str, kind: str) -> list:
    return [out[label][kind] for out in restored if label in out]


def test_a_lost_node_leaves_replicated_state_in_memory(restored: list) -> None:
    """World n0 n1 n2 -> n0 n2: DDP restores step 2 from memory on both ranks, reading no
    checkpoint file; sharded state saved by 3 ranks cannot be resharded in memory: storage."""
    assert _by_rank(restored, "n1_lost", "ddp") == [["memory", 2, True, 0]] * 2
    assert _by_rank(restored, "n1_lost", "rank") == [["storage", 1, True, 1]] * 2
    assert [r[:3] for r in _by_rank(restored, "n1_lost", "dcp")] == [["storage", 1, True]] * 2


def test_a_new_node_receives_its_copy_from_a_peer(restored: list) -> None:
    """World n0 n9 n2 (n9 new, empty memory): the holders restore from memory, the new rank
    from a peer, all exactly step 2; a part lost with n1 sends every rank to storage."""
    assert _by_rank(restored, "new_node", "ddp") == [
        ["memory", 2, True, 0],
        ["peer", 2, True, 0],
        ["memory", 2, True, 0],
    ]
    assert _by_rank(restored, "new_node", "rank") == [["storage", 1, True, 1]] * 3


def test_ranks_that_moved_between_nodes_receive_their_parts(restored: list) -> None:
    """World n2 n0 n1: every node holds another rank's part; each rank receives its own."""
    assert _by_rank(restored, "nodes_swapped", "ddp") == [["memory", 2, True, 0]] * 3
    assert _by_rank(restored, "nodes_swapped", "rank") == [["peer", 2, True, 0]] * 3
    assert [r[:3] for r in _by_rank(restored, "nodes_swapped", "dcp")] == [["peer", 2, True]] * 3


def test_storage_when_no_node_holds_the_step(restored: list) -> None:
    assert _by_rank(restored, "only_new_nodes", "ddp") == [["storage", 1, True, 1]] * 2


def test_damaged_or_stale_memory_falls_back_consistently(restored: list) -> None:
    """n0's DDP copy is torn (not listed) and n1 kept only step 1: both take step 2 from n2.
    Rank 1's part of the per-rank step fails to load: every rank goes to storage together."""
    assert _by_rank(restored, "damaged", "ddp") == [
        ["peer", 2, True, 0],
        ["peer", 2, True, 0],
        ["memory", 2, True, 0],
    ]
    assert _by_rank(restored, "damaged", "rank") == [["storage", 1, True, 1]] * 3


def test_a_leader_drops_an_earlier_worlds_segments_once_both_its_buffers_are_newer() -> None:
    """Node nX held rank 3 (an earlier world); now it runs ranks 0 and 1.  Rank 3's segment
    stays while it may hold the last step in memory, and goes once the leader's two buffers
    both hold newer steps; the segment of rank 1 (on this node now) stays."""
    job = f"m{uuid.uuid4().hex[:10]}"

    def checkpointer(rank: int, local_rank: int) -> RankCheckpointer:
        env = WorkerEnv.from_environ(
            {
                "RANK": str(rank),
                "LOCAL_RANK": str(local_rank),
                "WORLD_SIZE": "4",
                "LOCAL_WORLD_SIZE": "2",
                "DLROVER_HPC_JOB_ID": job,
                "DLROVER_HPC_NODE_NAME": "nX",
            }
        )
        return RankCheckpointer("/nonexistent", env=env, link=NullLink(env.prefix))

    def ranks_held() -> list[int]:
        return sorted({int(p.rsplit("-r", 1)[1].split("-")[0]) for p in job_segments(job)})

    try:
        for rank, local_rank in ((3, 1), (1, 1)):
            earlier = checkpointer(rank, local_rank)
            assert earlier.save_checkpoint(1, filled_state(1), storage_type=StorageType.MEMORY)
            earlier.close(remove_segments=False)
        leader = checkpointer(0, 0)
        assert leader.save_checkpoint(2, filled_state(2), storage_type=StorageType.MEMORY)
        leader.engine.wait_prepared()
        assert ranks_held() == [0, 1, 3]
        assert leader.save_checkpoint(3, filled_state(3), storage_type=StorageType.MEMORY)
        assert ranks_held() == [0, 1]
        leader.close(remove_segments=False)
    finally:
        remove_job_segments(job)
