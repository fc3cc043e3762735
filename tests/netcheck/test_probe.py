"""The network-check probe, for real: child processes, a TCPStore and gloo on 127.0.0.1."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from harness.ports import free_port

from dlrover_hpc.netcheck.launch import run_probe_subprocess
from dlrover_hpc.netcheck.model import NetcheckError
from dlrover_hpc.netcheck.result import ProbeResult

pytestmark = pytest.mark.timeout(60)

TINY_PAYLOAD_BYTES = 4096  # tiny tensors keep the test fast
TINY_MATMUL = 32
REPO = Path(__file__).resolve().parents[2]


def probe_group(size: int, *, timeout_s: float) -> list[ProbeResult]:
    port = free_port()
    with ThreadPoolExecutor(max_workers=size) as pool:
        futures = [
            pool.submit(
                run_probe_subprocess,
                group_rank=rank,
                group_size=size,
                store_host="127.0.0.1",
                store_port=port,
                timeout_s=timeout_s,
                is_store_host=rank == 0,
                prefix=f"test/{port}",
                use_cuda=False,
                payload_bytes=TINY_PAYLOAD_BYTES,
                matmul_size=TINY_MATMUL,
            )
            for rank in range(size)
        ]
        return [f.result() for f in futures]


@pytest.mark.parametrize("size", [2, 3])
def test_group_on_localhost_passes_and_is_timed(size: int) -> None:
    results = probe_group(size, timeout_s=45.0)
    for result in results:
        assert result.ok, result.error
        assert result.device == "cpu"
        assert result.matmul_s is not None and result.matmul_s >= 0.0
        assert result.collective_s is not None and result.collective_s > 0.0
        assert result.nccl_s is None
        assert result.check_s == pytest.approx(result.matmul_s + result.collective_s)


@pytest.mark.parametrize(("rank", "is_host"), [(0, True), (1, False)])
def test_partner_that_never_shows_up_fails_within_the_timeout(rank: int, is_host: bool) -> None:
    # Long enough for the child's `import torch` on a loaded machine (tests side by side: it
    # took over 6 s once), so that the child reports its own reason before the hard kill.
    timeout_s = 15.0
    started = time.monotonic()
    result = run_probe_subprocess(
        group_rank=rank,
        group_size=2,
        store_host="127.0.0.1",
        store_port=free_port(),
        timeout_s=timeout_s,
        is_store_host=is_host,
        use_cuda=False,
        payload_bytes=TINY_PAYLOAD_BYTES,
        matmul_size=TINY_MATMUL,
    )
    took = time.monotonic() - started
    assert not result.ok
    assert result.check_s is None
    assert took <= timeout_s + 1.0, took
    # The child reports its own reason (host: no client joined; client: no host) before the
    # hard kill.
    assert result.error.startswith("store: "), result.error


def test_a_hung_probe_is_killed_at_the_deadline(tmp_path: Path) -> None:
    # A stand-in "python" that hangs, with a grandchild that must die with it.
    hang, grandchild = tmp_path / "python", tmp_path / "grandchild.pid"
    hang.write_text(f"#!/bin/sh\nsleep 60 &\necho $! > {grandchild}\nexec sleep 60\n")
    hang.chmod(hang.stat().st_mode | stat.S_IXUSR)
    started = time.monotonic()
    result = run_probe_subprocess(
        group_rank=0,
        group_size=2,
        store_host="127.0.0.1",
        store_port=free_port(),
        timeout_s=1.5,
        is_store_host=True,
        python=str(hang),
    )
    took = time.monotonic() - started
    assert not result.ok
    assert 1.4 <= took <= 3.0, took
    match = re.fullmatch(
        r"probe did not finish within 1.5 s and was killed \(pid (\d+)\)", result.error
    )
    assert match, result.error
    for pid in (int(match.group(1)), int(grandchild.read_text())):
        assert _gone(pid), f"pid {pid} survived the kill"


def _gone(pid: int) -> bool:
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.02)
    return False


def test_cli_prints_a_line_and_exits_1_on_failure() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dlrover_hpc.netcheck.probe",
            "--group-rank=1",
            "--group-size=2",
            "--store-host=127.0.0.1",
            f"--store-port={free_port()}",
            "--timeout-s=2",
            "--no-cuda",
            "--matmul-size=16",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
        check=False,
    )
    assert done.returncode == 1
    assert done.stdout.startswith("probe failed after "), done.stdout


def test_cli_rejects_bad_arguments_with_exit_2() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dlrover_hpc.netcheck.probe",
            "--group-rank=2",
            "--group-size=2",
            "--store-host=127.0.0.1",
            "--store-port=1234",
            "--timeout-s=2",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
        check=False,
    )
    assert done.returncode == 2
    assert "group_rank=2; expected 0 <= rank < 2" in done.stderr


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"group_rank": 2, "group_size": 2}, r"group_rank=2; expected 0 <= rank < 2"),
        ({"group_rank": 0, "group_size": 1}, "group_size=1; a probe group needs at least 2"),
        ({"group_rank": 0, "group_size": 2, "timeout_s": 0.0}, "timeout_s=0.0; expected a"),
        ({"group_rank": 0, "group_size": 2, "store_port": 0}, "store_port=0; expected a TCP"),
    ],
)
def test_invalid_arguments_raise(kwargs: dict[str, float], message: str) -> None:
    args: dict = {"store_host": "127.0.0.1", "store_port": 1234, "timeout_s": 5.0}
    args.update(kwargs)
    with pytest.raises(NetcheckError, match=message):
        run_probe_subprocess(is_store_host=True, **args)


def test_result_json_round_trip_and_rejects_junk() -> None:
    result = ProbeResult(ok=True, matmul_s=0.5, collective_s=0.25, nccl_s=0.25, elapsed_s=2.0)
    assert ProbeResult.from_json(result.to_json()) == result
    assert result.check_s == 1.0
    with pytest.raises(NetcheckError, match="not JSON"):
        ProbeResult.from_json("Traceback (most recent call last):")
    with pytest.raises(NetcheckError, match=r"unknown keys \['bogus'\]"):
        ProbeResult.from_json('{"ok": true, "bogus": 1}')


def test_a_killed_probe_reports_the_reason_it_logged_before_the_kill() -> None:
    """On a loaded machine a probe can fail in time and still not exit in time (seen in a
    clean-clone run): its own reason, from its log line, is the error, not the kill alone."""
    from dlrover_hpc.netcheck.launch import _reported_reason

    err = (
        "2026-11-26 06:14:02,118 WARNING netcheck_probe_failed rank=1 store=127.0.0.1:58251 "
        "reason=store: DistNetworkError: The client socket has timed out after 4020ms while "
        "trying to connect to (127.0.0.1, 58251).\n"
    )
    assert _reported_reason(err).startswith("store: DistNetworkError: The client socket")
    assert _reported_reason("some other line\n") == ""
