"""Pure parsers of Slurm output and environment, on verbatim captured output."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from dlrover_hpc.errors import SlurmError, UsageError
from dlrover_hpc.slurm import commands
from dlrover_hpc.slurm.env import parse_slurm_env
from dlrover_hpc.slurm.hostnames import collect, expand
from dlrover_hpc.slurm.parse import node_state, parse_oneliner, parse_show_nodes, parse_sinfo_nodes

DATA = Path(__file__).parents[1] / "data" / "slurm"


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node1", ["node1"]),
        ("node[1-4]", ["node1", "node2", "node3", "node4"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("gpu-a[001-003,010],gpu-b7", ["gpu-a001", "gpu-a002", "gpu-a003", "gpu-a010", "gpu-b7"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("", []),
    ],
)
def test_expand(text: str, hosts: list[str]) -> None:
    assert expand(text) == hosts


def test_expand_matches_scontrol_show_hostnames() -> None:
    captured = (DATA / "show_hostnames.txt").read_text().split()
    assert expand("gpu-a[001-003,010],gpu-b7") == captured


@pytest.mark.parametrize("bad", ["node[1-", "node[3-1]", "node[a-b]"])
def test_expand_rejects_malformed(bad: str) -> None:
    with pytest.raises(UsageError, match=r"not a valid Slurm host list.*expected e\.g\."):
        expand(bad, source="SLURM_JOB_NODELIST")


def test_collect_round_trip() -> None:
    hosts = ["node1", "node2", "node3", "node7"]
    assert collect(hosts) == "node[1-3,7]"
    assert expand(collect(hosts)) == hosts


def _env_file(name: str) -> dict[str, str]:
    lines = (DATA / name).read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)


def test_parse_step_env_captured_on_node2() -> None:
    env = parse_slurm_env(_env_file("step_env_node2.txt"))
    assert env is not None
    assert env.nodes == ("node1", "node2", "node3", "node4")
    assert env.node_id == 1
    assert env.node_name == "node2"
    assert env.topology_addr == "spine1.leaf1.node2"
    assert env.switch_path == ("spine1", "leaf1")
    assert env.restart_count == 0
    assert env.job_id.isdigit()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"PATH": "/bin"}, None),
        (
            {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_RESTART_COUNT": "2"},
            {"job_id": "7", "nodes": ("n1", "n2"), "restart_count": 2, "node_id": None},
        ),
        (
            {"SLURM_JOBID": "8", "SLURM_NODELIST": "a1", "SLURM_JOB_END_TIME": "1800000000"},
            {"job_id": "8", "nodes": ("a1",), "end_time": 1800000000},
        ),
        (
            {"SLURM_JOB_ID": "9", "SLURM_NODEID": "x"},
            {"job_id": "9", "nodes": (), "node_id": None},
        ),
    ],
)
def test_parse_slurm_env_table(env: dict[str, str], expected: dict | None) -> None:
    parsed = parse_slurm_env(env)
    if expected is None:
        assert parsed is None
        return
    assert parsed is not None
    for key, value in expected.items():
        assert getattr(parsed, key) == value


def test_parse_show_node_idle() -> None:
    fields = parse_oneliner((DATA / "show_node_idle.txt").read_text())
    assert fields["NodeName"] == "node1"
    assert fields["NodeAddr"] == "10.77.0.1"
    assert fields["OS"].startswith("Linux 6.")  # a value with spaces
    assert node_state(fields) == ("IDLE", frozenset())


def test_parse_show_node_drained_reason_with_spaces() -> None:
    fields = parse_oneliner((DATA / "show_node_drained.txt").read_text())
    assert node_state(fields) == ("IDLE", frozenset({"DRAIN"}))
    assert fields["Reason"].startswith("dlrover-hpc: test job 2 [root@")


def test_parse_show_job() -> None:
    fields = parse_oneliner((DATA / "show_job_completed.txt").read_text())
    assert fields["JobState"] == "COMPLETED"
    assert expand(fields["NodeList"]) == ["node1", "node2", "node3", "node4"]
    assert fields["Restarts"] == "0"
    assert fields["AllocNode:Sid"] == "localhost:1102"


def test_parse_sinfo_nodes() -> None:
    assert parse_sinfo_nodes("node1 idle\nnode2 drain\n\nnode3 down*\n") == {
        "node1": "idle",
        "node2": "drain",
        "node3": "down*",
    }


def _runner(returncode: int, stdout: str = "", stderr: str = ""):  # type: ignore[no-untyped-def]
    calls: list[list[str]] = []

    def run(argv, *, timeout_s):  # type: ignore[no-untyped-def]
        calls.append(list(argv))
        return commands.Completed(
            argv=tuple(argv), returncode=returncode, stdout=stdout, stderr=stderr
        )

    return run, calls


def test_drain_refused_gives_admin_command() -> None:
    refused = (DATA / "drain_refused.txt").read_text()
    run, calls = _runner(1, stderr=refused)
    result = commands.drain_node("node3", reason="dlrover-hpc: link down job 12", run=run)
    assert not result.ok
    assert result.error == "slurm_update error: Invalid user id"
    assert result.admin_command == (
        "scontrol update NodeName=node3 State=DRAIN 'Reason=dlrover-hpc: link down job 12'"
    )
    assert calls == [
        [
            "scontrol",
            "update",
            "NodeName=node3",
            "State=DRAIN",
            "Reason=dlrover-hpc: link down job 12",
        ]
    ]


def test_job_nodes_uses_squeue() -> None:
    run, calls = _runner(0, stdout="node[1-2,4]\n")
    assert commands.job_nodes("12", run=run) == ["node1", "node2", "node4"]
    assert calls == [["squeue", "-h", "-j", "12", "-o", "%N"]]


def test_parse_show_node_reason_holding_key_value_words() -> None:
    line = (
        (DATA / "show_node_drained.txt")
        .read_text()
        .replace(
            "Reason=dlrover-hpc: test job 2", "Reason=dlrover-hpc: Xid 79, pid=4242, gpu=0 job 2"
        )
    )
    fields = parse_oneliner(line, free_text_last="Reason")
    assert fields["Reason"].startswith("dlrover-hpc: Xid 79, pid=4242, gpu=0 job 2 [")


def test_node_states_from_captured_sinfo() -> None:
    """``sinfo -h -N -o "%N %t"`` with node3 drained and node4 set down, then just after both
    were resumed (``*``: not responding yet)."""
    text = (DATA / "sinfo_node_states.txt").read_text()
    run, calls = _runner(0, stdout=text)
    states = commands.node_states(["node1", "node2", "node3", "node4"], run=run)
    assert states == {"node1": "idle", "node2": "mix", "node3": "drain", "node4": "down"}
    assert calls == [["sinfo", "-h", "-N", "-n", "node1,node2,node3,node4", "-o", "%N %t"]]
    resumed = commands.parse_node_states((DATA / "sinfo_node_states_resumed.txt").read_text())
    assert resumed["node3"] == "idle*"


def test_node_states_failure_names_the_command() -> None:
    # as captured here with no slurm.conf to read
    run, _ = _runner(1, stderr="sinfo: fatal: Could not establish a configuration source\n")
    with pytest.raises(SlurmError, match="sinfo -n node1 failed: sinfo: fatal: Could not"):
        commands.node_states(["node1"], run=run)


@pytest.mark.parametrize("value", ["", "cli", " cli "])
def test_the_command_backend_is_the_one_offered(value: str) -> None:
    env = {commands.BACKEND_ENV: value} if value else {}
    assert commands.check_backend(env) == "cli"


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("pyslurm", "pyslurm has no release for this Slurm on the package index"),
        ("rest", "expected one of: cli"),
    ],
)
def test_a_backend_not_offered_is_refused_with_the_reason(value: str, says: str) -> None:
    with pytest.raises(UsageError) as err:
        commands.check_backend({commands.BACKEND_ENV: value})
    assert str(err.value).startswith(f"DLROVER_HPC_SLURM_BACKEND={value}: not a backend here; ")
    assert says in str(err.value) and str(err.value).endswith("unset it or set cli")


def test_a_workers_task_variables_follow_its_rank_and_keep_the_agents() -> None:
    from dlrover_hpc.agent.workers import worker_env
    from dlrover_hpc.cli.run_args import build_parser, config_from_args
    from dlrover_hpc.protocol.messages import Assignment, NodeStatus

    agent = _env_file("step_env_node2.txt")  # srun -N4: the agent is task 1 of 4, on node 1
    config = config_from_args(build_parser().parse_args(["--nproc-per-node=2", "train.py"]))
    assignment = Assignment(
        status=NodeStatus.ACTIVE, round=1, world_size=8, rank_offset=2, node_rank=1, nnodes=4
    )
    with pytest.MonkeyPatch.context() as mp:
        for key in [k for k in os.environ if k.startswith("SLURM_")]:
            mp.delenv(key)
        for key, value in agent.items():
            mp.setenv(key, value)
        env = worker_env(config, assignment, local_rank=1, extra={})
    assert env["RANK"] == env["SLURM_PROCID"] == "3"
    assert env["LOCAL_RANK"] == env["SLURM_LOCALID"] == "1"
    assert env["WORLD_SIZE"] == env["SLURM_NTASKS"] == env["SLURM_NPROCS"] == "8"
    assert env["GROUP_RANK"] == env["SLURM_NODEID"] == "1"
    assert env["LOCAL_WORLD_SIZE"] == env["SLURM_NTASKS_PER_NODE"] == "2"
    kept = {k: v for k, v in env.items() if k.startswith("DLROVER_HPC_AGENT_SLURM_")}
    assert kept == {
        "DLROVER_HPC_AGENT_SLURM_PROCID": "1",
        "DLROVER_HPC_AGENT_SLURM_LOCALID": "0",
        "DLROVER_HPC_AGENT_SLURM_NTASKS": "4",
        "DLROVER_HPC_AGENT_SLURM_NPROCS": "4",
        "DLROVER_HPC_AGENT_SLURM_NODEID": "1",
        "DLROVER_HPC_AGENT_SLURM_NTASKS_PER_NODE": "1",
    }


def test_outside_a_slurm_job_a_worker_gets_no_slurm_variables() -> None:
    from dlrover_hpc.slurm.env import worker_task_env

    torchrun = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "GROUP_RANK": "1"}
    assert worker_task_env({"PATH": "/usr/bin"}, {**torchrun, "LOCAL_WORLD_SIZE": "2"}) == {}
    # Inside a job without SLURM_NPROCS (newer Slurm): not added.
    got = worker_task_env({"SLURM_JOB_ID": "7"}, {**torchrun, "LOCAL_WORLD_SIZE": "2"})
    assert "SLURM_NPROCS" not in got and got["SLURM_PROCID"] == "3"
    assert not [k for k in got if k.startswith("DLROVER_HPC_AGENT_")]  # nothing to keep


# ``scontrol -o show node node[1-4]`` captured on the local Slurm (22.05.8) for the live node
# states (issue 48): a 2-node exclusive job on node[1-2] and a 1-CPU job on node3, then drains,
# a FAIL, a DOWN, and all resumed; a killed slurmd (NOT_RESPONDING) and a node set down.
_SHOWN = {
    "show_nodes_drained.txt": {
        "node1": ("ALLOCATED", {"DRAIN"}, "nhc: bad dimm [root@2026-12-01T18:59:20]"),
        "node2": ("ALLOCATED", set(), ""),
        "node3": ("MIXED", {"DRAIN"}, "admin drain test [root@2026-12-01T18:59:20]"),
        "node4": ("IDLE", {"DRAIN"}, "idle drain [root@2026-12-01T18:59:20]"),
    },
    "show_nodes_fail.txt": {
        "node1": ("ALLOCATED", {"DRAIN"}, "nhc: bad dimm [root@2026-12-01T18:59:20]"),
        "node2": ("ALLOCATED", {"FAIL"}, "fail test [root@2026-12-01T18:59:20]"),
        "node3": ("MIXED", {"DRAIN"}, "admin drain test [root@2026-12-01T18:59:20]"),
        "node4": ("IDLE", {"DRAIN"}, "idle drain [root@2026-12-01T18:59:20]"),
    },
    "show_nodes_fail_down.txt": {
        "node1": ("ALLOCATED", {"DRAIN"}, "nhc: bad dimm [root@2026-12-01T18:59:20]"),
        "node2": ("ALLOCATED", {"FAIL"}, "fail test [root@2026-12-01T18:59:20]"),
        "node3": ("MIXED", {"DRAIN"}, "admin drain test [root@2026-12-01T18:59:20]"),
        "node4": ("DOWN", {"DRAIN"}, "down test [root@2026-12-01T18:59:20]"),
    },
    "show_nodes_resumed.txt": {
        "node1": ("ALLOCATED", set(), ""),
        "node2": ("ALLOCATED", set(), ""),
        "node3": ("MIXED", set(), ""),
        "node4": ("IDLE", set(), ""),
    },
    "show_nodes_down_not_responding.txt": {
        "node1": ("IDLE", set(), ""),
        "node2": ("DOWN", {"NOT_RESPONDING"}, "Not responding [root@2026-12-01T18:59:57]"),
        "node3": ("DOWN", set(), "operator: down [root@2026-12-01T18:59:39]"),
        "node4": ("IDLE", set(), ""),
    },
    # node4 of a running job drained, then resumed: NOT_RESPONDING for a moment
    "show_nodes_just_resumed.txt": {
        "node1": ("IDLE", set(), ""),
        "node2": ("IDLE", set(), ""),
        "node3": ("ALLOCATED", set(), ""),
        "node4": ("ALLOCATED", {"NOT_RESPONDING"}, ""),
    },
    "show_node_drained.txt": {
        "node3": ("IDLE", {"DRAIN"}, "dlrover-hpc: test job 2 [root@2026-11-21T21:15:55]"),
    },
}


@pytest.mark.parametrize("name", sorted(_SHOWN))
def test_parse_show_nodes_captured(name: str) -> None:
    shown = parse_show_nodes((DATA / name).read_text())
    got = {n: (s.state, set(s.flags), s.reason) for n, s in shown.items()}
    assert got == _SHOWN[name]
    assert all(n == s.name for n, s in shown.items())


def test_parse_show_nodes_matches_the_full_parser() -> None:
    """The string search reads State and Reason as the Key=Value parser does."""
    for name in _SHOWN:
        for line in (DATA / name).read_text().splitlines():
            fields = parse_oneliner(line, free_text_last="Reason")
            [node] = parse_show_nodes(line).values()
            assert node_state(fields) == (node.state, node.flags)
            assert fields.get("Reason", "") == node.reason


@pytest.mark.parametrize(
    "text",
    ["", "Node node5 not found\n", "NodeName=node1\n", "NodeName=node1 Arch=x86_64\n"],
)
def test_parse_show_nodes_skips_what_is_no_node_line(text: str) -> None:
    assert parse_show_nodes(text) == {}


def test_show_nodes_is_one_scontrol_for_the_compressed_host_list() -> None:
    text = (DATA / "show_nodes_drained.txt").read_text()
    run, calls = _runner(0, stdout=text)
    shown = commands.show_nodes(["node1", "node2", "node3", "node4"], run=run)
    assert calls == [["scontrol", "-o", "show", "node", "node[1-4]"]]
    assert sorted(shown) == ["node1", "node2", "node3", "node4"]


def test_show_nodes_keeps_the_nodes_slurm_knows() -> None:
    """``scontrol -o show node node[1-5]`` with no node5: exit 1, the four others printed."""
    text = (DATA / "show_nodes_one_unknown.txt").read_text()
    run, _ = _runner(1, stdout=text, stderr="Node node5 not found\n")
    shown = commands.show_nodes([f"node{i}" for i in range(1, 6)], run=run)
    assert sorted(shown) == ["node1", "node2", "node3", "node4"]
    assert shown["node4"].state == "DOWN"


@pytest.mark.parametrize(
    ("stderr", "says"),
    [
        # slurmctld stopped (SIGSTOP): after MessageTimeout=5, as captured here
        (
            "slurm_load_node error: Socket timed out on send/recv operation\n",
            "scontrol show node node[1-2] failed: slurm_load_node error: Socket timed out",
        ),
        ("Node nodeX not found\n", "scontrol show node node[1-2] failed: Node nodeX not found"),
    ],
)
def test_show_nodes_failure_names_the_command(stderr: str, says: str) -> None:
    run, _ = _runner(1, stderr=stderr)
    with pytest.raises(SlurmError, match=re.escape(says)):
        commands.show_nodes(["node1", "node2"], run=run)
