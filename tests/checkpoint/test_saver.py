"""The agent-side saver (SaverHost) with real workers over its Unix socket."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dlrover_hpc.checkpoint import DdpCheckpointer, LocalCommitCoordinator, SaverHost, StorageType
from dlrover_hpc.checkpoint.env import WorkerEnv
from dlrover_hpc.checkpoint.event_sinks import ListEventSink
from dlrover_hpc.checkpoint.saver.worker_protocol import recv_frame, send_frame
from dlrover_hpc.checkpoint.testing import (
    check_filled,
    filled_state,
    job_segments,
    remove_job_segments,
)

pytestmark = pytest.mark.timeout(180)
REPO = Path(__file__).resolve().parents[2]

WORKER = """
import json, os, sys, time
sys.path.insert(0, {repo!r})
from dlrover_hpc.checkpoint import RankCheckpointer, StorageType
from dlrover_hpc.checkpoint.testing import check_filled, filled_state
rank = int(os.environ["RANK"])
ckpt = RankCheckpointer({ckpt_dir!r})
state = ckpt.load_checkpoint()
start = state["step"] // 10 if state else 0
if state:
    check_filled(state, start * 10 + rank)
print(json.dumps({{"restored": ckpt.last_restored}}), flush=True)
for step in range(start + 1, start + 5):
    kind = StorageType.DISK if step == start + 2 else StorageType.MEMORY
    assert ckpt.save_checkpoint(step, filled_state(step * 10 + rank), storage_type=kind)
assert ckpt.wait_latest_checkpoint(60)
print(json.dumps({{"ready": start + 4}}), flush=True)
time.sleep(120)
"""


@pytest.fixture
def host(tmp_path: Path) -> Iterator[SaverHost]:
    job = f"s{uuid.uuid4().hex[:10]}"
    saver = SaverHost(
        job_id=job,
        node_name="nodeA",
        socket_path=str(tmp_path / "sock" / "saver.sock"),
        commit=LocalCommitCoordinator(),
        events=ListEventSink(),
    )
    saver.start()
    yield saver
    saver.close()
    left = remove_job_segments(job)
    assert not left, f"SaverHost.close left segments: {left}"


def _worker_env(host: SaverHost, rank: int, world: int) -> dict[str, str]:
    return {
        **os.environ,
        "DLROVER_HPC_SAVER_SOCKET": host.socket_path,
        "DLROVER_HPC_JOB_ID": host.job_id,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "OMP_NUM_THREADS": "1",
    }


def _start_workers(host: SaverHost, script: Path, world: int) -> list[subprocess.Popen[str]]:
    return [
        subprocess.Popen(
            [sys.executable, str(script)],
            env=_worker_env(host, r, world),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]


def _read_json(proc: subprocess.Popen[str], key: str) -> object:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("{"):
            data = json.loads(line)
            if key in data:
                return data[key]
    raise AssertionError(
        f"worker exited without {key!r}: {proc.wait()} {proc.stderr.read()[-3000:]}"
    )  # type: ignore[union-attr]


def _kill(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
    for p in procs:
        p.wait(timeout=30)
        for stream in (p.stdout, p.stderr):
            if stream is not None:
                stream.close()


def test_agent_persists_the_newest_memory_step_after_workers_are_killed(
    tmp_path: Path, host: SaverHost
) -> None:
    ckpt_dir = tmp_path / "ckpt"
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(repo=str(REPO), ckpt_dir=str(ckpt_dir)))

    procs = _start_workers(host, script, world=2)
    try:
        assert [_read_json(p, "restored") for p in procs] == [None, None]
        assert [_read_json(p, "ready") for p in procs] == [4, 4]
    finally:
        _kill(procs)  # both workers die with steps 3 and 4 in memory only
    assert (ckpt_dir / "dlrover_latest.txt").read_text() == "2\n"
    assert len(host.segments()) == 4  # two ranks, two buffers: they outlived the workers

    assert host.persist_latest(timeout_s=60) == 4  # before the workers restart
    assert (ckpt_dir / "dlrover_latest.txt").read_text() == "4\n"
    for rank in range(2):
        check_filled(torch.load(ckpt_dir / "checkpoint-4" / f"rank_{rank:05d}.pt"), 40 + rank)
    assert host.persist_latest(timeout_s=10) is None  # nothing newer left

    procs = _start_workers(host, script, world=2)
    try:
        assert [_read_json(p, "restored") for p in procs] == [[4, "memory"], [4, "memory"]]
        assert [_read_json(p, "ready") for p in procs] == [8, 8]
    finally:
        _kill(procs)
    events = host.core._events
    assert isinstance(events, ListEventSink)
    persisted = {e["step"] for e in events.named("checkpoint_persisted") if e["committed"]}
    assert {2, 4, 6} <= persisted
    assert all(e["node"] == "nodeA" for e in events.named("checkpoint_persisted"))


def test_socket_protocol_answers_errors_instead_of_success(host: SaverHost) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(host.socket_path)
        send_frame(sock, {"v": 1, "id": 1, "type": "ping"})
        assert recv_frame(sock) == {"v": 1, "id": 1, "ok": True}
        send_frame(sock, {"v": 1, "id": 2, "type": "format-disk"})
        reply = recv_frame(sock)
        assert reply is not None and not reply["ok"] and "unknown request type" in reply["error"]
        send_frame(
            sock, {"v": 1, "id": 3, "type": "saved", "segment": "../../etc/passwd", "step": 1}
        )
        reply = recv_frame(sock)
        assert reply is not None and not reply["ok"] and "does not belong" in reply["error"]
        send_frame(sock, {"v": 1, "id": 4, "type": "hello", "rank": 0, "local_rank": 0, "pid": 1})
        reply = recv_frame(sock)
        assert (
            reply is not None and reply["prefix"] == host.prefix and reply["job_id"] == host.job_id
        )
    assert oct(os.stat(host.socket_path).st_mode & 0o777) == "0o600"


def test_close_finishes_inflight_persists_then_removes_segments(tmp_path: Path) -> None:
    job = f"c{uuid.uuid4().hex[:10]}"

    def slow(point: str) -> None:
        if point == "persist:start":
            time.sleep(0.5)

    host = SaverHost(
        job_id=job,
        node_name="n1",
        socket_path=str(tmp_path / "saver.sock"),
        commit=LocalCommitCoordinator(),
        events=None,
        fault=slow,
    )
    host.start()
    env = WorkerEnv.from_environ(
        {"DLROVER_HPC_SAVER_SOCKET": host.socket_path, "DLROVER_HPC_JOB_ID": job}
    )
    ckpt = DdpCheckpointer(str(tmp_path / "ck"), env=env)
    try:
        assert not ckpt.engine.link.in_process
        assert ckpt.save_checkpoint(7, filled_state(7), storage_type=StorageType.DISK)
        ckpt.close()  # a worker leaves its segments to the agent
        assert len(job_segments(job)) == 2
    finally:
        host.close()
    check_filled(torch.load(tmp_path / "ck" / "checkpoint-7.pt"), 7)
    assert job_segments(job) == [] and not os.path.exists(host.socket_path)


NO_TORCH = """
import importlib, pkgutil, sys
sys.modules["torch"] = None  # any import of torch now fails
import dlrover_hpc.checkpoint.saver as saver
names = [f"dlrover_hpc.checkpoint.saver.{m.name}" for m in pkgutil.iter_modules(saver.__path__)]
shared = ["api", "env", "event_sinks", "formats", "formats.zip_archive"]
for name in [*names, *(f"dlrover_hpc.checkpoint.{n}" for n in shared), "dlrover_hpc.events"]:
    importlib.import_module(name)
