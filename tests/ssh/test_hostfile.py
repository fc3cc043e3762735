"""The bare-metal launcher's pure parts: hostfile, blocklist, run arguments, host split."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dlrover_hpc.cli.launch import launch_config, parse_run_args
from dlrover_hpc.config import DrainMode, NodeRange
from dlrover_hpc.errors import UsageError
from dlrover_hpc.ssh import remote
from dlrover_hpc.ssh.blocklist import QuarantineReader, block_host, read_blocklist
from dlrover_hpc.ssh.errors import HostfileError
from dlrover_hpc.ssh.hostfile import HostEntry, load_hostfile, parse_hostfile
from dlrover_hpc.ssh.plan import job_nnodes, split_hosts

BIN = Path(sys.executable).parent


# ----------------------------------------------------------------- hostfile
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("node1\n", [("node1", None, 1)]),
        ("node1 slots=8\nnode2\n", [("node1", 8, 1), ("node2", None, 2)]),
        (
            "# cluster A\n\nnode[01-03,07] slots=2  # four hosts\n10.0.0.5\n",
            [
                ("node01", 2, 3),
                ("node02", 2, 3),
                ("node03", 2, 3),
                ("node07", 2, 3),
                ("10.0.0.5", None, 4),
            ],
        ),
        ("gpu-b[3,1]\nn2\n", [("gpu-b3", None, 1), ("gpu-b1", None, 1), ("n2", None, 2)]),
        ("  node9\tslots=1 \n", [("node9", 1, 1)]),
        ("a,b slots=3\n", [("a", 3, 1), ("b", 3, 1)]),
    ],
)
def test_hostfile_parses(text: str, expected: list[tuple[str, int | None, int]]) -> None:
    hosts = parse_hostfile(text, source="hosts.txt")
    assert [(h.name, h.slots, h.line) for h in hosts] == expected


HOSTFILE_ERRORS = [
    ("", "hosts.txt: no hosts; write one host per line, e.g. 'node01 slots=8'"),
    ("# only a comment\n", "hosts.txt: no hosts"),
    (
        "node1\nnode1\n",
        "hosts.txt:2: host 'node1' is already listed on line 1; list each host once",
    ),
    ("node[1-3]\nnode2\n", "hosts.txt:2: host 'node2' is already listed on line 1"),
    (
        "node1 slots=0\n",
        "hosts.txt:1: slots=0: expected a positive number of workers, e.g. slots=8",
    ),
    ("node1 slots=x\n", "hosts.txt:1: slots=x: expected a positive number"),
    (
        "node1 max_slots=4\n",
        "hosts.txt:1: unknown key 'max_slots'; only slots=N may follow the host",
    ),
    ("node1 slots=2 slots=3\n", "hosts.txt:1: slots= is given twice; keep one"),
    ("node1 node2\n", "hosts.txt:1: unexpected 'node2'; write one host (or host list) per line"),
    ("\nnode[1-\n", "hosts.txt:2: 'node[1-' is not a valid host list"),
    (
        "n[2-1]\n",
        "hosts.txt:1: 'n[2-1]' is not a valid host list (start > stop); write e.g. node[01",
    ),
    (
        "node1:4\n",
        "hosts.txt:1: 'node1:4': write the worker count as slots=N, e.g. 'node1 slots=4'",
    ),
    ("root@node1\n", "hosts.txt:1: 'root@node1': user names do not go in the hostfile; use --ssh"),
    ("slots=2\n", "hosts.txt:1: 'slots=2' comes before any host; write HOST [slots=N]"),
]


@pytest.mark.parametrize(("text", "message"), HOSTFILE_ERRORS)
def test_hostfile_errors_name_file_line_and_fix(text: str, message: str) -> None:
    with pytest.raises(HostfileError) as info:
        parse_hostfile(text, source="hosts.txt")
    assert str(info.value).startswith(message)
    assert isinstance(info.value, UsageError)  # exit 2


def test_missing_hostfile(tmp_path: Path) -> None:
    with pytest.raises(HostfileError, match=r"nope.txt: no such hostfile; pass --hostfile FILE"):
        load_hostfile(tmp_path / "nope.txt")


def test_launch_cli_bad_hostfile_exits_2(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("node1\nnode2 slots=two\n")
    proc = subprocess.run(
        [str(BIN / "dlrover-hpc"), "launch", "--hostfile", str(hosts), "--", "train.py"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"{hosts}:2: slots=two: expected a positive number of workers" in proc.stderr


def test_launch_cli_bad_run_args_exit_2(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("node1\n")
    for run_args, message in (
        ([], "launch needs dlrover-run's arguments after '--'"),
        (["--nnodes=4:2", "train.py"], "--nnodes=4:2: the minimum is larger than the maximum"),
        (["--standalone", "train.py"], "launch runs the job master itself; drop --standalone"),
        (["--bogus", "train.py"], "dlrover-run arguments: unrecognized arguments: --bogus"),
    ):
        proc = subprocess.run(
            [str(BIN / "dlrover-hpc"), "launch", "--hostfile", str(hosts), "--", *run_args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2, (run_args, proc.stderr)
        assert message in proc.stderr, (run_args, proc.stderr)


# ---------------------------------------------------------------- blocklist
def test_blocklist_round_trip_and_shared_appends(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "blocklist.txt"
    assert read_blocklist(path) == {}
    block_host(path, "node3", reason="faulty in the\nnetwork check", job="launch-1")
    block_host(path, "node5", reason="hardware fault on rank 2", job="launch-2")
    text = path.read_text()
    assert text.startswith("# dlrover-hpc blocklist")
    assert text.count("# dlrover-hpc blocklist") == 1  # the header once
    blocked = read_blocklist(path)
    assert sorted(blocked) == ["node3", "node5"]
    assert blocked["node3"].reason.endswith("job launch-1: faulty in the network check")
    assert blocked["node5"].where == f"{path}:4"


def test_blocklist_accepts_hostlists_and_names_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "blocklist.txt"
    path.write_text("node[1-2]  # bad PSU\n\n# a comment\n")
    assert sorted(read_blocklist(path)) == ["node1", "node2"]
    path.write_text("node1\nnode2 node3\n")
    with pytest.raises(HostfileError, match=r"blocklist.txt:2: unexpected 'node3'"):
        read_blocklist(path)


def test_quarantine_reader_returns_only_new_complete_lines(tmp_path: Path) -> None:
    path = tmp_path / "quarantine.jsonl"
    reader = QuarantineReader(path)
    assert reader.new_entries() == []
    line = {"node": "node2", "reason": "hardware fault", "admin_command": ""}
    path.write_text(json.dumps(line) + "\n" + '{"node": "node3", "rea')
    assert [(e.node, e.reason) for e in reader.new_entries()] == [("node2", "hardware fault")]
    assert reader.new_entries() == []
    with path.open("a") as f:
        f.write('son": "netcheck", "admin_command": ""}\n')
    assert [e.node for e in reader.new_entries()] == ["node3"]


# -------------------------------------------------------------- run arguments
def test_run_args_are_split_and_per_host_flags_replaced() -> None:
    run = parse_run_args(
        ["--", "--nnodes", "2:3", "--nproc_per_node", "4", "--max-restarts=5",
         "--job-dir=/x", "--network-check", "train.py", "--steps", "10", "--nnodes=9"]
    )  # fmt: skip
    assert run.nnodes == NodeRange(min=2, max=3)
    assert run.nproc_per_node == "4" and run.max_restarts == 5 and run.job_dir == "/x"
    assert run.options == ("--max-restarts=5", "--network-check")
    assert run.script == ("train.py", "--steps", "10", "--nnodes=9")  # the script's own flags
    argv = run.agent_argv(
        program="/venv/bin/dlrover-run",
        nnodes=NodeRange(min=2, max=3),
        nproc="8",
        master="head:1234",
        job_dir="/jobs/j1",
    )
    assert argv == [
        "/venv/bin/dlrover-run", "--max-restarts=5", "--network-check", "--nnodes=2:3",
        "--nproc-per-node=8", "--master=head:1234", "--job-dir=/jobs/j1",
        "train.py", "--steps", "10", "--nnodes=9",
    ]  # fmt: skip


def test_run_args_without_nnodes_and_with_gpu_nproc() -> None:
    run = parse_run_args(["--nproc-per-node=gpu", "-m", "pkg.train"])
    assert run.nnodes is None and run.nproc_per_node == "gpu"  # resolved on each host
    assert run.options == ("-m",) and run.script == ("pkg.train",)


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        (["--master=h:1", "t.py"], "launch runs the job master itself; drop --master"),
        (["--nnodes=x", "t.py"], "--nnodes=x: expected a node count N or a range MIN:MAX"),
        (["--hang-timeout=-1", "t.py"], r"--hang-timeout=-1: must be auto, 0 \(off\) or seconds"),
        (
            ["--straggler-factor=1", "t.py"],
            r"--straggler-factor=1: must be 0 \(off\) or more than 1",
        ),
    ],
)
def test_run_args_errors(tokens: list[str], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        parse_run_args(tokens)


# ---------------------------------------------------------------- host split
def test_active_count_and_spares() -> None:
    hosts = [HostEntry(name=f"n{i}") for i in range(1, 6)]
    # --nnodes given: the first MAX hosts train, every other host is a hot spare.
    nn = job_nnodes(requested=NodeRange(min=2, max=3), usable=5, spares=0, hostfile="h")
    assert split_hosts(hosts, nnodes=nn) == (hosts[:3], hosts[3:])
    # No --nnodes: all hosts but the --spares last ones.
    nn = job_nnodes(requested=None, usable=5, spares=2, hostfile="h")
    assert nn == NodeRange(min=3, max=3)
    assert split_hosts(hosts, nnodes=nn) == (hosts[:3], hosts[3:])
    # Fewer hosts than MAX: all of them train.
    assert split_hosts(hosts[:2], nnodes=NodeRange(min=1, max=4)) == (hosts[:2], [])
    with pytest.raises(UsageError, match=r"--spares=5 leaves no host to train on: h has 5"):
        job_nnodes(requested=None, usable=5, spares=5, hostfile="h")


def test_remote_hello_and_exit_codes() -> None:
    line = remote.hello_line("node7", 42)
    assert remote.parse_hello(line) == {"node": "node7", "pid": 42}
    assert remote.parse_hello("step 1 loss 0.3") is None
    assert remote.parse_hello(remote.MARK + " {not json") is None
    assert (remote.exit_code(0), remote.exit_code(3), remote.exit_code(-9)) == (0, 3, 137)


# ------------------------------------------------------ flags and environment
def _launch_args(hostfile: Path, *run_args: str, **flags: object) -> argparse.Namespace:
    values = {"spares": 0, "ssh_user": None, "ssh_key": None, **flags}
    return argparse.Namespace(hostfile=str(hostfile), run_args=["--", *run_args], **values)


def test_launch_config_from_flags_and_environment(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("n[1-3]\n")
    known = tmp_path / "known_hosts"
    known.write_text("")
    env = {
        "DLROVER_HPC_KNOWN_HOSTS": str(known),
        "DLROVER_HPC_BLOCKLIST": str(tmp_path / "shared.txt"),
        "DLROVER_HPC_CONNECT_TIMEOUT": "2.5",
        "DLROVER_HPC_MASTER_OPTS": "--heartbeat-timeout=5 --last-call=1",
        "DLROVER_HPC_TOKEN": "secret",  # never forwarded as such: the launcher sends its own
        "DLROVER_HPC_LOG_LEVEL": "DEBUG",
        "NCCL_DEBUG": "INFO",
        "HOME": "/root",
    }
    cfg = launch_config(_launch_args(hosts, "--nnodes=2:2", "t.py", ssh_user="alice"), env)
    assert [h.name for h in cfg.hosts] == ["n1", "n2", "n3"]
    assert cfg.master.heartbeat_timeout_s == 5 and cfg.master.last_call_s == 1
    assert cfg.master.drain is DrainMode.QUARANTINE  # bare metal: blocklist, not scontrol
    assert cfg.env == {"DLROVER_HPC_LOG_LEVEL": "DEBUG", "NCCL_DEBUG": "INFO"}
    assert cfg.ssh.user == "alice" and cfg.ssh.known_hosts == str(known)
    assert cfg.ssh.connect_timeout_s == 2.5
    assert cfg.blocklists == (cfg.job_dir / "blocklist.txt", tmp_path / "shared.txt")
    assert cfg.job_dir.parent == Path.cwd() / ".dlrover-hpc"
    assert cfg.job_dir.name == cfg.job_id and cfg.job_id.startswith("launch-")
    assert cfg.remote_command() == f"exec {sys.executable} -m dlrover_hpc.ssh.remote"
    assert cfg.agent_program() == str(BIN / "dlrover-run")
    off = launch_config(
        _launch_args(hosts, "t.py"), {**env, "DLROVER_HPC_MASTER_OPTS": "--drain=off"}
    )
    assert off.master.drain is DrainMode.OFF


def test_launch_config_rejects_bad_settings(tmp_path: Path) -> None:
    import asyncssh

    hosts = tmp_path / "hosts.txt"
    hosts.write_text("n1\n")
    locked = tmp_path / "locked_key"
    key = asyncssh.generate_private_key("ssh-ed25519")
    key.write_private_key(str(locked), format_name="pkcs8-pem", passphrase="pw")
    cases = [
        ({"ssh_key": str(tmp_path / "nope")}, {}, "--ssh-key=", "cannot read it"),
        ({"ssh_key": str(locked)}, {}, "is protected by a passphrase; add it to ssh-agent", ""),
        ({}, {"DLROVER_HPC_KNOWN_HOSTS": "/no/such"}, "DLROVER_HPC_KNOWN_HOSTS=/no/such", ""),
        ({}, {"DLROVER_HPC_MASTER_OPTS": "--bogus"}, "unrecognized arguments: --bogus", ""),
        ({}, {"DLROVER_HPC_CONNECT_TIMEOUT": "0"}, "SSH connect timeout 0.0 s: must be > 0", ""),
    ]
    for flags, env, message, more in cases:
        with pytest.raises(UsageError) as info:
            launch_config(_launch_args(hosts, "t.py", **flags), env)
        assert message in str(info.value) and more in str(info.value), str(info.value)
