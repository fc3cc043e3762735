"""No orphans: a SIGKILLed ``dlrover-run`` takes its zygote and all its workers along.

Real agents (``--standalone``), real workers, real SIGKILL; nothing is mocked.  The workers
come from the zygote (the default) or from the exec shim (``--no-python``, and the python
path while the zygote is not ready yet).
"""

from __future__ import annotations

import contextlib
import dataclasses
import getpass
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from runtime_helpers import BIN, events, named

from dlrover_hpc.agent.watchdog import sweep_stale
from dlrover_hpc.localslurm import wait_for

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.runtime,
]

# argv: OUT_DIR MODE.  MODE "zygote": only a worker forked from the zygote (its parent)
# reports; the others wait until the zygote listens and fail, so the restart comes from it.
SCRIPT = """\
import getpass, json, os, signal, sys, time
from pathlib import Path

out, mode = Path(sys.argv[1]), sys.argv[2]
parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().replace(b"\\0", b" ")
if mode == "zygote" and b"zygote serve" not in parent:  # not forked by the zygote
    sock = Path(f"/tmp/dlrover-hpc-{getpass.getuser()}-agent{os.getppid()}-zygote.sock")
    deadline = time.monotonic() + 60
    while not sock.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(5)
rank = os.environ["RANK"]

def term(_sig, _frame):
    (out / f"term{rank}").write_text("")
    sys.exit(0)

signal.signal(signal.SIGTERM, term)
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
report = {"pid": os.getpid(), "ppid": os.getppid(), "restart": restart}
(out / f"w{rank}.json").write_text(json.dumps(report))
time.sleep(300)
"""

PATHS = {"zygote": [], "no-python": ["--no-python"]}


def _alive(proc: psutil.Process) -> str | None:
    """``pid cmdline`` of a process that still runs; None once it is gone or a zombie."""
    with contextlib.suppress(psutil.Error):
        if proc.status() != psutil.STATUS_ZOMBIE:
            return f"{proc.pid} {' '.join(proc.cmdline())[:120]}"
    return None


@dataclasses.dataclass
class Started:
    """The agents this test started and every process they started."""

    agents: list[int] = dataclasses.field(default_factory=list)
    procs: list[psutil.Process] = dataclasses.field(default_factory=list)


@pytest.fixture
def started() -> Iterator[Started]:
    """Kills what is left and removes the agents' sockets, whatever the test did (an orphan
    is no longer our child, so the leak check would miss it)."""
    record = Started()
    yield record
    for proc in record.procs:
        with contextlib.suppress(psutil.Error):  # psutil will not kill a reused pid
            proc.kill()
    user = getpass.getuser()
    for pid in record.agents:
        for sock in (
            *Path("/tmp").glob(f"dlrover-hpc-{user}-agent{pid}-zygote.sock"),
            *Path("/tmp").glob(f"dlrover-hpc-{user}-standalone-{pid}-*.sock"),
        ):
            sock.unlink(missing_ok=True)
    # The workers' progress records of a SIGKILLed agent: the next agent on the node sweeps.
    sweep_stale()
    left = [
        p.name
        for p in Path("/dev/shm").glob(f"dlrover-hpc-{user}-*.progress*")
        if any(f"-a{pid}-" in p.name for pid in record.agents)
    ]
    assert not left, left


def _start(tmp_path: Path, path: str, started: Started) -> subprocess.Popen[bytes]:
    script = tmp_path / "worker.py"
    script.write_text(f"#!{sys.executable}\n{SCRIPT}")
    script.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    with open(tmp_path / "agent.log", "wb") as log:
        proc = subprocess.Popen(
            [
                str(BIN / "dlrover-run"),
                "--standalone",
                "--nproc-per-node=2",
                "--max-restarts=5",
                f"--job-dir={tmp_path / 'job'}",
                *PATHS[path],
                str(script),
                str(out),
                path,
            ],
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    started.agents.append(proc.pid)
    started.procs.append(psutil.Process(proc.pid))
    return proc


def _wait_for_workers(tmp_path: Path, proc: subprocess.Popen[bytes]) -> tuple[list[dict], dict]:
    """Both workers' own reports, and the agent's ``workers_started`` event for them."""

    def running() -> tuple[list[dict], dict] | None:
        if proc.poll() is not None:
            log = (tmp_path / "agent.log").read_text()[-3000:]
            raise AssertionError(f"dlrover-run exited with {proc.returncode}:\n{log}")
        files = [tmp_path / "out" / f"w{rank}.json" for rank in (0, 1)]
        if not all(f.exists() for f in files):
            return None
        with contextlib.suppress(json.JSONDecodeError):  # written, not yet complete
            workers = [json.loads(f.read_text()) for f in files]
            restart = workers[0]["restart"]
            for ev in named(events(tmp_path / "job"), "workers_started"):
                if ev["restart_count"] == restart:
                    return workers, ev
        return None

    return wait_for(running, timeout_s=90, what="both workers to run", interval_s=0.1)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_sigkilled_agent_takes_zygote_and_workers_along(
    tmp_path: Path, path: str, started: Started
) -> None:
    proc = _start(tmp_path, path, started)
    workers, event = _wait_for_workers(tmp_path, proc)
    agent = psutil.Process(proc.pid)  # the console script runs the agent itself, no re-exec
    tree = {p.pid: p for p in agent.children(recursive=True)}
    started.procs += tree.values()
    # Its forked children have the same command line: the zygote is the agent's child.
    zygotes = [p.pid for p in agent.children() if "zygote serve" in " ".join(p.cmdline())]
    expected = {*event["pids"], *(w["pid"] for w in workers), *zygotes}
    assert expected <= tree.keys(), (expected, tree)
    if path == "zygote":
        assert len(zygotes) == 1
        assert {w["ppid"] for w in workers} == set(zygotes)  # forked by the zygote
    else:
        assert {w["pid"] for w in workers} == set(event["pids"])  # the shim exec'd them

    proc.kill()
    assert proc.wait(10) == -signal.SIGKILL

    def left() -> list[str]:
        return [alive for p in tree.values() if (alive := _alive(p))]

    with contextlib.suppress(TimeoutError):
        wait_for(lambda: not left(), timeout_s=10, what="the orphans to die")
    assert not left(), f"outlived their SIGKILLed agent: {left()}"


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_stopped_agent_still_sends_sigterm_first(
    tmp_path: Path, path: str, started: Started
) -> None:
    """The normal shutdown is unchanged: the workers get SIGTERM (and their grace)."""
    started_at = time.time() - 1  # the file system's clock may be coarser
    proc = _start(tmp_path, path, started)
    _wait_for_workers(tmp_path, proc)
    tree = psutil.Process(proc.pid).children(recursive=True)
    started.procs += tree
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 143
    assert sorted(p.name for p in (tmp_path / "out").glob("term*")) == ["term0", "term1"]
    assert not [alive for p in tree if (alive := _alive(p))]
    # Its own socket is gone; one of an earlier agent SIGKILLed with this pid may remain (cc52).
    sockets = Path("/tmp").glob(f"dlrover-hpc-*-agent{proc.pid}-zygote.sock")
    assert not [s for s in sockets if s.lstat().st_mtime >= started_at]
