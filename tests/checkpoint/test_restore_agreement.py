"""The restore decision, pure and table-driven; then two real ranks (gloo) falling back
together.

The table: which step, from where, and who sends which rank its part (`plan_restore`), after
the membership changes of issue 12 (a node lost, a new node, ranks moved between nodes).

The processes: one rank's shared memory is lost (segments removed) or unreadable (its meta no
longer matches the model: the read fails before, or inside, DCP's collectives).  Every rank
must then load the same step from storage, nobody hangs, and the job goes on saving and
restoring from memory again.  (Membership changes with real processes:
test_membership_restore.py.)
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import textwrap
import uuid
from pathlib import Path

import pytest
from harness.ports import free_port
from warm_python import WarmPython

from dlrover_hpc.checkpoint.testing import remove_job_segments
from dlrover_hpc.checkpoint.trainer.restore_agreement import (
    Choice,
    Holdings,
    Part,
    Source,
    plan_restore,
)

pytestmark = pytest.mark.timeout(180)
REPO = Path(__file__).resolve().parents[2]


def _part(step: int, part: int = 0, parts: int = 1, save: int = 7) -> Part:
    return Part(step=step, token=save, part=part, parts=parts, nbytes=100 + part)


_COPIES = itertools.count(1)


def _rank(
    *memory: Part, committed: int = 5, need: tuple[int, int] = (0, 1), token: int = 7
) -> Holdings:
    """A rank's holdings; each copy of a part has its own size, as in real segments (their
    meta differs: pid, time), so a transfer must carry its sender's size."""
    copies = tuple(dataclasses.replace(p, nbytes=p.nbytes + 1000 * next(_COPIES)) for p in memory)
    return Holdings(memory=copies, newest_committed=committed, token=token, need=need)


def _sharded(world: int, *held: tuple[Part, ...], committed: int = 5) -> list[Holdings]:
    """Rank r of `world` needs part r of `world` and holds `held[r]`."""
    return [_rank(*parts, committed=committed, need=(r, world)) for r, parts in enumerate(held)]


M, P, S, N = Source.MEMORY, Source.PEER, Source.STORAGE, Source.NONE
DDP_10 = _part(10)

#: (label, every rank's holdings, (each rank's source, step, save), transfers (src, dst, part))
PLANS = [
    # replicated (DDP) state: one copy anywhere serves every rank
    ("ddp_unchanged", [_rank(DDP_10), _rank(DDP_10)], ([M, M], 10, 7), []),
    ("ddp_new_node", [_rank(DDP_10), _rank()], ([M, P], 10, 7), [(0, 1, 0)]),
    (
        "ddp_new_node_with_2_ranks_draws_on_both_holders",
        [_rank(DDP_10), _rank(DDP_10), _rank(), _rank()],
        ([M, M, P, P], 10, 7),
        [(0, 2, 0), (1, 3, 0)],
    ),
    (  # a newer step from a peer beats an older one every rank holds
        "ddp_one_node_lost_its_newest_buffer",
        [_rank(_part(9), DDP_10), _rank(_part(9))],
        ([M, P], 10, 7),
        [(0, 1, 0)],
    ),
    ("ddp_memory_as_new_as_storage", [_rank(DDP_10, committed=10)], ([M], 10, 7), []),
    ("ddp_storage_is_newer", [_rank(DDP_10, committed=12), _rank()], ([S, S], 5, -1), []),
    ("ddp_nobody_holds_it", [_rank(), _rank(committed=4)], ([S, S], 4, -1), []),
    ("nothing_anywhere", [_rank(committed=-1), _rank(committed=-1)], ([N, N], -1, -1), []),
    (  # two saves of step 10 (a rollback saved it again): one of them, never both
        "ddp_two_saves_of_one_step",
        [_rank(_part(10, save=7)), _rank(_part(10, save=8))],
        ([P, M], 10, 8),
        [(1, 0, 0)],
    ),
    # sharded state: every rank's part must survive, in a world of the size that saved it
    (
        "sharded_unchanged",
        _sharded(2, (_part(10, 0, 2),), (_part(10, 1, 2),)),
        ([M, M], 10, 7),
        [],
    ),
    (
        "sharded_nodes_swapped_ranks",
        _sharded(2, (_part(10, 1, 2),), (_part(10, 0, 2),)),
        ([P, P], 10, 7),
        [(1, 0, 0), (0, 1, 1)],
    ),
    (  # a node holds an earlier world's part besides its own; a new node lacks its part
        "sharded_new_node_gets_its_part_from_the_node_that_kept_it",
        _sharded(3, (_part(10, 0, 3), _part(10, 2, 3)), (_part(10, 1, 3),), ()),
        ([M, M, P], 10, 7),
        [(0, 2, 2)],
    ),
    ("sharded_part_lost_with_its_node", _sharded(2, (_part(10, 0, 2),), ()), ([S, S], 5, -1), []),
    (
        "sharded_world_shrank_3_to_2",
        _sharded(2, (_part(10, 0, 3),), (_part(10, 1, 3),)),
        ([S, S], 5, -1),
        [],
    ),
    (
        "sharded_one_rank_lacks_the_newest_step",
        _sharded(2, (_part(9, 0, 2), _part(10, 0, 2)), (_part(9, 1, 2),)),
        ([M, M], 9, 7),
        [],
    ),
    (
        "sharded_parts_of_two_saves_never_mix",
        _sharded(2, (_part(10, 0, 2, save=7),), (_part(10, 1, 2, save=8),)),
        ([S, S], 5, -1),
        [],
    ),
]