from dlrover_hpc.checkpoint import CommitCounter, SaverHost
from dlrover_hpc.checkpoint.saver.host import SaverHost as Host
assert SaverHost is Host and CommitCounter is not None
print(len(names))
"""


def test_saver_side_imports_without_torch() -> None:
    """The agent hosts the saver without paying for torch: no saver module imports it."""
    proc = subprocess.run(
        [sys.executable, "-c", NO_TORCH],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.strip()) >= 9  # every module of the saver package was imported


def _run_saves(tmp_path: Path, host: SaverHost, world: int) -> list[dict]:
    """Two real workers save steps 1-4 through ``host``; the lines their own sinks wrote."""
    job_dir = tmp_path / "job"
    job_dir.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(repo=str(REPO), ckpt_dir=str(tmp_path / "ckpt")))
    env = {"DLROVER_HPC_JOB_DIR": str(job_dir), "DLROVER_HPC_NODE_NAME": "nodeA"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env={**_worker_env(host, r, world), **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    try:
        assert [_read_json(p, "ready") for p in procs] == [4] * world
    finally:
        _kill(procs)
    path = job_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_the_saver_writes_one_checkpoint_saved_per_node_and_step(tmp_path: Path) -> None:
    """Issue 29: the ranks of a node report their saves to its saver, which writes one line
    per step (not one per rank); a saver that does not, and the ranks write their own."""
    for aggregated in (True, False):
        job, sink = f"s{uuid.uuid4().hex[:10]}", ListEventSink()
        host = SaverHost(
            job_id=job,
            node_name="nodeA",
            socket_path=str(tmp_path / f"{aggregated}.sock"),
            commit=LocalCommitCoordinator(),
            events=ListEventSink(),
            saved_events=sink if aggregated else None,
        )
        host.start()
        try:
            own = [
                e
                for e in _run_saves(tmp_path / str(aggregated), host, 2)
                if e["event"] == "checkpoint_saved"
            ]
        finally:
            host.close()
            remove_job_segments(job)
        lines = sink.named("checkpoint_saved") + own
        if aggregated:
            assert own == []  # no rank wrote its own
            assert [(e["step"], e["ranks"]) for e in lines] == [(s, [0, 1]) for s in range(1, 5)]
            assert [e["storage"] for e in lines] == ["memory", "disk", "memory", "memory"]
            assert all(e["blocking_s"] >= e["blocking_median_s"] > 0 for e in lines)
        else:
            assert sorted((e["step"], e["rank"]) for e in lines) == [
                (s, r) for s in range(1, 5) for r in range(2)
            ]
