"""A node's checkpoint survives the node (issue 17) on the real local Slurm: sharded state
(every rank its own part) with ``replica_count=1`` is copied to a peer node's memory; when a
node dies, the spare that takes its place restores its ranks' parts from that peer, and no
rank reads storage.  Nothing is ever persisted here: a restore from storage would start over."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from runtime_helpers import TRAIN, events, named, sbatch, wait_job

from dlrover_hpc.localslurm import LocalSlurm, wait_for

pytestmark = pytest.mark.slurm
FLASH = TRAIN.parent / "train_flash_ckpt.py"
STEPS = 60
STALL = 20


def test_a_killed_nodes_parts_come_back_from_a_peers_memory(
    local_slurm: LocalSlurm, shared_tmp: Path
) -> None:
    work = shared_tmp
    (work / "ckpt").mkdir()
    job = sbatch(
        work,
        3,
        "--nnodes=2:2",
        "--nproc-per-node=1",
        str(FLASH),
        "--sharded",
        "--replicas=1",
        f"--steps={STEPS}",
        f"--ckpt-dir={work / 'ckpt'}",
        "--save-every=1",
        "--persist-every=100000",  # memory only until the end: storage holds nothing to restore
        "--step-time=0.1",
        f"--stall-at-step={STALL}",  # rank 1 stops here after its save: the node to kill
        "--fail-rank=1",
        f"--timing-log={work / 'timing.log'}",
        f"--result={work / 'result.json'}",
    )
    job_dir = work / ".dlrover-hpc" / job
    victim = ""
    try:

        def copied() -> dict | None:
            """Rank 1's part of the stall step, copied to a peer's memory."""
            evs = events(job_dir)
            first = named(evs, "rendezvous_complete")
            if not first:
                return None
            owner = first[0]["nodes"][1]
            return next(
                (
                    e
                    for e in named(evs, "checkpoint_replicated")
                    if e["node"] == owner and e["step"] == STALL
                ),
                None,
            )

        replicated = wait_for(copied, timeout_s=120, what="rank 1's part of the stall step copied")
        victim = replicated["node"]
        assert victim != "node1"  # node1 hosts the master
        local_slurm.kill_node(victim)
        fields = wait_job(job, timeout_s=240)
    finally:
        if victim:
            local_slurm.restart_node(victim)
    out = (work / f"slurm-{job}.out").read_text()
    assert fields["JobState"] == "COMPLETED", out[-4000:]
    evs = events(job_dir)
    assert [e["node"] for e in named(evs, "node_lost")] == [victim]
    rounds = named(evs, "rendezvous_complete")
    assert len(rounds) == 2 and victim not in rounds[1]["nodes"]
    spare = named(evs, "node_admitted")[0]["node"]
    # Every rank restored the step the dead node saved last, from memory or the peer's copy.
    restored = named(evs, "checkpoint_restored")
    assert {(e["rank"], e["step"]) for e in restored} == {(0, STALL), (1, STALL)}, restored
    # Ranks may move between nodes when the world re-forms (the spare can take rank 0): the
    # spare holds no part of the old world, so it receives one from a peer; the surviving
    # node restores from its own segment or the copy it kept of the dead node's part.
    sources = {e["node"]: e["source"] for e in restored}
    assert sources[spare] == "peer" and set(sources.values()) <= {"memory", "peer"}, restored
    result = json.loads((work / "result.json").read_text())
    assert result["start_step"] == STALL and result["final_step"] == STEPS  # 0 lost steps
    # What it cost: the bytes each copy sent, and that copies went to the other node.
    copies = named(evs, "checkpoint_replicated")
    assert copies and all(e["bytes"] > 0 and len(e["peers"]) == 1 for e in copies)
