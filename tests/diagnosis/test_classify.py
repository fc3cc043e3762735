"""Failure classification (pure, table-driven) and the evidence collectors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from dlrover_hpc.diagnosis.classify import (
    Diagnosis,
    FailureEvidence,
    FailureKind,
    classify,
    effective_signal,
    parse_error_file,
)
from dlrover_hpc.diagnosis.collect import (
    collect_evidence,
    oom_killed_pid,
    read_error_file,
    read_kernel_log,
    read_oom_kill_count,
    read_uptime_s,
    relevant_kernel_lines,
    run_quietly,
    tail_text,
)
from dlrover_hpc.errors import ConfigError

pytestmark = pytest.mark.timeout(30)

SW, HW, LOST = FailureKind.SOFTWARE, FailureKind.HARDWARE, FailureKind.NODE_LOST

NCCL_SYSTEM_ERROR = (
    "torch.distributed.DistBackendError: NCCL error in: "
    "../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, unhandled system error "
    "(run with NCCL_DEBUG=INFO for details), NCCL version 2.20.5"
)
XID_79 = (
    "[ 8123.456789] NVRM: Xid (PCI:0000:3b:00): 79, pid=4321, name=python, "
    "GPU has fallen off the bus."
)
XID_48 = "[ 9000.000001] NVRM: Xid (PCI:0000:18:00): 48, pid=77, name=python, An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 0, subpartition 0."  # noqa: E501
XID_13 = "[ 9000.1] NVRM: Xid (PCI:0000:18:00): 13, pid=77, name=python, Graphics SM Warp Exception on (GPC 1, TPC 0, SM 1): Out Of Range Address"  # noqa: E501
OOM_KERNEL = "[12345.678901] Out of memory: Killed process 4242 (python) total-vm:81234567kB, anon-rss:7654321kB, file-rss:0kB, shmem-rss:0kB, UID:1000 pgtables:20000kB oom_score_adj:0"  # noqa: E501
SLURM_OOM = (
    "slurmstepd: error: Detected 1 oom_kill event in StepId=4242.0. "
    "Some of the step tasks have been OOM Killed."
)
CUDA_OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
    "capacity of 79.15 GiB of which 1.06 GiB is free."
)
TRACEBACK = textwrap.dedent(
    """\
    Traceback (most recent call last):
      File "/home/u/train.py", line 12, in <module>
        main()
      File "/home/u/train.py", line 9, in main
        raise ValueError("bad learning rate: -1")
    ValueError: bad learning rate: -1
    """
)
ERROR_FILE = json.dumps(
    {
        "message": {
            "message": "RuntimeError: boom",
            "extraInfo": {
                "py_callstack": 'Traceback (most recent call last):\n  File "t.py", line 3\n'
                "RuntimeError: boom\n",
                "timestamp": "1700000000",
            },
        }
    }
)


@pytest.mark.parametrize(
    ("evidence", "kind", "rule"),
    [
        # Hardware: lines that name a broken GPU, link or host.
        (FailureEvidence(exit_code=1, log_tail=NCCL_SYSTEM_ERROR), HW, "nccl_system_error"),
        (
            FailureEvidence(
                exit_code=1,
                log_tail="node3:1234:1290 [0] transport.cc:154 NCCL WARN Cuda failure "
                "'unspecified launch failure'",
            ),
            HW,
            "nccl_cuda_failure",
        ),
        (FailureEvidence(signal=signal.SIGBUS, kernel_lines=(XID_79,)), HW, "gpu_xid"),
        (FailureEvidence(signal=signal.SIGSEGV, kernel_lines=(XID_48,)), HW, "gpu_xid"),
        (
            FailureEvidence(
                exit_code=1,
                log_tail="RuntimeError: CUDA error: uncorrectable ECC error encountered",
            ),
            HW,
            "gpu_ecc",
        ),
        (
            FailureEvidence(
                exit_code=1,
                log_tail="RuntimeError: No CUDA GPUs are available\n"
                "CUDA error: no CUDA-capable device is detected",
            ),
            HW,
            "gpu_lost",
        ),
        (
            FailureEvidence(
                exit_code=1,
                log_tail="n1:99:120 [3] NCCL WARN NET/IB : Got completion from peer 10.1.2.3<5501> "
                "with status=12 opcode=0 len=0 vendor err 129 (Recv) localGid ::ffff:10.1.2.4",
            ),
            HW,
            "network_fabric",
        ),
        (
            FailureEvidence(
                signal=signal.SIGBUS,
                kernel_lines=("[ 77.1] mce: [Hardware Error]: Machine check events logged",),
            ),
            HW,
            "host_hardware",
        ),
        # Software look-alikes and program errors.
        (FailureEvidence(exit_code=1, log_tail=CUDA_OOM), SW, "cuda_oom"),
        (
            FailureEvidence(exit_code=1, log_tail="NCCL WARN Cuda failure 'out of memory'"),
            SW,
            "cuda_oom",
        ),
        (
            FailureEvidence(
                exit_code=1,
                log_tail="RuntimeError: CUDA error: an illegal memory access was encountered",
            ),
            SW,
            "cuda_program_error",
        ),
        (FailureEvidence(exit_code=1, kernel_lines=(XID_13,)), SW, "gpu_app_xid"),
        # OOM: SIGKILL with evidence of the OOM killer.
        (FailureEvidence(signal=signal.SIGKILL, oom_killed=True), SW, "oom"),
        (FailureEvidence(exit_code=137, log_tail=SLURM_OOM), SW, "oom"),
        (FailureEvidence(exit_code=-9, kernel_lines=(OOM_KERNEL,)), SW, "oom"),
        # Explicit OOM evidence outranks NCCL noise, not a GPU that fell off the bus.
        (FailureEvidence(exit_code=-9, oom_killed=True, log_tail=NCCL_SYSTEM_ERROR), SW, "oom"),
        (FailureEvidence(exit_code=-9, oom_killed=True, kernel_lines=(XID_79,)), HW, "gpu_xid"),
        # Signals and exits without telling lines.
        (FailureEvidence(signal=signal.SIGKILL), SW, "killed"),
        (FailureEvidence(exit_code=-int(signal.SIGSEGV)), SW, "crash_signal"),
        (FailureEvidence(signal=signal.SIGBUS), SW, "crash_signal"),
        (FailureEvidence(exit_code=128 + int(signal.SIGTERM)), SW, "terminated"),
        (FailureEvidence(exit_code=1, error_file_text=ERROR_FILE), SW, "python_exception"),
        (FailureEvidence(exit_code=1, log_tail=TRACEBACK), SW, "python_exception"),
        (FailureEvidence(exit_code=3), SW, "exit_code"),
        (FailureEvidence(), SW, "unknown"),
        (FailureEvidence(exit_code=1, node_unreachable=True, log_tail=XID_79), LOST, "node_lost"),
        # Configured patterns.
        (
            FailureEvidence(
                exit_code=1,
                log_tail="pcieport 0000:00:01.0: AER: PCIe Bus Error: severity=Uncorrected (Fatal)",
                extra_hardware_patterns=(r"PCIe Bus Error: severity=Uncorrected",),
            ),
            HW,
            "configured_hardware",
        ),
        (
            FailureEvidence(
                exit_code=1,
                log_tail="NCCL WARN Cuda failure 'invalid argument'",
                extra_software_patterns=(r"Cuda failure 'invalid argument'",),
            ),
            SW,
            "configured_software",
        ),
    ],
)
def test_classification_table(evidence: FailureEvidence, kind: FailureKind, rule: str) -> None:
    diagnosis = classify(evidence)
    assert (diagnosis.kind, diagnosis.rule) == (kind, rule), diagnosis


# Captured from a real gloo all_reduce whose peer rank was SIGKILLed.
GLOO_PEER_CLOSED = (
    Path(__file__).parents[1] / "data" / "diagnosis" / "gloo_peer_closed.txt"
).read_text()


# Captured from a survivor of a SIGKILLed agent (local Slurm): the lost connection's exception
# unwinds, then the C++ runtime aborts ("terminate called without an active exception").
GLOO_PEER_CLOSED_ABORT = (
    Path(__file__).parents[1] / "data" / "diagnosis" / "gloo_peer_closed_abort.txt"
).read_text()


@pytest.mark.parametrize(
    "evidence,kind,rule",
    [
        (FailureEvidence(exit_code=1, log_tail=GLOO_PEER_CLOSED), FailureKind.PEER, "peer_lost"),
        (
            FailureEvidence(signal=signal.SIGABRT, log_tail=GLOO_PEER_CLOSED_ABORT),
            FailureKind.PEER,
            "peer_lost",
        ),
        # An abort with no lost peer in the log is the worker's own crash.
        (FailureEvidence(signal=signal.SIGABRT, log_tail="terminate called"), SW, "crash_signal"),
        (
            FailureEvidence(
                exit_code=1,
                log_tail="NCCL error: remote process exited or there was a network error",
            ),
            FailureKind.PEER,
            "peer_lost",
        ),
        # Killed by a signal itself: its own failure, whatever the log says.
        (FailureEvidence(signal=signal.SIGKILL, log_tail=GLOO_PEER_CLOSED), SW, "killed"),
        (FailureEvidence(signal=signal.SIGSEGV, log_tail=GLOO_PEER_CLOSED), SW, "crash_signal"),
        # A program error of its own outranks the lost peer.
        (FailureEvidence(exit_code=1, log_tail=CUDA_OOM + "\n" + GLOO_PEER_CLOSED), SW, "cuda_oom"),
    ],
)
def test_a_lost_peer_is_not_the_workers_own_failure(
    evidence: FailureEvidence, kind: FailureKind, rule: str
) -> None:
    diagnosis = classify(evidence)
    assert (diagnosis.kind, diagnosis.rule) == (kind, rule), diagnosis


def test_diagnosis_names_the_deciding_lines_and_facts() -> None:
    diagnosis = classify(
        FailureEvidence(signal=signal.SIGBUS, kernel_lines=(XID_79,), notes=("collector note",))
    )
    assert diagnosis == Diagnosis(
        kind=HW,
        rule="gpu_xid",
        reason="GPU hardware error reported as an Xid",
        evidence=(XID_79, "collector note", "signal SIGBUS (7)"),
    )


def test_python_exception_reason_quotes_the_exception() -> None:
    assert classify(FailureEvidence(exit_code=1, log_tail=TRACEBACK)).reason == (
        "the program raised ValueError: bad learning rate: -1"
    )
    assert classify(FailureEvidence(exit_code=1, error_file_text=ERROR_FILE)).reason == (
        "the program raised RuntimeError: boom"
    )


def test_sigbus_hint_mentions_shared_memory() -> None:
    reason = classify(FailureEvidence(signal=signal.SIGBUS)).reason
    assert (
        reason
        == "the worker crashed with SIGBUS (or a full /dev/shm); no hardware error was logged"
    )


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "extra_hardware_patterns",
            ("ok", "(unclosed"),
            r"extra_hardware_patterns\[1\] = '\(unclosed' is not a valid regular expression",
        ),
        (
            "extra_software_patterns",
            ("",),
            r"extra_software_patterns\[0\] = ''; expected a non-empty",
        ),
        ("kernel_lines", "one string", "kernel_lines = 'one string'; expected a list of strings"),
    ],
)
def test_bad_configured_patterns_are_rejected(
    field: str, value: Sequence[str], message: str
) -> None:
    kwargs: dict[str, Any] = {field: value}
    with pytest.raises(ConfigError, match=message):
        FailureEvidence(**kwargs)


@pytest.mark.parametrize(
    ("text", "message", "traceback", "parsed"),
    [
        (ERROR_FILE, "RuntimeError: boom", "RuntimeError: boom", True),
        ('{"message": "SIGSEGV in libfoo"}', "SIGSEGV in libfoo", "", True),
        ("not json at all\n", "not json at all", "", False),
        ("[1, 2]", "[1, 2]", "", False),
    ],
)
def test_parse_error_file(text: str, message: str, traceback: str, parsed: bool) -> None:
    info = parse_error_file(text)
    assert info.message == message
    assert traceback in info.traceback
    assert info.parsed is parsed


@pytest.mark.parametrize(
    ("exit_code", "sig", "expected"),
    [
        (-9, None, 9),
        (137, None, 9),
        (1, None, None),
        (0, None, None),
        (1, 11, 11),
        (None, None, None),
    ],
)
def test_effective_signal(exit_code: int | None, sig: int | None, expected: int | None) -> None:
    assert effective_signal(FailureEvidence(exit_code=exit_code, signal=sig)) == expected


# --- collectors --------------------------------------------------------------------------------


def test_tail_text_starts_at_a_line_boundary(tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    log.write_text("".join(f"line {i}\n" for i in range(1000)))
    tail = tail_text(log, max_bytes=100)
    assert tail.endswith("line 999\n")
    assert tail.splitlines()[0].startswith("line ")
    assert len(tail.encode()) <= 100
    assert tail_text(tmp_path / "missing.log") == ""


def test_read_error_file_from_path_or_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "error.json"
    path.write_text(ERROR_FILE)
    assert read_error_file(path) == ERROR_FILE
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    assert read_error_file() == ERROR_FILE
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
    assert read_error_file() is None
    assert read_error_file(tmp_path / "missing.json") is None


def fake_cgroups(tmp_path: Path, membership: str, files: dict[str, str]) -> tuple[Path, Path]:
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(membership)
    for rel, text in files.items():
        (cgroup / rel).parent.mkdir(parents=True, exist_ok=True)
        (cgroup / rel).write_text(text)
    return proc, cgroup


@pytest.mark.parametrize(
    ("membership", "files", "expected"),
    [
        (
            "0::/system.slice/slurmstepd.scope/job_42\n",
            {
                "system.slice/slurmstepd.scope/job_42/memory.events": (
                    "low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\noom_group_kill 0\n"
                )
            },
            2,
        ),
        (
            "4:memory:/slurm/uid_0/job_42\n2:cpuacct,cpu:/\n0::/\n",
            {
                "memory/slurm/uid_0/job_42/memory.oom_control": (
                    "oom_kill_disable 0\nunder_oom 0\noom_kill 5\n"
                )
            },
            5,
        ),
        ("0::/\n", {}, None),  # no memory.events: unreadable, not an error
    ],
)
def test_read_oom_kill_count(
    tmp_path: Path, membership: str, files: dict[str, str], expected: int | None
) -> None:
    proc, cgroup = fake_cgroups(tmp_path, membership, files)
    assert read_oom_kill_count(proc_root=proc, cgroup_root=cgroup) == expected


def test_collectors_never_fail_on_this_host(tmp_path: Path) -> None:
    count = read_oom_kill_count()
    assert count is None or count >= 0
    assert read_uptime_s() is None or read_uptime_s() > 0  # type: ignore[operator]
    assert isinstance(read_kernel_log(), list)
    assert read_oom_kill_count(proc_root=tmp_path) is None
    assert run_quietly([str(tmp_path / "no-such-binary")], timeout_s=1.0) is None
    assert run_quietly(["sh", "-c", "exit 3"], timeout_s=5.0) is None


def test_relevant_kernel_lines_keeps_this_failure_only() -> None:
    lines = [
        "[  100.000000] NVRM: Xid (PCI:0000:3b:00): 79, old and irrelevant",
        "[ 5000.000000] usb 1-1: new high-speed USB device",
        "[ 5001.000000] Out of memory: Killed process 999 (python) total-vm:1kB",
        OOM_KERNEL,  # pid 4242 at 12345.678901
        XID_79,  # at 8123.456789
    ]
    kept = relevant_kernel_lines(lines, pids={4242}, since_uptime_s=4000.0)
    assert kept == [OOM_KERNEL, XID_79]
    assert oom_killed_pid(OOM_KERNEL) == 4242
    assert (
        oom_killed_pid("[ 1.0] oom-kill:constraint=CONSTRAINT_MEMCG,task=python,pid=31,uid=0") == 31
    )
    assert oom_killed_pid(XID_79) is None


def test_collect_evidence_finds_an_oom_kill(tmp_path: Path) -> None:
    proc, cgroup = fake_cgroups(tmp_path, "0::/job\n", {"job/memory.events": "oom 1\noom_kill 1\n"})
    log = tmp_path / "worker.log"
    log.write_text("step 10 loss 2.3\n")

    def dmesg(argv: Sequence[str], *, timeout_s: float) -> str | None:
        assert list(argv) == ["dmesg"] and timeout_s > 0
        return f"[ 1.000000] booting\n{OOM_KERNEL}\n"

    evidence = collect_evidence(
        exit_code=-9,
        worker_pids={4242},
        log_path=log,
        error_file=tmp_path / "absent.json",
        oom_kills_before=0,
        since_uptime_s=10.0,
        run=dmesg,
        proc_root=proc,
        cgroup_root=cgroup,
    )
    assert evidence.oom_killed
    assert evidence.kernel_lines == (OOM_KERNEL,)
    assert evidence.notes == (
        "memory cgroup oom_kill counter rose from 0 to 1",
        "kernel log: OOM killer ended worker pid 4242",
    )
    assert evidence.log_tail == "step 10 loss 2.3\n"
    diagnosis = classify(evidence)
    assert (diagnosis.kind, diagnosis.rule) == (SW, "oom")


def test_real_worker_with_torchelastic_error_file(tmp_path: Path) -> None:
    """A real child records its exception the torchelastic way; we classify what it left."""
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """\
            from torch.distributed.elastic.multiprocessing.errors import record

            @record
            def main():
                raise RuntimeError("loss is nan at step 7")

            main()
            """
        )
    )
    error_file, log = tmp_path / "error.json", tmp_path / "worker.log"
    with open(log, "w") as out:
        done = subprocess.run(
            [sys.executable, str(script)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file)},
            timeout=25,
            check=False,
        )
    evidence = collect_evidence(
        exit_code=done.returncode,
        log_path=log,
        error_file=error_file,
        run=lambda argv, *, timeout_s: None,
    )
    assert evidence.error_file_text is not None
    diagnosis = classify(evidence)
    assert diagnosis.kind is SW
    assert diagnosis.rule == "python_exception"
    assert diagnosis.reason == "the program raised RuntimeError: loss is nan at step 7"
