"""The master and agents on the real local Slurm: DDP jobs, killed workers and nodes, spares."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from runtime_helpers import TRAIN, events, job_fields, named, sbatch, wait_job, wait_training

from dlrover_hpc.localslurm import LocalSlurm, wait_for
from dlrover_hpc.slurm.commands import show_node
from dlrover_hpc.slurm.parse import node_state

pytestmark = pytest.mark.slurm


def _train_args(work: Path, *, steps: int, extra: tuple[str, ...] = ()) -> list[str]:
    (work / "ckpt").mkdir(exist_ok=True)
    return [
        str(TRAIN),
        f"--steps={steps}",
        f"--ckpt-dir={work / 'ckpt'}",
        "--ckpt-every=5",
        f"--result={work / 'result.json'}",
        f"--rank-log={work / 'ranks'}",
        *extra,
    ]


def _job_dir(work: Path, job: str) -> Path:
    return work / ".dlrover-hpc" / job


def _last_round_nodes(evs: list[dict]) -> list[str]:
    return named(evs, "rendezvous_complete")[-1]["nodes"]


def test_four_node_job_survives_killed_worker_and_ranks_follow_topology(
    local_slurm: LocalSlurm, shared_tmp: Path
) -> None:
    # A topology whose order differs from Slurm's node order: node1,node3 | node2,node4.
    topo = shared_tmp / "cross.conf"
    topo.write_text(
        "SwitchName=leafA Nodes=node[1,3]\nSwitchName=leafB Nodes=node[2,4]\n"
        "SwitchName=spine Switches=leafA,leafB\n"
    )
    job = sbatch(
        shared_tmp,
        4,
        "--nnodes=4:4",
        "--nproc-per-node=2",
        "--max-restarts=2",
        "--network-check",
        *_train_args(shared_tmp, steps=30, extra=("--fail-at-step=12", "--fail-rank=5")),
        # A generous check timeout: at the start each node's probe waits for the node's
        # pre-warmed interpreter (`import torch`), which took ~40 s with tests side by side on
        # a busy 2-core machine, and the default 30 s then failed the first check round.
        master_opts=f"--topology={topo} --netcheck-timeout=90",
    )
    fields = wait_job(job, timeout_s=240)
    out = (shared_tmp / f"slurm-{job}.out").read_text()
    assert fields["JobState"] == "COMPLETED", out[-4000:]
    assert json.loads((shared_tmp / "result.json").read_text()) == {
        "final_step": 30,
        "world_size": 8,
        "restart_count": 1,
        "group_world_size": 4,
    }
    evs = events(_job_dir(shared_tmp, job))
    assert _last_round_nodes(evs) == ["node1", "node3", "node2", "node4"]
    # The killed rank is reported; its peers on other nodes fail too (their collective lost
    # it) and may be heard first, but the restart budget is charged once.
    failed = named(evs, "worker_failed")
    assert any(e["rank"] == 5 and e["signal"] == "SIGKILL" for e in failed), failed
    assert [e["restart_count"] for e in named(evs, "workers_restarted")] == [1]
    assert named(evs, "job_finished")[-1]["exit_code"] == 0
    # A healthy network check ran before the start and again before the restart.  On this
    # busy 2-core machine a first round may time one node at 2x the median (a straggler
    # suspect, seen in CI with the framework matrix alongside); the check's second round
    # re-times it and must clear it: the final verdicts name no node.
    results = named(evs, "netcheck_result")
    checks = [e for e in results if e["final"]]
    assert [c["generation"] for c in checks] == [1, 2], checks
    assert all(c["faulty"] == c["stragglers"] == c["unresolved"] == [] for c in checks), checks
    assert all(c["round"] <= 2 and len(c["timings"]) == 4 for c in checks), json.dumps(checks)
    assert all(e["faulty"] == [] for e in results), json.dumps(results)
    # Every worker's GROUP_RANK follows the topology, before and after the restart.
    for restart in (0, 1):
        for rank in range(8):
            placed = json.loads(
                (shared_tmp / "ranks" / f"restart{restart}-rank{rank}.json").read_text()
            )
            expected_node = ["node1", "node3", "node2", "node4"][rank // 2]
            assert (placed["host"], placed["group_rank"]) == (expected_node, rank // 2)


def test_killed_node_job_finishes_on_three_and_spends_no_restart(
    local_slurm: LocalSlurm, shared_tmp: Path
) -> None:
    """A membership change is free: the survivors' workers fail with "connection closed by
    peer" before the node is seen lost; none of that may spend --max-restarts (0 here)."""
    job = sbatch(
        shared_tmp,
        4,
        "--nnodes=3:4",
        "--nproc-per-node=1",
        "--max-restarts=0",
        *_train_args(shared_tmp, steps=60, extra=("--step-time=0.1",)),
    )
    try:
        wait_training(shared_tmp, job, 8)
        local_slurm.kill_node("node4")  # its slurmd, agent and workers, as if it lost power
        fields = wait_job(job, timeout_s=240)
    finally:
        local_slurm.restart_node("node4")
    out = (shared_tmp / f"slurm-{job}.out").read_text()
    assert fields["JobState"] == "COMPLETED", out[-4000:]
    evs = events(_job_dir(shared_tmp, job))
    assert [e["node"] for e in named(evs, "node_lost")] == ["node4"]
    assert {e["classification"] for e in named(evs, "worker_failed")} <= {"peer"}, out[-3000:]
    assert sorted(_last_round_nodes(evs)) == ["node1", "node2", "node3"]
    result = json.loads((shared_tmp / "result.json").read_text())
    assert result["final_step"] == 60 and result["group_world_size"] == 3
    finished = named(evs, "job_finished")[-1]
    assert finished["exit_code"] == 0 and finished["restart_count"] == 0