@pytest.mark.parametrize(
    ("ranks", "expected", "transfers"),
    [pytest.param(ranks, expected, sends, id=label) for label, ranks, expected, sends in PLANS],
)
def test_plan_restore_after_membership_changes(
    ranks: list[Holdings],
    expected: tuple[list[Source], int, int],
    transfers: list[tuple[int, int, int]],
) -> None:
    sources, step, save = expected
    choice = plan_restore(ranks)
    assert [choice.source_of(r) for r in range(len(ranks))] == sources
    assert (choice.step, choice.save) == (step, save)
    assert [(t.src, t.dst, t.part) for t in choice.transfers] == transfers
    for t in choice.transfers:  # the sender holds exactly what the receiver needs
        held = {p.key: p for p in ranks[t.src].memory}[(step, save, t.part, t.parts)]
        assert (t.part, t.parts) == ranks[t.dst].need and t.nbytes == held.nbytes
    assert choice.storage_step == min(h.newest_committed for h in ranks)
    # every rank computes the same plan from the same gathered values
    assert plan_restore([Holdings.decode(h.encode()) for h in ranks]) == choice


def test_holdings_travel_as_integers_padded_to_the_longest() -> None:
    held = _rank(_part(4, save=1 << 55), _part(6, 1, 3, save=3), committed=2, need=(1, 3))
    assert Holdings.decode(held.encode()) == held
    assert Holdings.decode([*_rank().encode(), -1, -1, -1, -1, -1]) == _rank()
    assert plan_restore([_rank(committed=1, token=3), _rank(committed=1, token=9)]) == Choice(
        source=Source.STORAGE, step=1, token=9, storage_step=1
    )


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


def _run_two_ranks(
    tmp_path: Path, warm_python: WarmPython, body: str, *, own_nodes: bool
) -> list[list[list[object]]]:
    """Runs `body` on two gloo ranks (each its own node when `own_nodes`); returns what each
    rank restored, after checking that both restored the same steps."""
    job = f"a{uuid.uuid4().hex[:10]}"
    script = tmp_path / "rank.py"
    text = PREAMBLE.format(repo=str(REPO), root=str(tmp_path)) + body.format()
    script.write_text(textwrap.dedent(text))
    port = str(free_port())
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
            subprocess.Popen(warm_python([str(script)]), env=env, stderr=subprocess.PIPE, text=True)
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
    steps = [[(label, restored[0]) for label, restored, _ in out] for out in outs]
    assert steps[0] == steps[1], f"the ranks restored different steps: {outs}"
    return outs


def test_fsdp_ranks_fall_back_to_storage_together(tmp_path: Path, warm_python: WarmPython) -> None:
    pytest.importorskip("numpy", reason="multi-rank torch.distributed.checkpoint needs numpy")
    expected = [
        ["one_rank_lost_memory", [3, "storage"], True],  # its part is nowhere else
        ["memory_again", [4, "memory"], True],
        ["unreadable_before_dcp", [3, "storage"], True],
        ["unreadable_inside_dcp", [3, "storage"], True],
        ["job_goes_on", [6, "memory"], True],
    ]
    assert _run_two_ranks(tmp_path, warm_python, FSDP_SCRIPT, own_nodes=False) == [
        expected,
        expected,
    ]


