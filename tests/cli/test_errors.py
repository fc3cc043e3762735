"""Every command a user types fails with one line on stderr, never a traceback (DESIGN.md 2).

The real console scripts run in a subprocess, outside any job: exit 2 for bad usage or input,
1 for a command that failed; the line names the file or thing and what to run instead.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from harness.ports import free_port

from dlrover_hpc.cli.logsetup import exit_code_of
from dlrover_hpc.localslurm import wait_for

pytestmark = pytest.mark.timeout(120)

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without a job: no Slurm, no dlrover-hpc settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DLROVER_HPC_"))}
    return {**env, **extra}


def run(
    program: str, *argv: str, cwd: Path, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / program), *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env=_clean_env() if env is None else dict(env),
    )


def one_line_error(proc: subprocess.CompletedProcess[str], code: int, *parts: str) -> str:
    """The exit code, exactly one stderr line, no traceback, and each of ``parts`` in it."""
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert len(lines) == 1, proc.stderr
    for part in parts:
        assert part in lines[0], (part, lines[0])
    return lines[0]


def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def write_master_json(job_dir: Path, *, pid: int, port: int) -> Path:
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / "token").write_text("0" * 64)
    path = job_dir / "master.json"
    path.write_text(json.dumps({"host": "127.0.0.1", "port": port, "pid": pid, "job_id": "7"}))
    return path


# ------------------------------------------------------------------- status
def test_status_outside_a_job(tmp_path: Path) -> None:
    one_line_error(
        run("dlrover-hpc", "status", cwd=tmp_path),
        2,
        "not inside a job: SLURM_JOB_ID is not set and no --job-dir was given",
        "dlrover-hpc status --job-dir DIR",
        "srun --jobid=JOB --overlap -N1 -n1 dlrover-hpc status",
    )


def test_status_outside_a_job_suggests_a_job_dir_found_here(tmp_path: Path) -> None:
    write_master_json(tmp_path / ".dlrover-hpc" / "launch-1", pid=dead_pid(), port=free_port())
    one_line_error(
        run("dlrover-hpc", "status", cwd=tmp_path),
        2,
        "(e.g. --job-dir .dlrover-hpc/launch-1)",
    )


def test_status_job_dir_that_does_not_exist(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-job"
    one_line_error(
        run("dlrover-hpc", "status", "--job-dir", str(missing), cwd=tmp_path),
        2,
        f"job directory {missing} does not exist; pass --job-dir with the directory of a "
        "running job",
    )
    # The same directory from the environment.
    env = _clean_env(DLROVER_HPC_JOB_DIR=str(missing))
    one_line_error(run("dlrover-hpc", "status", cwd=tmp_path, env=env), 2, str(missing))


def test_status_without_master_json(tmp_path: Path) -> None:
    one_line_error(
        run("dlrover-hpc", "status", "--job-dir", str(tmp_path), cwd=tmp_path),
        1,
        f"no job master: {tmp_path / 'master.json'} does not exist",
        f"start one with 'dlrover-hpc master --job-dir {tmp_path}'",
    )


def test_status_in_a_slurm_job_without_a_job_dir(tmp_path: Path) -> None:
    env = _clean_env(SLURM_JOB_ID="424242", SLURM_SUBMIT_DIR=str(tmp_path))
    one_line_error(
        run("dlrover-hpc", "status", cwd=tmp_path, env=env),
        1,
        f"Slurm job 424242 has no job directory {tmp_path / '.dlrover-hpc' / '424242'}",
        "start one with 'dlrover-hpc master'",
    )


def test_status_stale_master_json_dead_pid(tmp_path: Path) -> None:
    pid = dead_pid()
    path = write_master_json(tmp_path / "job", pid=pid, port=free_port())
    one_line_error(
        run("dlrover-hpc", "status", "--job-dir", str(tmp_path / "job"), cwd=tmp_path),
        1,
        f"stale {path}: its master (pid {pid} on 127.0.0.1) is no longer running",
        f"start a new master with 'dlrover-hpc master --job-dir {tmp_path / 'job'}'",
    )


def test_status_stale_master_json_pid_alive_but_refused(tmp_path: Path) -> None:
    port = free_port()
    path = write_master_json(tmp_path / "job", pid=os.getpid(), port=port)
    one_line_error(
        run("dlrover-hpc", "status", "--job-dir", str(tmp_path / "job"), cwd=tmp_path),
        1,
        f"stale {path}: nothing listens on 127.0.0.1:{port} (connection refused) although "
        f"its pid {os.getpid()} is still running",
        "dlrover-hpc master --job-dir",
    )


@pytest.mark.parametrize(
    ("content", "what"),
    [("{not json", "JSONDecodeError"), ('{"host": "h"}', "KeyError"), ("[1]", "TypeError")],
)
def test_status_corrupt_master_json(tmp_path: Path, content: str, what: str) -> None:
    (tmp_path / "master.json").write_text(content)
    one_line_error(
        run("dlrover-hpc", "status", "--job-dir", str(tmp_path), cwd=tmp_path),
        1,
        f"{tmp_path / 'master.json'} is not a master address file ({what}",
        f"restart the master with 'dlrover-hpc master --job-dir {tmp_path}'",
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every file")
def test_status_unreadable_master_json(tmp_path: Path) -> None:
    path = write_master_json(tmp_path, pid=os.getpid(), port=free_port())
    path.chmod(0)
    one_line_error(
        run("dlrover-hpc", "status", "--job-dir", str(tmp_path), cwd=tmp_path),
        1,
        f"cannot read {path}: permission denied",
    )


def test_status_master_flag_nobody_listens(tmp_path: Path) -> None:
    port = free_port()
    env = _clean_env(DLROVER_HPC_TOKEN="0" * 64)
    one_line_error(
        run("dlrover-hpc", "status", "--master", f"127.0.0.1:{port}", cwd=tmp_path, env=env),
        1,
        f"nothing listens on 127.0.0.1:{port} (connection refused); check --master",
    )
    one_line_error(
        run("dlrover-hpc", "status", "--master", "nohostport", cwd=tmp_path, env=env),
        2,
        "--master=nohostport: expected HOST:PORT",
    )


@pytest.fixture
def live_master(tmp_path: Path) -> Iterator[Path]:
    job_dir = tmp_path / "job"
    master = subprocess.Popen(
        [str(BIN / "dlrover-hpc"), "master", "--job-dir", str(job_dir)],
        env=_clean_env(),
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: (job_dir / "master.json").is_file(), timeout_s=30, what="master.json")
        yield job_dir
    finally:
        master.terminate()
        master.wait(timeout=30)


def test_status_of_a_live_master(tmp_path: Path, live_master: Path) -> None:
    proc = run("dlrover-hpc", "status", "--job-dir", str(live_master), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("job standalone: "), proc.stdout
    assert "NODE" in proc.stdout and "AGENT" in proc.stdout


# -------------------------------------------------------------------- drain
def fake_scontrol(tmp_path: Path, *, stderr: str, code: int = 1) -> dict[str, str]:
    """An environment whose PATH has only an ``scontrol`` that prints ``stderr``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text(f"#!/bin/sh\nprintf '%s\\n' {_sh_quote(stderr)} >&2\nexit {code}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return _clean_env(PATH=str(bin_dir))


def _sh_quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def test_drain_without_a_reachable_slurm(tmp_path: Path) -> None:
    env = fake_scontrol(
        tmp_path,
        stderr="scontrol: error: fetch_config: DNS SRV lookup failed\n"
        "scontrol: fatal: Could not establish a configuration source",
    )
    one_line_error(
        run("dlrover-hpc", "drain", "node3", "--reason", "Xid 79", cwd=tmp_path, env=env),
        1,
        "cannot reach Slurm to drain node3 (scontrol: fatal: Could not establish a "
        "configuration source); run this on a node of the cluster, where 'scontrol ping' answers",
    )


def test_drain_unknown_node(tmp_path: Path) -> None:
    env = fake_scontrol(tmp_path, stderr="scontrol: error: Invalid node name specified")
    one_line_error(
        run("dlrover-hpc", "drain", "nodeX", "--reason", "r", cwd=tmp_path, env=env),
        2,
        "Slurm has no node 'nodeX'",
        "check the name with 'sinfo -N'",
    )


def test_drain_refused_prints_the_admin_command(tmp_path: Path) -> None:
    env = fake_scontrol(tmp_path, stderr="slurm_update error: Invalid user id")
    proc = run("dlrover-hpc", "drain", "node3", "--reason", "Xid 79", cwd=tmp_path, env=env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "Slurm refused to drain node3: slurm_update error: Invalid user id" in proc.stdout
    assert "ask an admin to run: scontrol update NodeName=node3 State=DRAIN" in proc.stdout


def test_drain_without_scontrol_and_bad_usage(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    env = _clean_env(PATH=str(tmp_path / "empty"))
    one_line_error(
        run("dlrover-hpc", "drain", "node3", "--reason", "r", cwd=tmp_path, env=env),
        1,
        "scontrol: not found; is Slurm's client installed on this node?",
    )
    one_line_error(
        run("dlrover-hpc", "drain", "node3", "--reason", " ", cwd=tmp_path),
        2,
        "--reason must not be empty",
    )
    one_line_error(
        run("dlrover-hpc", "drain", cwd=tmp_path),
        2,
        "the following arguments are required: node, --reason; see 'dlrover-hpc drain --help'",
    )


# ------------------------------------------------------------------- launch
def test_launch_bad_hostfile(tmp_path: Path) -> None:
    missing = tmp_path / "hosts.txt"
    one_line_error(
        run("dlrover-hpc", "launch", "--hostfile", str(missing), "--", "t.py", cwd=tmp_path),
        2,
        f"{missing}: no such hostfile; pass --hostfile FILE",
    )
    one_line_error(
        run("dlrover-hpc", "launch", "--hostfile", str(tmp_path), "--", "t.py", cwd=tmp_path),
        2,
        f"{tmp_path}: cannot read the hostfile",
    )
    one_line_error(
        run("dlrover-hpc", "launch", "--", "t.py", cwd=tmp_path),
        2,
        "required: --hostfile; see 'dlrover-hpc launch --help'",
    )


# ----------------------------------------------------------------- topology
def test_topology_missing_and_unwritable_files(tmp_path: Path) -> None:
    missing = tmp_path / "topology.conf"
    for verb in ("show", "validate", "order"):
        one_line_error(
            run("dlrover-hpc", "topology", verb, str(missing), cwd=tmp_path),
            2,
            f"{missing}: no such topology file; check the path",
        )
    out = tmp_path / "no-dir" / "out.conf"
    fat_tree = REPO / "topology" / "fat-tree.conf"
    one_line_error(
        run(
            "dlrover-hpc",
            "topology",
            "convert",
            str(fat_tree),
            "--to",
            "slurm",
            "-o",
            str(out),
            cwd=tmp_path,
        ),
        2,
        f"{out}: cannot write next to it",
    )
    one_line_error(
        run("dlrover-hpc", "topology", "order", cwd=tmp_path),
        2,
        "required: FILE; see 'dlrover-hpc topology order --help'",
    )


# ------------------------------------------------------------------- master
def test_master_bad_topology_fails_before_making_the_job_dir(tmp_path: Path) -> None:
    bad = tmp_path / "bad.conf"
    bad.write_text("SwitchName=leaf0 Nodes=node[1-2]\nSwitchName=spine0 Switches=leaf9\n")
    job_dir = tmp_path / "job"
    proc = run(
        "dlrover-hpc", "master", "--topology", str(bad), "--job-dir", str(job_dir), cwd=tmp_path
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{bad}:2: " in proc.stderr and "leaf9" in proc.stderr, proc.stderr
    assert not job_dir.exists()
    one_line_error(
        run("dlrover-hpc", "master", "--topology", str(tmp_path / "nope.conf"), cwd=tmp_path),
        2,
        f"{tmp_path / 'nope.conf'}: no such topology file",
    )


@pytest.mark.parametrize(
    ("argv", "env", "parts"),
    [
        (["--port=99999"], {}, ["--port=99999: expected 0 (pick a free port) to 65535"]),
        (
            ["--heartbeat-timeout=abc"],
            {},
            ["argument --heartbeat-timeout: invalid float value: 'abc'", "master --help"],
        ),
        (
            [],
            {"DLROVER_HPC_PORT": "abc"},
            ["invalid int value: 'abc' (from DLROVER_HPC_PORT=abc)"],
        ),
        ([], {"DLROVER_HPC_DRAIN": "bogus"}, ["--drain=bogus: expected one of scontrol"]),
        (["--nnodes=3:1"], {}, ["--nnodes=3:1: the minimum is larger than the maximum"]),
        (
            ["--heartbeat-timeout=1"],
            {},
            ["--heartbeat-timeout=1: must be longer than the heartbeat interval (1 s)"],
        ),
        (["--host=no-such-host.invalid"], {}, ["--host=no-such-host.invalid: cannot resolve"]),
        (["--host=192.0.2.1"], {}, ["192.0.2.1 is not an address of this node"]),
    ],
)
def test_master_bad_flag_values(
    tmp_path: Path, argv: list[str], env: dict[str, str], parts: list[str]
) -> None:
    argv = [*argv, f"--job-dir={tmp_path / 'job'}"]
    proc = run("dlrover-hpc", "master", *argv, cwd=tmp_path, env=_clean_env(**env))
    one_line_error(proc, 2, *parts)
    assert not (tmp_path / "job").exists()


def test_master_port_in_use_and_job_dir_not_creatable(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        one_line_error(
            run("dlrover-hpc", "master", "--host=127.0.0.1", f"--port={port}", cwd=tmp_path),
            2,
            f"--port={port}: cannot listen there (Address already in use)",
            "--port=0 for a free one",
        )
    (tmp_path / "file").write_text("")
    one_line_error(
        run("dlrover-hpc", "master", f"--job-dir={tmp_path / 'file' / 'job'}", cwd=tmp_path),
        2,
        f"job directory {tmp_path / 'file' / 'job'}: cannot create it",
        "pass --job-dir DIR",
    )


def test_dlrover_hpc_usage(tmp_path: Path) -> None:
    one_line_error(
        run("dlrover-hpc", cwd=tmp_path),
        2,
        "required: COMMAND; see 'dlrover-hpc --help'",
    )
    one_line_error(
        run("dlrover-hpc", "--log-level=LOUD", "status", cwd=tmp_path),
        2,
        "log level 'LOUD' (--log-level or DLROVER_HPC_LOG_LEVEL)",
    )


# -------------------------------------------------------------- dlrover-run
@pytest.mark.parametrize(
    ("argv", "parts"),
    [
        (["--standalone", "nope.py"], ["training script nope.py: no such file in", "-m"]),
        (["--no-python", "no-such-program"], ["no-such-program: no such program"]),
        (
            ["--standalone", "--rdzv-endpoint=node1:29400", "train.py"],
            ["--standalone runs its own in-process master on this node; drop --rdzv-endpoint"],
        ),
        (
            ["--standalone", "--master=node1:1", "train.py"],
            ["--standalone runs its own in-process master; drop --master"],
        ),
        (["--bogus", "train.py"], ["unrecognized arguments: --bogus; see 'dlrover-run --help'"]),
        (["--max-restarts=x", "train.py"], ["invalid int value: 'x'"]),
        (["--nnodes=4:2", "train.py"], ["--nnodes=4:2: the minimum is larger than the maximum"]),
        ([], ["the following arguments are required: training_script"]),
    ],
)
def test_dlrover_run_bad_usage(tmp_path: Path, argv: list[str], parts: list[str]) -> None:
    (tmp_path / "train.py").write_text("print('hello')\n")
    line = one_line_error(run("dlrover-run", *argv, cwd=tmp_path), 2, *parts)
    assert line.startswith("dlrover-run: error: "), line


# ------------------------------------------------------------ the mechanism
def test_exit_code_of_file_errors_and_bugs(capsys: pytest.CaptureFixture[str]) -> None:
    def missing() -> int:
        open("/no/such/file")  # noqa: SIM115
        return 0

    assert exit_code_of("prog", missing) == 1
    err = capsys.readouterr().err
    assert err.startswith("prog: error: /no/such/file: no such file or directory; check the path")
    assert len(err.strip().splitlines()) == 1

    def bug() -> int:
        raise TypeError("a bug")

    with pytest.raises(TypeError):  # a bug keeps its traceback
        exit_code_of("prog", bug)

    def no_file() -> int:
        raise ConnectionResetError(104, "Connection reset by peer")

    with pytest.raises(ConnectionResetError):  # no file named: not ours to word
        exit_code_of("prog", no_file)


def test_dlrover_run_master_nobody_listens(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print('hello')\n")
    port = free_port()
    env = _clean_env(DLROVER_HPC_TOKEN="0" * 64)
    argv = [f"--master=127.0.0.1:{port}", f"--job-dir={tmp_path / 'job'}", "train.py"]
    proc = run("dlrover-run", *argv, cwd=tmp_path, env=env)
    assert proc.returncode == 1, proc.stderr
    # Only the agent's own lines are checked: its fork server (agent/zygote.py) may print a
    # BrokenPipeError of its own when the agent exits while it starts.
    assert "ConnectionRefusedError" not in proc.stderr, proc.stderr
    assert (
        "dlrover-run: error: cannot reach the job master: Connect call failed "
        f"('127.0.0.1', {port}) "
        "(connection refused); start the job master first ('dlrover-hpc master'"
    ) in proc.stderr, proc.stderr


@pytest.mark.parametrize("argv", [("master", "--port", "0"), ("drain", "node1", "--reason", "x")])
def test_a_slurm_backend_not_offered_is_refused_before_anything_starts(
    tmp_path: Path, argv: tuple[str, ...]
) -> None:
    proc = run(
        "dlrover-hpc", *argv, cwd=tmp_path, env=_clean_env(DLROVER_HPC_SLURM_BACKEND="pyslurm")
    )
    one_line_error(proc, 2, "DLROVER_HPC_SLURM_BACKEND=pyslurm: not a backend here", "set cli")
    assert not (tmp_path / ".dlrover-hpc").exists()  # no master started, no job dir made