def test_hot_spare_replaces_killed_node(local_slurm: LocalSlurm, shared_tmp: Path) -> None:
    job = sbatch(
        shared_tmp,
        4,
        "--nnodes=3:3",
        "--nproc-per-node=1",
        *_train_args(shared_tmp, steps=60, extra=("--step-time=0.1",)),
    )
    jd = _job_dir(shared_tmp, job)
    try:
        wait_training(shared_tmp, job, 8)
        first = _last_round_nodes(events(jd))
        assert len(first) == 3
        spare = ({"node1", "node2", "node3", "node4"} - set(first)).pop()
        victim = next(n for n in reversed(first) if n != "node1")  # node1 hosts the master
        local_slurm.kill_node(victim)
        fields = wait_job(job, timeout_s=240)
    finally:
        local_slurm.restart_node(victim)
    out = (shared_tmp / f"slurm-{job}.out").read_text()
    assert fields["JobState"] == "COMPLETED", out[-4000:]
    evs = events(jd)
    assert [e["node"] for e in named(evs, "node_admitted")] == [spare]
    last = _last_round_nodes(evs)
    assert len(last) == 3 and spare in last and victim not in last
    assert json.loads((shared_tmp / "result.json").read_text())["group_world_size"] == 3


def test_hardware_fault_drains_the_node_and_training_goes_on(
    local_slurm: LocalSlurm, shared_tmp: Path
) -> None:
    job = sbatch(
        shared_tmp,
        4,
        "--nnodes=3:4",
        "--nproc-per-node=1",
        *_train_args(
            shared_tmp, steps=30, extra=("--fail-at-step=8", "--fail-rank=2", "--fail-mode=xid")
        ),
    )
    fields = wait_job(job, timeout_s=240)
    out = (shared_tmp / f"slurm-{job}.out").read_text()
    evs = events(_job_dir(shared_tmp, job))
    failed = named(evs, "worker_failed")
    try:
        assert fields["JobState"] == "COMPLETED", out[-4000:]
        hardware = [e for e in failed if e["classification"] == "hardware"]
        assert len(hardware) == 1, failed  # the Xid rank; its peers fail as software
        assert hardware[0]["rank"] == 2 and "Xid" in hardware[0]["reason"]
        bad = hardware[0]["node"]
        assert [e["node"] for e in named(evs, "node_drained")] == [bad]
        assert bad not in _last_round_nodes(evs) and len(_last_round_nodes(evs)) == 3
        node = show_node(bad)
        assert "DRAIN" in node_state(node)[1]
        assert node["Reason"].startswith("dlrover-hpc: hardware fault on rank 2")
        assert f"job {job}" in node["Reason"]
    finally:
        for e in failed:
            subprocess.run(
                ["scontrol", "update", f"nodename={e['node']}", "state=resume"], timeout=10
            )