def test_ddp_nodes_fall_back_together_or_take_a_peers_copy(
    tmp_path: Path, warm_python: WarmPython
) -> None:
    """A copy that fails to load sends every rank to storage; a lost copy is replaced by the
    other node's (the state is replicated), sent over the process group."""
    rank0, rank1 = _run_two_ranks(tmp_path, warm_python, DDP_SCRIPT, own_nodes=True)
    assert rank0 == [
        ["unreadable_on_one_node", [2, "storage"], True],
        ["one_node_lost_memory", [2, "memory"], True],
        ["memory_again", [3, "memory"], True],
    ]
    assert rank1 == [
        ["unreadable_on_one_node", [2, "storage"], True],
        ["one_node_lost_memory", [2, "peer"], True],
        ["memory_again", [3, "memory"], True],
    ]


# ------------------------------------------------------------------ one rank rejects a step
REJECT_PREAMBLE = """
from dlrover_hpc.checkpoint.event_sinks import ListEventSink
events = ListEventSink()

def rejected():
    rows = [[e["step"], e["source"], e["why"], e["next_step"], e["rank"]]
            for e in events.named("restore_rejected")]
    with open(root + f"/rejected{{rank}}.json", "w") as f:
        json.dump(rows, f)
"""

DDP_REJECT_SCRIPT = (
    REJECT_PREAMBLE
    + """
def state(step, poison=False):
    w = torch.full((16,), float(step))
    if poison:
        w[3] = float("nan")
    return {{"w": w, "step": step}}

def restore(label):
    got = ck.load_checkpoint(state_dict=state(0))
    step = ck.last_restored[0]
    ok = got["step"] == step and bool((got["w"] == float(step)).all())
    out.append([label, ck.last_restored, ok])

ck = DdpCheckpointer(root + "/ddp", events=events)  # each rank is the leader of its own node
for s in (1, 2):
    assert ck.save_checkpoint(s, state(s), storage_type=StorageType.DISK)
assert ck.wait_latest_checkpoint(60)
# step 3: rank 1's node holds a NaN, rank 0's (the persisted copy) does not
assert ck.save_checkpoint(3, state(3, poison=rank == 1), storage_type=StorageType.DISK)
assert ck.wait_latest_checkpoint(60)
restore("nan_on_one_node")
ck.close()
rejected()
finish()
"""
)

FSDP_REJECT_SCRIPT = (
    REJECT_PREAMBLE
    + FSDP_SCRIPT[: FSDP_SCRIPT.index("ck = FsdpShardCheckpointer")]
    + """
ck = FsdpShardCheckpointer(root + "/fsdp", events=events)
for s in (1, 2):
    assert ck.save_checkpoint(s, make(s), storage_type=StorageType.DISK)
assert ck.wait_latest_checkpoint(60)
bad = make(3)
if rank == 1:  # only rank 1's shard of step 3 holds an infinity
    bad["w"].to_local()[0, 0] = float("inf")
assert ck.save_checkpoint(3, bad, storage_type=StorageType.DISK)
assert ck.wait_latest_checkpoint(60)
restore("inf_in_one_shard")
ck.close()
rejected()
finish()
"""
)


def _rejected(tmp_path: Path) -> list[list[list[object]]]:
    return [json.loads((tmp_path / f"rejected{r}.json").read_text()) for r in range(2)]


def test_a_step_one_node_rejects_sends_every_rank_to_the_older_step(
    tmp_path: Path, warm_python: WarmPython
) -> None:
    """Rank 0's copy of step 3 is fine, rank 1's holds a NaN: neither trains on step 3; both
    restore step 2 from their node's second buffer, and rank 1 reports why."""
    outs = _run_two_ranks(tmp_path, warm_python, DDP_REJECT_SCRIPT, own_nodes=True)
    assert outs == [[["nan_on_one_node", [2, "memory"], True]]] * 2
    assert _rejected(tmp_path) == [
        [],
        [[3, "memory", "non-finite values in w (1 of 16: nan)", 2, 1]],
    ]


def test_a_shard_one_rank_rejects_sends_every_rank_to_the_older_step(
    tmp_path: Path, warm_python: WarmPython
) -> None:
    pytest.importorskip("numpy", reason="multi-rank torch.distributed.checkpoint needs numpy")
    outs = _run_two_ranks(tmp_path, warm_python, FSDP_REJECT_SCRIPT, own_nodes=False)
    assert outs == [[["inf_in_one_shard", [2, "memory"], True]]] * 2
    assert _rejected(tmp_path) == [
        [],
        [[3, "memory", "non-finite values in w (1 of 32: inf)", 2, 1]],
    ]
