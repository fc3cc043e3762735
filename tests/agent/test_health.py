"""Health before joining: the pure verdicts (tables), and the readings against real files,
real processes and a fake NVML object (no GPU here)."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from dlrover_hpc.agent import health
from dlrover_hpc.agent import health_rules as rules
from dlrover_hpc.agent.health_rules import Check, Gpu, GpuFacts, Status
from dlrover_hpc.checkpoint.env import segment_name
from dlrover_hpc.checkpoint.saver.segments import Segment
from dlrover_hpc.errors import ConfigError

MiB = 2**20
OK, FAILED, SKIPPED = Status.OK, Status.FAILED, Status.SKIPPED


# ------------------------------------------------------------------ the pure verdicts
@pytest.mark.parametrize(
    ("free", "size", "resident", "error", "status", "says"),
    [
        (100 * MiB, 0, 0, "", SKIPPED, "no checkpoint size known yet"),
        (100 * MiB, 64 * MiB, 0, "", OK, ""),
        (64 * MiB, 64 * MiB, 0, "", OK, ""),  # exactly enough
        (10 * MiB, 64 * MiB, 0, "", FAILED, "10.0 MiB free, the checkpoint needs 64.0 MiB more"),
        (10 * MiB, 64 * MiB, 60 * MiB, "", OK, ""),  # its segments are already there
        (1 * MiB, 64 * MiB, 60 * MiB, "", FAILED, "needs 4.0 MiB more (64.0 MiB in all)"),
        (None, 64 * MiB, 0, "", FAILED, "unknown free"),
        (None, 0, 0, "No such file or directory", FAILED, "/dev/shm: No such file"),
    ],
)
def test_shm(
    free: int | None, size: int, resident: int, error: str, status: Status, says: str
) -> None:
    r = rules.shm(
        path="/dev/shm",
        free_bytes=free,
        checkpoint_bytes=size,
        resident_bytes=resident,
        error=error,
    )
    assert (r.check, r.status) == (Check.SHM, status)
    assert says in r.reason


@pytest.mark.parametrize(
    ("directory", "fsync_s", "error", "status", "says"),
    [
        ("", None, "", SKIPPED, "no checkpoint directory known yet"),
        ("/ckpt", 0.004, "", OK, ""),
        ("/ckpt", 1.99, "", OK, ""),
        ("/ckpt", 2.5, "", FAILED, "took 2.50 s, over the 2 s bound"),
        ("/ckpt", None, "", FAILED, "did not finish, over the 2 s bound"),
        ("/ckpt", None, "Read-only file system", FAILED, "/ckpt is not writable: Read-only"),
    ],
)
def test_storage(
    directory: str, fsync_s: float | None, error: str, status: Status, says: str
) -> None:
    r = rules.storage(directory=directory, fsync_s=fsync_s, error=error)
    assert (r.check, r.status) == (Check.STORAGE, status)
    assert says in r.reason


@pytest.mark.parametrize(
    ("master_time", "sent", "received", "status", "says"),
    [
        (None, 0.0, 0.0, SKIPPED, "older master"),
        (1000.0, 999.99, 1000.01, OK, ""),
        (1004.9, 1000.0, 1000.0, OK, ""),  # within 5 s
        (1006.0, 1000.0, 1000.0, FAILED, "6.0 s behind the master's"),
        (994.0, 1000.0, 1000.0, FAILED, "6.0 s ahead of the master's"),
        # 6 s off at the midpoint, but a 4 s round trip leaves it within 5 s + 2 s
        (1008.0, 1000.0, 1004.0, OK, ""),
    ],
)
def test_clock(
    master_time: float | None, sent: float, received: float, status: Status, says: str
) -> None:
    r = rules.clock(
        master_time=master_time, sent=sent, received=received, why_unknown="older master"
    )
    assert (r.check, r.status) == (Check.CLOCK, status)
    assert says in r.reason


def _gpus(n: int, **bad: Any) -> GpuFacts:
    return GpuFacts(gpus=tuple(Gpu(index=i, **(bad if i == n - 1 else {})) for i in range(n)))


@pytest.mark.parametrize(
    ("facts", "expected", "status", "says"),
    [
        (None, 0, SKIPPED, "nvidia-ml-py"),
        (GpuFacts(gpus=()), 4, SKIPPED, "no GPUs"),
        (_gpus(4), 4, OK, ""),
        (_gpus(8), 0, OK, ""),  # no count expected: any number
        (_gpus(3), 4, FAILED, "3 GPU(s) found, the job expects 4"),
        (_gpus(4, uncorrected_ecc=2), 4, FAILED, "GPU 3: 2 uncorrectable ECC error(s)"),
        (_gpus(2, retired_pending=True), 2, FAILED, "GPU 1: a retired page pending a reset"),
        (_gpus(2, remap_failed=True), 2, FAILED, "a failed row remap"),
        (_gpus(2, remap_pending=True), 2, FAILED, "a row remap pending a reset"),
        (_gpus(2, xids=(79, 48)), 2, FAILED, "GPU 1: XID 79, 48"),
    ],
)
def test_gpu(facts: GpuFacts | None, expected: int, status: Status, says: str) -> None:
    r = rules.gpu(facts, expected=expected, why_unknown="nvidia-ml-py is not installed")
    assert (r.check, r.status) == (Check.GPU, status)
    assert says in r.reason


@pytest.mark.parametrize(
    ("returncode", "stdout", "stderr", "error", "status", "reason"),
    [
        (0, "", "", "", OK, ""),
        (0, "all fine\n", "", "", OK, ""),
        (1, "\n  ERROR: nhc: disk full\nmore\n", "", "", FAILED, "ERROR: nhc: disk full"),
        (1, "", "ERROR: from stderr\n", "", FAILED, "ERROR: from stderr"),
        (3, "", "", "", FAILED, "nhc: exit 3, no output"),
        (-9, "", "", "", FAILED, "nhc: killed by signal 9, no output"),
        (None, "", "", "", FAILED, "nhc did not finish within 60 s"),
        (-1, "", "", "Permission denied", FAILED, "nhc: Permission denied"),
    ],
)
def test_program(
    returncode: int | None, stdout: str, stderr: str, error: str, status: Status, reason: str
) -> None:
    r = rules.program(
        argv=("nhc",),
        returncode=returncode,
        stdout=stdout,
        stderr=stderr,
        timeout_s=60,
        error=error,
    )
    assert (r.check, r.status, r.reason) == (Check.PROGRAM, status, reason)


@pytest.mark.parametrize(
    ("statuses", "first"),
    [
        ((), None),
        ((OK, SKIPPED, OK), None),
        ((OK, FAILED, FAILED), 1),
        ((FAILED, OK), 0),
    ],
)
def test_verdict_is_the_first_failed_check(statuses: tuple[Status, ...], first: int | None) -> None:
    results = [
        rules.CheckResult(check=check, status=s, reason=f"r{i}")
        for i, (check, s) in enumerate(zip(Check, statuses, strict=False))
    ]
    bad = rules.verdict(results)
    assert (bad.reason if bad else None) == (f"r{first}" if first is not None else None)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, 0),
        ({"SLURM_GPUS_ON_NODE": "8"}, 8),
        ({"SLURM_GPUS_ON_NODE": "x", "CUDA_VISIBLE_DEVICES": "0,1"}, 2),
        ({"CUDA_VISIBLE_DEVICES": ""}, 0),
        ({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 4),
    ],
)
def test_expected_gpus(env: dict[str, str], expected: int) -> None:
    assert health.expected_gpus(env) == expected


# ------------------------------------------------------------------ a fake NVML object
class FakeNvml:
    """The few pynvml calls the check makes, answering from a table."""

    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_FEATURE_ENABLED = 1
    nvmlEventTypeXidCriticalError = 8

    class NVMLError(Exception):
        pass

    def __init__(self, devices: list[dict[str, Any]], xids: list[tuple[int, int]] = ()) -> None:  # type: ignore[assignment]
        self.devices, self.xids, self.shut = devices, list(xids), False

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetIndex(self, h: int) -> int:
        return h

    def _get(self, h: int, key: str) -> Any:
        value = self.devices[h].get(key)
        if value is None:
            raise self.NVMLError("Not Supported")
        return value

    def nvmlDeviceGetTotalEccErrors(self, h: int, kind: int, counter: int) -> int:
        assert (kind, counter) == (1, 0)
        return int(self._get(h, "ecc"))

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: int) -> int:
        return int(self._get(h, "retired"))

    def nvmlDeviceGetRemappedRows(self, h: int) -> tuple[int, int, int, int]:
        return tuple(self._get(h, "remap"))  # type: ignore[return-value]

    def nvmlEventSetCreate(self) -> str:
        return "set"

    def nvmlDeviceRegisterEvents(self, h: int, kind: int, events: str) -> None:
        assert kind == 8

    def nvmlEventSetWait(self, events: str, ms: int) -> Any:
        if not self.xids:
            raise self.NVMLError("Timeout")
        device, xid = self.xids.pop(0)
        return type("Data", (), {"device": device, "eventData": xid})()

    def nvmlEventSetFree(self, events: str) -> None:
        pass


@pytest.mark.parametrize(
    ("devices", "xids", "status", "says"),
    [
        ([{"ecc": 0, "retired": 0, "remap": (0, 0, 0, 0)}] * 2, [], OK, ""),
        ([{}, {}], [], OK, ""),  # nothing supported (consumer GPUs): nothing wrong
        ([{"ecc": 0}, {"ecc": 5}], [], FAILED, "GPU 1: 5 uncorrectable ECC error(s)"),
        ([{"retired": 1}, {}], [], FAILED, "GPU 0: a retired page pending"),
        ([{}, {"remap": (0, 1, 0, 1)}], [], FAILED, "GPU 1: a failed row remap"),
        ([{}, {}], [(1, 79)], FAILED, "GPU 1: XID 79"),
        ([], [], SKIPPED, "no GPUs"),
    ],
)
def test_fake_nvml(
    devices: list[dict[str, Any]], xids: list[tuple[int, int]], status: Status, says: str
) -> None:
    nvml = FakeNvml(devices, xids)
    r = rules.gpu(health.read_gpus(nvml, xid_wait_ms=50), expected=len(devices))
    assert (r.status, nvml.shut) == (status, True)
    assert says in r.reason


def test_nvml_missing_is_skipped() -> None:
    r = asyncio.run(health.gpu_reading(0, 1.0, lambda: (None, "nvidia-ml-py is not installed")))
    assert (r.status, r.reason) == (SKIPPED, "nvidia-ml-py is not installed")


# ------------------------------------------------------------------ real files, processes
def test_storage_probe_writes_fsyncs_and_removes(tmp_path: Path) -> None:
    r = asyncio.run(health.storage_reading(str(tmp_path), "node1", 5.0))
    assert r.status is OK
    assert list(tmp_path.iterdir()) == []  # nothing left behind


def test_storage_probe_of_a_directory_not_made_yet_writes_where_the_saver_will(
    tmp_path: Path,
) -> None:
    """A job that has saved only to memory has no checkpoint directory yet (the saver makes
    it at the first persist): its nearest existing ancestor is probed, nothing is made or left
    behind.  (Failing here drained every survivor of a requeued job that never persisted.)"""
    r = asyncio.run(health.storage_reading(str(tmp_path / "ck" / "run1"), "node1", 5.0))
    assert r.status is OK, r
    assert list(tmp_path.iterdir()) == []


def test_storage_probe_under_a_file_fails(tmp_path: Path) -> None:
    (tmp_path / "ck").write_text("a file where the checkpoint directory should be")
    r = asyncio.run(health.storage_reading(str(tmp_path / "ck" / "run1"), "node1", 5.0))
    assert r.status is FAILED
    assert "is not writable: Not a directory" in r.reason


def test_storage_probe_that_hangs_fails_at_its_bound() -> None:
    async def hung() -> tuple[object, bool]:
        return await health.in_thread(lambda: time.sleep(5), 0.2)

    began = time.monotonic()
    assert asyncio.run(hung()) == (None, False)
    assert time.monotonic() - began < 3


def test_shm_counts_both_buffers_of_every_rank(tmp_path: Path) -> None:
    prefix = "dlrover-hpc-u-j-n-"
    for rank in (0, 1):
        path = tmp_path / segment_name(prefix, rank=rank, buffer=0)
        path.write_bytes(b"\1" * 8192)  # resident
    (tmp_path / "dlrover-hpc-u-other-n-r0-a").write_bytes(b"\1" * 8192)  # not this job's
    usage = health.shm_usage(str(tmp_path), prefix)
    assert (usage.checkpoint_bytes, usage.resident_bytes) == (2 * 2 * 8192, 2 * 8192)
    assert usage.ckpt_dirs == ()  # no complete step in them
    node = health.NodeHealth(node="n", shm_dir=str(tmp_path))
    assert asyncio.run(node.shm(prefix)).status is OK
    assert node.checkpoint_bytes == 4 * 8192
    # the segments gone (a cleanup): the node still knows how much it needs
    assert asyncio.run(node.shm("dlrover-hpc-u-j-n-gone-")).status is OK
    assert node.checkpoint_bytes == 4 * 8192


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "nhc.sh"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.mark.parametrize(
    ("body", "timeout_s", "status", "reason"),
    [
        ("exit 0\n", 10, OK, ""),
        ('echo "ERROR: fake nhc failure on $(hostname)"; exit 1\n', 10, FAILED, "ERROR: fake"),
        ("echo oops >&2; exit 7\n", 10, FAILED, "oops"),
        ("sleep 30\n", 0.5, FAILED, "did not finish within 0.5 s"),
    ],
)
def test_site_program(
    tmp_path: Path, body: str, timeout_s: float, status: Status, reason: str
) -> None:
    argv = (_script(tmp_path, body),)
    began = time.monotonic()
    r = asyncio.run(health.run_program(argv, timeout_s))
    assert r.status is status
    assert reason in r.reason
    assert time.monotonic() - began < 8


def test_check_program_at_start(tmp_path: Path) -> None:
    health.check_program("")
    health.check_program("/bin/true")
    health.check_program("true --some-arg")
    plain = tmp_path / "plain.sh"
    plain.write_text("exit 0\n")
    with pytest.raises(ConfigError, match="no such program 'no-such-nhc-xyz'"):
        health.check_program("no-such-nhc-xyz -v")
    with pytest.raises(ConfigError, match="is not executable"):
        if os.geteuid() == 0:  # root may execute any file with an x bit: take them all away
            plain.chmod(0o644)
        health.check_program(str(plain))


def test_node_health_runs_every_check(tmp_path: Path) -> None:
    async def master_clock() -> tuple[float | None, str]:
        return time.time() + 30.0, ""  # the master's clock is 30 s ahead

    node = health.NodeHealth(
        node="n",
        program=_script(tmp_path, "exit 0\n"),
        shm_dir=str(tmp_path),
        nvml_loader=lambda: (None, "nvidia-ml-py (pynvml) is not installed"),
    )
    results = asyncio.run(node.check(ckpt_dirs=[str(tmp_path)], master_clock=master_clock))
    assert [(r.check, r.status) for r in results] == [
        (Check.SHM, SKIPPED),
        (Check.STORAGE, OK),
        (Check.CLOCK, FAILED),
        (Check.GPU, SKIPPED),
        (Check.PROGRAM, OK),
    ]
    bad = rules.verdict(results)
    assert bad is not None and "30.0 s behind the master's" in bad.reason
    assert all(r.ms > 0 for r in results)


def test_a_segments_step_names_its_checkpoint_directory(tmp_path: Path) -> None:
    """A DDP rank other than 0 never persists, so its node's saver knows no directory: the
    step in its segment names it (the storage check then has a directory to probe)."""
    prefix = "dlrover-hpc-u-j-n-"
    seg = Segment(str(tmp_path / segment_name(prefix, rank=3, buffer=0)), writable=True)
    try:
        seg.ensure_size(2 << 20)
        meta = json.dumps({"step": 7, "ckpt_dir": str(tmp_path / "ckpt"), "part": None})
        seg.finish_write(seq=seg.begin_write(), step=7, image_len=1024, meta=meta.encode())
    finally:
        seg.close()
    usage = health.shm_usage(str(tmp_path), prefix)
    assert usage.ckpt_dirs == (str(tmp_path / "ckpt"),)
    node = health.NodeHealth(node="n", shm_dir=str(tmp_path), nvml_loader=lambda: (None, "-"))
    (tmp_path / "ckpt").mkdir()
    results = asyncio.run(node.check(segment_prefix=prefix))
    assert [(r.check, r.status) for r in results[:2]] == [
        (Check.SHM, OK),
        (Check.STORAGE, OK),
    ]


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] in "ZX"
    except (FileNotFoundError, IndexError):
        return True


def test_a_stopped_agent_ends_the_site_program_and_its_children(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    argv = (_script(tmp_path, f"sleep 30 &\necho $! > {pidfile}\nwait\n"),)

    async def body() -> None:
        task = asyncio.create_task(health.run_program(argv, 60.0))
        deadline = time.monotonic() + 10
        while not (pidfile.exists() and pidfile.read_text().strip()):
            assert time.monotonic() < deadline, "the program did not start"
            await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(body())
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while not _gone(child):
        assert time.monotonic() < deadline, f"pid {child} still runs"
        time.sleep(0.05)
