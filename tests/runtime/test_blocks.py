"""A block topology on the real local Slurm: ranks, segments and spares follow the blocks.

Slurm 22.05 here has no block plugin: the master reads topology/local-blocks.conf itself
(nvl1 = node1, short of BlockSizes=2; nvl2 = node[2-4]) and --segment 2 makes each round
two nodes of one block. nvl1 can never form a segment, so node1 (a spare too) is never
admitted; when a node of the running segment is killed, nvl2's own spare takes its place.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from runtime_helpers import TRAIN, events, named, sbatch, wait_job, wait_training

from dlrover_hpc import topology as topo
from dlrover_hpc.localslurm import LocalSlurm

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
BLOCKS = REPO / "topology" / "local-blocks.conf"


def test_block_file_drives_ranks_segments_and_spares(
    local_slurm: LocalSlurm, shared_tmp: Path
) -> None:
    block_of = topo.load(BLOCKS).leaf_of()
    (shared_tmp / "ckpt").mkdir()
    job = sbatch(
        shared_tmp,
        4,
        "--nnodes=2:2",
        "--nproc-per-node=1",
        str(TRAIN),
        "--steps=40",
        "--step-time=0.1",
        f"--ckpt-dir={shared_tmp / 'ckpt'}",
        "--ckpt-every=5",
        f"--result={shared_tmp / 'result.json'}",
        f"--rank-log={shared_tmp / 'ranks'}",
        master_opts=f"--topology={BLOCKS} --segment=2",
    )
    jd = shared_tmp / ".dlrover-hpc" / job
    victim = ""
    try:
        wait_training(shared_tmp, job, 8)
        first = named(events(jd), "rendezvous_complete")[-1]
        # Slurm's order would rank node1 first; the blocks put the segment inside nvl2.
        assert first["segment"] == 2 and first["blocks"] == ["nvl2", "nvl2"], first
        assert first["nodes"] == sorted(first["nodes"], key=topo.natural_key)
        assert {block_of[n] for n in first["nodes"]} == {"nvl2"}
        spare = ({"node2", "node3", "node4"} - set(first["nodes"])).pop()
        victim = first["nodes"][-1]
        local_slurm.kill_node(victim)
        fields = wait_job(job, timeout_s=240)
    finally:
        if victim:
            local_slurm.restart_node(victim)
    out = (shared_tmp / f"slurm-{job}.out").read_text()
    assert fields["JobState"] == "COMPLETED", out[-4000:]
    evs = events(jd)
    assert [e["node"] for e in named(evs, "node_lost")] == [victim]
    # The spare of the lost node's block replaces it; node1 (nvl1) also waited, never taken.
    assert [e["node"] for e in named(evs, "node_admitted")] == [spare]
    rounds = named(evs, "rendezvous_complete")
    assert all(r["blocks"] == ["nvl2", "nvl2"] for r in rounds), rounds
    assert all("node1" not in r["nodes"] for r in rounds), rounds
    last = rounds[-1]["nodes"]
    assert sorted(last) == sorted({"node2", "node3", "node4"} - {victim})
    assert last == sorted(last, key=topo.natural_key)
    # Each worker's GROUP_RANK is its node's place in the last round's block order.
    for rank, node in enumerate(last):
        placed = [
            json.loads(p.read_text()) for p in (shared_tmp / "ranks").glob(f"*-rank{rank}.json")
        ]
        assert {"host": node, "group_rank": rank} in [
            {"host": p["host"], "group_rank": p["group_rank"]} for p in placed
        ], placed
    result = json.loads((shared_tmp / "result.json").read_text())
    assert result["final_step"] == 40 and result["group_world_size"] == 2
