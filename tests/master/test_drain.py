"""Draining through scontrol, and the quarantine fallback when Slurm refuses (not an admin)."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlrover_hpc.localslurm import LocalSlurm
from dlrover_hpc.slurm.commands import show_node
from dlrover_hpc.slurm.parse import node_state

pytestmark = pytest.mark.slurm
REPO = Path(__file__).resolve().parents[2]
USER = "dlhpc-test"


def _resume(node: str) -> None:
    subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], timeout=10)


def test_drain_command_as_admin(local_slurm: LocalSlurm) -> None:
    try:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "dlrover_hpc.cli.main",
                "drain",
                "node2",
                "--reason",
                "bad ECC on GPU 3",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "drained node2: bad ECC on GPU 3"
        node = show_node("node2")
        assert "DRAIN" in node_state(node)[1]
        assert node["Reason"].startswith("dlrover-hpc: bad ECC on GPU 3 [")
    finally:
        _resume("node2")
    assert "DRAIN" not in node_state(show_node("node2"))[1]


@pytest.fixture
def unprivileged_user() -> Iterator[str]:
    """A throwaway user that Slurm knows as a plain user (CI runs as root)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create a user")
    subprocess.run(["useradd", "-M", "-s", "/bin/sh", USER], capture_output=True, timeout=30)
    pwd.getpwnam(USER)
    yield USER
    subprocess.run(["userdel", USER], capture_output=True, timeout=30)


# Debian's python3.11 (the venv's interpreter lives under /root, closed to other users) with
# our package and the pure-Python dependencies these modules need on its path.
SITE = next((REPO / ".venv" / "lib").glob("python3*/site-packages"), None)


def _as_user(user: str, code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = f"PYTHONPATH={REPO}:{SITE}"
    return subprocess.run(
        ["su", user, "-s", "/bin/sh", "-c", f"cd {cwd} && {env} /usr/bin/python3.11 -c '{code}'"],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_unprivileged_master_quarantines_and_logs_the_admin_command(
    local_slurm: LocalSlurm, unprivileged_user: str, shared_tmp: Path
) -> None:
    if not Path("/usr/bin/python3.11").exists() or SITE is None:
        pytest.skip("needs Debian's python3.11 and the project venv")
    job_dir = shared_tmp / "job"
    job_dir.mkdir()
    os.chown(job_dir, pwd.getpwnam(unprivileged_user).pw_uid, -1)
    code = (
        "import logging; logging.basicConfig(level=logging.WARNING);"
        "from pathlib import Path;"
        "from dlrover_hpc.config import DrainMode;"
        "from dlrover_hpc.master.journal import EventLog;"
        "from dlrover_hpc.master.policy import NodeRemover;"
        f'd = Path("{job_dir}");'
        'NodeRemover(mode=DrainMode.SCONTROL, job_id="77", job_dir=d,'
        ' events=EventLog(d / "events.jsonl")).remove("node3", "Xid 79")'
    )
    out = _as_user(unprivileged_user, code, shared_tmp)
    assert out.returncode == 0, out.stderr
    # Slurm refused (not an admin): the node is untouched, the refusal and the fix are logged.
    assert "DRAIN" not in node_state(show_node("node3"))[1]
    assert "Slurm refused to drain node=node3 error='slurm_update error: Invalid user id'" in (
        out.stderr
    )
    admin = "scontrol update NodeName=node3 State=DRAIN 'Reason=dlrover-hpc: Xid 79 job 77'"
    assert f"An admin can run: {admin}" in out.stderr
    quarantined = [json.loads(x) for x in (job_dir / "quarantine.jsonl").read_text().splitlines()]
    assert quarantined == [{"node": "node3", "reason": "Xid 79", "admin_command": admin}]
    evs = [json.loads(x) for x in (job_dir / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["node"], e["admin_command"]) for e in evs] == [
        ("node_quarantined", "node3", admin)
    ]
    # The same refusal through the CLI: exit 1 and the exact command for an admin.
    cli = _as_user(
        unprivileged_user,
        "import sys; from dlrover_hpc.cli.main import main;"
        'sys.exit(main(["drain", "node3", "--reason", "Xid 79"]))',
        shared_tmp,
    )
    assert cli.returncode == 1
    assert "Slurm refused to drain node3: slurm_update error: Invalid user id" in cli.stdout
    assert "ask an admin to run: scontrol update NodeName=node3 State=DRAIN" in cli.stdout