def test_network_check_finds_cut_and_slow_links(local_slurm: LocalSlurm, shared_tmp: Path) -> None:
    """node4's fabric link is cut, node3's is slow; the control network works for both.

    Workers and probes use the fabric (GLOO_SOCKET_IFNAME=eth1), as NCCL would use InfiniBand.
    """
    local_slurm.slow_link("node3", rate="50mbit", net="data")
    local_slurm.cut_link("node4", net="data")
    try:
        job = sbatch(
            shared_tmp,
            4,
            "--nnodes=2:4",
            "--nproc-per-node=1",
            "--network-check",
            "--exclude-straggler",
            *_train_args(shared_tmp, steps=10),
            # Generous: a probe starts a fresh interpreter (`import torch`), which took most of
            # 15 s on a loaded machine and turned the slow node3 into a faulty one.
            master_opts="--netcheck-timeout=40",
            env={"GLOO_SOCKET_IFNAME": "eth1"},
        )
        fields = wait_job(job, timeout_s=240)
    finally:
        local_slurm.heal_link("node4", net="data")
        local_slurm.unslow_link("node3", net="data")
    out = (shared_tmp / f"slurm-{job}.out").read_text()
    evs = events(_job_dir(shared_tmp, job))
    try:
        assert fields["JobState"] == "COMPLETED", out[-4000:]
        checks = named(evs, "netcheck_result")
        assert checks and checks[-1]["final"], out[-3000:]
        # The cut link is pinned down in at most two rounds; a third may re-time a straggler.
        found = next(e for e in checks if "node4" in e["faulty"])
        assert found["round"] <= 2 and found["faulty"] == ["node4"], checks
        last = checks[-1]
        assert last["faulty"] == ["node4"] and last["stragglers"] == ["node3"], last
        assert set(last["timings"]) >= {"node1", "node2", "node3"}
        assert last["timings"]["node3"] > 2 * last["median_s"]
        assert sorted(e["node"] for e in named(evs, "node_drained")) == ["node3", "node4"]
        assert sorted(_last_round_nodes(evs)) == ["node1", "node2"]
        assert "DRAIN" in node_state(show_node("node4"))[1]
        assert show_node("node4")["Reason"].startswith("dlrover-hpc: faulty in the network check")
    finally:
        # Every node, not only the two expected: a wrong verdict must not leave a node drained
        # for the next test on this cluster.
        for node in local_slurm.config.node_names():
            subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], timeout=10)


def test_replacement_job_joins_when_no_spare_is_left(
    local_slurm: LocalSlurm, shared_tmp: Path
) -> None:
    job = sbatch(
        shared_tmp,
        3,
        "--nnodes=2:3",
        "--nproc-per-node=1",
        # 250 steps (25 s): the replacement must join before the training ends. With 80 the
        # job once finished 5.6 s after the node was lost, before the replacement (7 s) came.
        *_train_args(shared_tmp, steps=250, extra=("--step-time=0.1",)),
        extra=("-w", "node[1-3]"),
    )
    try:
        wait_training(shared_tmp, job, 8)
        local_slurm.kill_node("node3")
        fields = wait_job(job, timeout_s=240)
    finally:
        local_slurm.restart_node("node3")
    jd = _job_dir(shared_tmp, job)
    out = (shared_tmp / f"slurm-{job}.out").read_text()
    evs = events(jd)
    assert fields["JobState"] == "COMPLETED", out[-4000:]
    requested = named(evs, "replacement_requested")
    assert len(requested) == 1 and requested[0]["count"] == 1, requested
    # Only the nodes the job holds now (squeue) and faulty ones: node3 is down, no longer the
    # job's and not faulty, so Slurm is left free to choose (issue 12: avoiding every node ever
    # held made requests unsatisfiable).
    assert requested[0]["exclude"] == ["node1", "node2"]
    assert [e["node"] for e in named(evs, "node_admitted")] == ["node4"]
    assert sorted(_last_round_nodes(evs)) == ["node1", "node2", "node4"]
    assert json.loads((shared_tmp / "result.json").read_text())["group_world_size"] == 3
    repl = requested[0]["job"]
    ended = wait_for(lambda: wait_job(repl, timeout_s=60), timeout_s=61, what="replacement job end")
    # Slurm never requeues a replacement (a requeued one came back 120 s later and drained
    # its own node with "Duplicate jobid"): the master asks for another itself.
    assert ended["Requeue"] == "0", ended


