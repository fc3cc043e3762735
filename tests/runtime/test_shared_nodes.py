"""Two users' jobs on the same local-Slurm nodes (issue 28, item 4): both finish, neither
collides with the other, and the unprivileged user cannot read the other job's checkpoint
segments, progress records or job directory, connect to its checkpoint saver, pre-warmed
interpreter, replica server or master, or signal its workers.

One job is the tests' own (root); the other is a throwaway unprivileged user's, submitted with
``runuser`` and run by Slurm as that user.  The venv's interpreter lives under ``/root``, closed
to other users, so that user's job runs Debian's ``python3.11`` on the venv's packages (the same
ABI), through two small wrappers named ``dlrover-run`` and ``dlrover-hpc``.  Its environment
still says ``USER=root`` (``runuser`` keeps it): every name in a shared directory (``/tmp``,
``/dev/shm``) must come from the process's own uid, or the two jobs' files would collide.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from runtime_helpers import REPO, events, named, run_env, sbatch, timing_log, wait_job

from dlrover_hpc.checkpoint.testing import job_prefix
from dlrover_hpc.localslurm import LocalSlurm, wait_for

pytestmark = pytest.mark.slurm

USER = "dlrshared"  # not test_drain's user: tests side by side must not remove each other's
PYTHON = "/usr/bin/python3.11"
SITE = next((REPO / ".venv" / "lib").glob("python3*/site-packages"), None)
FLASH = REPO / "examples" / "train_flash_ckpt.py"
STEPS = 300

WRAPPER = """#!/bin/sh
exec {python} -c 'import sys; from {module} import main; sys.exit(main())' "$@"
"""

#: Run as the other user on node1 (a step of that user's own job): every attempt on the root
#: job's files, sockets and processes, and how it ended.
PROBE = r"""
import asyncio, errno, json, os, socket, sys
from dlrover_hpc.protocol.client import MasterClient
from dlrover_hpc.protocol.wire import AuthError

target = json.loads(sys.argv[1])
out = {}

def attempt(label, action):
    try:
        action()
        out[label] = "ALLOWED"
    except OSError as exc:
        out[label] = errno.errorcode.get(exc.errno, str(exc.errno))

def read(path):
    with open(path, "rb") as f:
        f.read(1)

def unix(path):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)

attempt("job_dir", lambda: os.listdir(target["job_dir"]))
for path in target["shm"]:
    attempt(path, lambda: read(path))
for path in target["sockets"]:
    attempt(path, lambda: unix(path))
for pid in target["pids"]:
    attempt(f"kill {pid}", lambda: os.kill(pid, 0))

async def master():
    client = await MasterClient.connect(*target["master"], token="0" * 64, link_timeout_s=None)
    await client.close()

try:
    asyncio.run(master())
    out["master"] = "ALLOWED"
except AuthError as exc:
    out["master"] = "refused"

for port in target["replica_ports"]:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.settimeout(10)
            nonce = s.recv(32)
            s.sendall(b"\0" * 32)  # no job token: a wrong answer to the challenge
            body = json.dumps({"name": "x", "step": 1, "seq": 2, "size": 1}).encode()
            s.sendall(len(body).to_bytes(4, "big") + body)
            out[f"replica {port}"] = "refused" if nonce and not s.recv(64) else "ALLOWED"
    except ConnectionRefusedError:
        pass  # another node's server: not on this node
    except OSError:
        out[f"replica {port}"] = "refused"  # reset while sending: hung up on
print(json.dumps(out))
"""


@pytest.fixture
def other_user() -> Iterator[pwd.struct_passwd]:
    """A throwaway user that Slurm runs a job as (CI runs as root)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create a user")
    subprocess.run(["useradd", "-M", "-s", "/bin/sh", USER], capture_output=True, timeout=30)
    yield pwd.getpwnam(USER)
    subprocess.run(["userdel", USER], capture_output=True, timeout=30)


