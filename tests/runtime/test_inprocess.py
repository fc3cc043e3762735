"""In-process recovery (issue 26) on the real local Slurm: the surviving workers keep their
processes through a worker killed on another node, a node lost and a replacement node joining;
only the failed and the new nodes start processes; every step is trained, restored from memory."""

from __future__ import annotations

import collections
import itertools
import json
import math
import subprocess
from pathlib import Path

import pytest
from runtime_helpers import TRAIN, events, named, sbatch, timing_log, wait_job

from dlrover_hpc.localslurm import LocalSlurm, wait_for

pytestmark = pytest.mark.slurm
FLASH = TRAIN.parent / "train_flash_ckpt.py"
STEPS = 300


def _rounds(evs: list[dict]) -> dict[int, dict[str, dict]]:
    """round -> node -> its workers_started event."""
    out: dict[int, dict[str, dict]] = collections.defaultdict(dict)
    for e in named(evs, "workers_started"):
        out[e["round"]][e["node"]] = e
    return out


def test_survivors_keep_their_processes_through_a_worker_kill_and_a_node_loss(
    local_slurm: LocalSlurm, shared_tmp: Path
) -> None:
    work = shared_tmp
    (work / "ckpt").mkdir()
    job = sbatch(
        work,
        3,
        "--nnodes=2:3",
        "--nproc-per-node=2",
        "--max-restarts=3",
        str(FLASH),
        "--inprocess",
        f"--steps={STEPS}",
        f"--ckpt-dir={work / 'ckpt'}",
        "--save-every=1",
        "--persist-every=40",
        "--step-time=0.05",
        "--fail-at-step=40",
        "--fail-rank=3",
        f"--result={work / 'result.json'}",
        f"--timing-log={work / 'timing.log'}",
    )
    job_dir = work / ".dlrover-hpc" / job
    try:
        wait_for(
            lambda: any(s >= 60 for _, s in timing_log(work)),
            timeout_s=240,
            what="training past the worker kill at step 40",
        )
        local_slurm.kill_node("node3")  # its agent and workers, as if it lost power
        fields = wait_job(job, timeout_s=420)
    finally:
        subprocess.run(["scancel", job], check=False, timeout=30)  # a no-op once it ended
        local_slurm.restart_node("node3")
    out = (work / f"slurm-{job}.out").read_text()
    assert fields["JobState"] == "COMPLETED", out[-4000:]
    evs = events(job_dir)

    # The killed worker; and the kept workers whose collectives lost a peer, reported by
    # their agents so that the round re-forms without waiting for the lost node's grace.
    [failed] = [e for e in named(evs, "worker_failed") if e["signal"] is not None]
    assert failed["rank"] == 3 and failed["signal"] == "SIGKILL", failed
    peers = [e for e in named(evs, "worker_failed") if e["signal"] is None]
    assert peers and all(e["classification"] == "peer" for e in peers), peers
    assert [e["node"] for e in named(evs, "node_lost")] == ["node3"]
    rounds = _rounds(evs)
    order = sorted(rounds)
    # start, the kill, the loss; and a replacement node joining (Slurm gives node4), if it
    # came before the end
    assert len(order) in (3, 4), {r: sorted(n) for r, n in rounds.items()}
    first, after_kill, after_loss = (rounds[r] for r in order[:3])
    assert set(first) == set(after_kill) == {"node1", "node2", "node3"}
    assert set(after_loss) == {"node1", "node2"}
    # The replacement's round may come just as the training ends: the survivors' workers have
    # exited (their work done) and new ones start, restore the last step and end at once.
    timing = timing_log(work)
    ended = min((t for t, s in timing if s == STEPS), default=math.inf)
    for before, now in itertools.pairwise(order):
        for node, started in rounds[now].items():
            if node not in rounds[before] or (now == order[1] and node == failed["node"]):
                # new, or the failed worker's node: new processes
                assert not started["in_process"], started
                assert node not in rounds[before] or started["pids"] != rounds[before][node]["pids"]
            elif now == order[-1] and started["time"] > ended:
                assert len(order) == 4, (now, started)  # only the replacement's round
            else:  # a survivor keeps its processes
                # (when not: the agent's log says why, e.g. "did not leave ... in-process")
                why = [ln for ln in out.splitlines() if "in-process" in ln and node in ln]
                assert started["in_process"], (now, started, why[-6:])
                assert started["pids"] == rounds[before][node]["pids"], (now, node)
    if len(order) == 4:
        assert set(rounds[order[3]]) == {"node1", "node2", "node4"}
        # It waited for the next step every rank saved: the restart that took it in redid none.
        [admitted] = named(evs, "node_admitted")
        assert admitted["node"] == "node4" and admitted["deferred"] is True, admitted
    assert "in-process restart" in out, out[-4000:]

    # Every step trained; a restart goes back to the newest step in memory (saved every step).
    # Rank 0 logs a step after its collectives: when a peer is lost, a rank whose all-reduce
    # completed may save a step that rank 0's did not; the round restores that step (its
    # state is the whole world's), so rank 0 never logs it. Such a step is a restored one.
    steps = [s for _, s in timing]
    later = [e for e in named(evs, "checkpoint_restored") if e["time"] > failed["time"]]
    unlogged = set(range(1, STEPS + 1)) - set(steps)
    assert unlogged <= {e["step"] for e in later}, (sorted(unlogged), later)
    redone = len(steps) - len(set(steps))
    assert redone <= 2 * 3, (redone, steps)  # at most a step or two per restart, two restarts
    ranks = sum(2 * len(rounds[r]) for r in order[1:])
    assert len(later) == ranks, later  # every rank of every later round restored once
    assert all(e["source"] in ("memory", "peer") and e["step"] > 0 for e in later), later
    stalls = sorted((b[0] - a[0], a[1]) for a, b in itertools.pairwise(timing))
    print("rank 0's longest steps (s, step before):", stalls[-4:])
    result = json.loads((work / "result.json").read_text())
    assert result["final_step"] == STEPS and result["committed"], result