def test_requeue_when_below_min_nodes_resumes_from_checkpoint(
    local_slurm: LocalSlurm, shared_tmp: Path
) -> None:
    timing = shared_tmp / "timing.txt"
    job = sbatch(
        shared_tmp,
        3,
        "--nnodes=3:3",
        "--nproc-per-node=1",
        *_train_args(shared_tmp, steps=60, extra=("--step-time=0.1", f"--timing-log={timing}")),
        extra=("-w", "node[1-3]"),
        master_opts="--replacement-sbatch=off --min-nodes-timeout=2",
    )
    try:
        wait_training(shared_tmp, job, 12)
        local_slurm.kill_node("node3")
        wait_for(
            lambda: any(e["event"] == "job_requeued" for e in events(_job_dir(shared_tmp, job))),
            timeout_s=90,
            what="the requeue",
        )
        local_slurm.restart_node("node3")
        # Slurm holds a requeued job ~120 s; the requeue ended the master, so lift the hold
        # from here as an impatient user would (the resume itself is what is under test).
        wait_for(
            lambda: job_fields(job).get("JobState") == "PENDING",
            timeout_s=60,
            what="the requeued job to pend",
        )
        subprocess.run(
            ["scontrol", "update", f"JobId={job}", "StartTime=now"], timeout=10, check=True
        )
        fields = wait_job(job, timeout_s=300)
    finally:
        if "node3" not in local_slurm.slurmd_pids():
            local_slurm.restart_node("node3")
    evs = events(_job_dir(shared_tmp, job))
    out = (shared_tmp / f"slurm-{job}.out").read_text()
    assert fields["JobState"] == "COMPLETED", out[-4000:]
    assert fields["Restarts"] == "1"
    assert len(named(evs, "job_started")) == 2  # the requeued run's master resumed
    result = json.loads((shared_tmp / "result.json").read_text())
    assert result["final_step"] == 60
    assert named(evs, "job_finished")[-1]["exit_code"] == 0
    # The requeued run resumed from the persisted checkpoint (step 10 or later), not step 1.
    # Its first step is the first one logged after its master started; when the first run was
    # stopped right after a checkpoint, no step repeats, so the boundary is found by time.
    resumed_at = named(evs, "job_started")[1]["time"]
    lines = [line.split() for line in timing.read_text().splitlines()]
    steps = [int(step) for _, step, _ in lines]
    first = next(int(step) for at, step, _ in lines if float(at) > resumed_at)
    assert first > 10, steps


def test_flash_checkpoint_restores_from_memory_on_every_node(
    local_slurm: LocalSlurm, shared_tmp: Path
) -> None:
    flash = TRAIN.parent / "train_flash_ckpt.py"
    job = sbatch(
        shared_tmp,
        2,
        "--nnodes=2:2",
        "--nproc-per-node=2",
        str(flash),
        "--steps=30",
        f"--ckpt-dir={shared_tmp / 'ck'}",
        "--save-every=2",
        "--persist-every=10",
        "--fail-at-step=15",
        "--fail-rank=3",
        f"--result={shared_tmp / 'result.json'}",
        extra=("-w", "node[1-2]"),
    )
    fields = wait_job(job, timeout_s=240)
    out = (shared_tmp / f"slurm-{job}.out").read_text()
    assert fields["JobState"] == "COMPLETED", out[-4000:]
    summary = json.loads((shared_tmp / "result.json").read_text())
    assert summary["restored"] == [14, "memory"] and summary["final_step"] == 30
    evs = events(_job_dir(shared_tmp, job))
    restored = named(evs, "checkpoint_restored")
    assert sorted((e["rank"], e["source"], e["step"]) for e in restored) == [
        (r, "memory", 14) for r in range(4)
    ]
    assert {e["node"] for e in restored} == {"node1", "node2"}
    committed = [e["step"] for e in named(evs, "checkpoint_persisted") if e["committed"]]
    assert committed[-1] == 30 and 14 in committed
    assert (shared_tmp / "ck" / "dlrover_latest.txt").read_text().strip() == "30"