def _flash_args(work: Path) -> list[str]:
    return [
        "--nnodes=2:2",
        "--nproc-per-node=2",
        str(FLASH),
        f"--steps={STEPS}",
        f"--ckpt-dir={work / 'ckpt'}",
        "--save-every=5",
        "--persist-every=50",
        "--replicas=1",
        "--step-time=0.05",
        f"--result={work / 'result.json'}",
        f"--timing-log={work / 'timing.log'}",
    ]


def _as_user_env(bin_dir: Path, home: str) -> dict[str, str]:
    env = run_env()  # USER and LOGNAME still say root, on purpose (see the module's doc)
    env["PATH"] = f"{bin_dir}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
    env["PYTHONPATH"] = f"{REPO}:{SITE}"
    env["HOME"] = home  # root's is closed to them (their TOML file would be under it)
    env.pop("VIRTUAL_ENV", None)
    return env


def _submit_as(user: str, work: Path, env: dict[str, str]) -> str:
    out = subprocess.run(
        [
            *("runuser", "-u", user, "--", "sbatch", "--parsable", "-N2", "-w", "node[1-2]"),
            *("-o", str(work / "slurm-%j.out"), str(REPO / "sbatch" / "train.sbatch")),
            *_flash_args(work),
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def _node_processes(slurmd_pid: int, job: str) -> list[psutil.Process]:
    """The processes of ``job`` on the node whose slurmd is ``slurmd_pid``."""
    ns = os.readlink(f"/proc/{slurmd_pid}/ns/net")
    found = []
    for p in psutil.process_iter():
        try:
            if (
                os.readlink(f"/proc/{p.pid}/ns/net") == ns
                and p.environ().get("SLURM_JOB_ID") == job
            ):
                found.append(p)
        except (OSError, psutil.Error):
            continue
    return found


def _root_job_on_node1(local_slurm: LocalSlurm, work: Path, job: str) -> dict:
    """What the other user will try to reach: the root job's files, sockets and processes on
    node1, and its master."""
    job_dir = work / ".dlrover-hpc" / job
    slurmd = local_slurm.slurmd_pids()["node1"]
    shm = Path(f"/proc/{slurmd}/root/dev/shm")
    # Segments, replicas' copies, progress records and stack dumps: all named after user and job.
    names = [n for n in os.listdir(shm) if n.startswith(job_prefix(job))]
    procs = _node_processes(slurmd, job)
    serving = [p.cmdline() for p in procs if "dlrover_hpc.agent.zygote" in " ".join(p.cmdline())]
    sockets = [argv[argv.index("serve") + 1] for argv in serving if "serve" in argv]
    sockets += [str(p) for p in Path("/tmp").glob(f"dlrover-hpc-root-{job}-node1*.sock")]
    workers = [e for e in named(events(job_dir), "workers_started") if e["node"] == "node1"]
    info = json.loads((job_dir / "master.json").read_text())
    log = (work / f"slurm-{job}.out").read_text()
    return {
        "job_dir": str(job_dir),
        "shm": [f"/dev/shm/{n}" for n in sorted(names)],
        "sockets": sockets,
        "pids": workers[-1]["pids"] if workers else [],
        "master": [info["host"], info["port"]],
        "replica_ports": sorted(
            {int(p) for p in re.findall(r"replica_server_listening port=(\d+)", log)}
        ),
    }


def _modes(paths: list[Path]) -> dict[str, tuple[int, str]]:
    return {str(p): (p.lstat().st_uid, oct(stat.S_IMODE(p.lstat().st_mode))) for p in paths}


def test_two_users_jobs_on_the_same_nodes_finish_and_cannot_reach_each_other(
    local_slurm: LocalSlurm, shared_tmp: Path, other_user: pwd.struct_passwd
) -> None:
    assert SITE is not None and Path(PYTHON).exists()
    mine, theirs = shared_tmp / "root-job", shared_tmp / "user-job"
    mine.mkdir(mode=0o755)
    theirs.mkdir(mode=0o755)
    os.chown(theirs, other_user.pw_uid, other_user.pw_gid)
    bin_dir = shared_tmp / "bin"
    bin_dir.mkdir(mode=0o755)
    for name, module in (
        ("dlrover-run", "dlrover_hpc.cli.run"),
        ("dlrover-hpc", "dlrover_hpc.cli.main"),
    ):
        (bin_dir / name).write_text(WRAPPER.format(python=PYTHON, module=module))
        (bin_dir / name).chmod(0o755)

    root_job = sbatch(mine, 2, *_flash_args(mine), extra=("-w", "node[1-2]"))
    user_job = _submit_as(USER, theirs, _as_user_env(bin_dir, str(theirs)))
    try:
        for work in (mine, theirs):
            wait_for(
                lambda w=work: any(s >= 20 for _, s in timing_log(w)),
                timeout_s=180,
                what=f"training in {work.name}",
            )
        target = _root_job_on_node1(local_slurm, mine, root_job)
        probe = subprocess.run(
            [
                *("runuser", "-u", USER, "--", "srun", f"--jobid={user_job}", "--overlap"),
                *("-w", "node1", "-N1", "-n1", PYTHON, "-c", PROBE, json.dumps(target)),
            ],
            cwd=theirs,
            env=_as_user_env(bin_dir, str(theirs)),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert probe.returncode == 0, probe.stderr[-3000:]
        seen = json.loads(probe.stdout.strip().splitlines()[-1])
        user_files = _modes(
            [
                theirs / ".dlrover-hpc" / user_job,
                *Path(f"/proc/{local_slurm.slurmd_pids()['node1']}/root/dev/shm").glob(
                    f"dlrover-hpc-{USER}-{user_job}-*"
                ),
                *Path("/tmp").glob(f"dlrover-hpc-{USER}-{user_job}-node1*.sock"),
            ]
        )
        fields = {job: wait_job(job, timeout_s=240) for job in (root_job, user_job)}
    finally:
        for job in (root_job, user_job):
            subprocess.run(["scancel", job], check=False, timeout=30)

    # Both finished, each on its own master, with no failure of any worker.
    for work, job in ((mine, root_job), (theirs, user_job)):
        out = (work / f"slurm-{job}.out").read_text()
        assert fields[job]["JobState"] == "COMPLETED", out[-4000:]
        assert json.loads((work / "result.json").read_text())["final_step"] == STEPS
        evs = events(work / ".dlrover-hpc" / job)
        assert named(evs, "job_finished")[-1]["exit_code"] == 0
        assert not named(evs, "worker_failed"), out[-3000:]
    assert fields[user_job]["UserId"].startswith(f"{USER}(")
    masters = [
        json.loads((w / ".dlrover-hpc" / j / "master.json").read_text())
        for w, j in ((mine, root_job), (theirs, user_job))
    ]
    assert masters[0]["port"] != masters[1]["port"] or masters[0]["host"] != masters[1]["host"]

    # Everything the other user tried was refused, by the kernel or by the job token.
    assert target["shm"] and target["pids"] and target["replica_ports"], target
    assert {Path(p).name.endswith("-zygote.sock") for p in target["sockets"]} == {True, False}
    assert seen["job_dir"] == "EACCES", seen
    opened = {p: seen[p] for p in target["shm"] + target["sockets"] if seen[p] != "EACCES"}
    assert not opened, opened
    signalled = {pid: seen[f"kill {pid}"] for pid in target["pids"]}
    assert set(signalled.values()) == {"EPERM"}, signalled
    assert seen["master"] == "refused", seen
    replicas = {k: v for k, v in seen.items() if k.startswith("replica ")}
    assert replicas and set(replicas.values()) == {"refused"}, seen
    root_out = (mine / f"slurm-{root_job}.out").read_text()
    assert "replica_refused" in root_out and "bad job token" in root_out

    # The user's own files: theirs (their uid), closed to everyone else.
    uid = other_user.pw_uid
    job_dir = str(theirs / ".dlrover-hpc" / user_job)
    assert user_files.pop(job_dir) == (uid, "0o700")
    assert any("shm" in p for p in user_files) and any(p.endswith(".sock") for p in user_files)
    assert set(user_files.values()) == {(uid, "0o600")}, user_files
