"""The workers' process context: streams, log layout, error files, stopping the rest."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlrover_hpc.agent.procs import (
    ERROR_FILE_ENV,
    NO_ERROR_FILE,
    LogSpec,
    ProcsResult,
    Streams,
    WorkerProcs,
    parse_streams,
)

PY = sys.executable


def _wait(procs: WorkerProcs, timeout_s: float = 30) -> ProcsResult:
    deadline = time.monotonic() + timeout_s
    while (result := procs.poll()) is None:
        assert time.monotonic() < deadline, "workers did not end"
        time.sleep(0.05)
    return result


def _env(restart: int = 0) -> dict[str, str]:
    return {"TORCHELASTIC_RUN_ID": "myrun", "TORCHELASTIC_RESTART_COUNT": str(restart)}


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0", [Streams.NONE] * 3),
        ("3", [Streams.ALL] * 3),
        ("0:1,2:2", [Streams.OUT, Streams.NONE, Streams.ERR]),
    ],
)
def test_parse_streams(value: str, expected: list[Streams]) -> None:
    assert parse_streams(value, 3) == dict(enumerate(expected))


def test_redirected_streams_land_in_torchruns_layout_and_tee_prefixes_the_console(
    tmp_path: Path,
) -> None:
    code = (
        "import os, sys\n"
        "print('out', os.environ['RANK'])\n"
        "print('err', os.environ['RANK'], file=sys.stderr)\n"
        "sys.stderr.write('no newline')\n"
    )
    script = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parents[2])!r})
from dlrover_hpc.agent.procs import LogSpec, WorkerProcs
import time
procs = WorkerProcs(
    args={{lr: [{PY!r}, "-c", {code!r}] for lr in range(2)}},
    envs={{lr: {{"RANK": str(lr), "TORCHELASTIC_RUN_ID": "myrun",
                 "TORCHELASTIC_RESTART_COUNT": "2"}} for lr in range(2)}},
    logs=LogSpec(log_dir={str(tmp_path / "logs")!r}, redirects="3", tee="0:2"),
    prefixes={{0: "[rank0]:", 1: "[rank1]:"}},
)
while (r := procs.poll()) is None:
    time.sleep(0.05)
assert not r.is_failed()
"""
    out = subprocess.run([PY, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    # Rank 0's stderr is teed with its prefix, the partial last line included; nothing else.
    assert out.stderr.splitlines() == ["[rank0]:err 0", "[rank0]:no newline"], out.stderr
    assert out.stdout == ""
    (run_dir,) = (tmp_path / "logs").iterdir()
    assert run_dir.name.startswith("myrun_")
    for lr in range(2):
        rank_dir = run_dir / "attempt_2" / str(lr)
        assert (rank_dir / "stdout.log").read_text() == f"out {lr}\n"
        assert (rank_dir / "stderr.log").read_text() == f"err {lr}\nno newline"


def test_a_failure_stops_the_others_and_reads_the_error_file(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    fails = (
        "import json, os, time, sys\n"
        f"while not os.path.exists({str(ready)!r}): time.sleep(0.02)\n"
        "json.dump({'message': {'message': 'ValueError: bad batch',"
        " 'extraInfo': {'timestamp': str(int(time.time()))}}},"
        " open(os.environ['TORCHELASTIC_ERROR_FILE'], 'w'))\n"
        "sys.exit(3)\n"
    )
    # The other ignores SIGTERM: it is killed after the grace.
    stubborn = (
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"open({str(ready)!r}, 'w').close()\ntime.sleep(60)\n"
    )
    procs = WorkerProcs(
        args={0: [PY, "-c", stubborn], 1: [PY, "-c", fails]},
        envs={0: _env(), 1: _env()},
        logs=LogSpec(log_dir=str(tmp_path), redirects="3"),
        prefixes={},
        grace_s=1.0,
    )
    pids = procs.pids()
    started = time.monotonic()
    result = _wait(procs)
    assert time.monotonic() - started < 20
    assert result.is_failed()
    failed = result.failures[1]
    assert (failed.exitcode, failed.message, failed.pid) == (3, "ValueError: bad batch", pids[1])
    assert failed.error_file.endswith("/1/error.json")
    stopped = result.failures[0]
    assert stopped.exitcode == -signal.SIGKILL and stopped.signal_name() == "SIGKILL"
    assert stopped.error_file == NO_ERROR_FILE
    assert stopped.message == f"Signal 9 (SIGKILL) received by PID {pids[0]}"


def test_all_ending_well_is_a_result_only_once_the_last_ends(tmp_path: Path) -> None:
    procs = WorkerProcs(
        args={0: [PY, "-c", "pass"], 1: [PY, "-c", "import time; time.sleep(1.5)"]},
        envs={0: _env(), 1: _env()},
        logs=LogSpec(log_dir=str(tmp_path)),
        prefixes={},
    )
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:  # rank 0 is done within this second; rank 1 is not
        assert procs.poll() is None
        time.sleep(0.1)
    result = _wait(procs)
    assert not result.is_failed()


def test_filtered_ranks_are_silent_and_each_worker_knows_its_error_file(tmp_path: Path) -> None:
    code = f"import os; print('hi'); print(os.environ[{ERROR_FILE_ENV!r}])"
    script = f"""
import sys, time
sys.path.insert(0, {str(Path(__file__).parents[2])!r})
from dlrover_hpc.agent.procs import LogSpec, WorkerProcs
procs = WorkerProcs(
    args={{lr: [{PY!r}, "-c", {code!r}] for lr in range(2)}},
    envs={{lr: {{}} for lr in range(2)}},
    logs=LogSpec(log_dir={str(tmp_path)!r}, local_ranks_filter=frozenset({{1}})),
    prefixes={{}},
)
while procs.poll() is None:
    time.sleep(0.05)
"""
    out = subprocess.run([PY, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "hi" and len(lines) == 2  # rank 0 is filtered out of the console
    assert lines[1].endswith("/attempt_0/1/error.json")


def test_a_signalled_worker_without_an_error_file(tmp_path: Path) -> None:
    procs = WorkerProcs(
        args={0: [PY, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]},
        envs={0: _env()},
        logs=LogSpec(log_dir=str(tmp_path)),
        prefixes={},
    )
    failure = _wait(procs).failures[0]
    assert failure.exitcode == -signal.SIGSEGV and failure.signal_name() == "SIGSEGV"
    assert failure.error_file == NO_ERROR_FILE
    assert failure.message == f"Signal 11 (SIGSEGV) received by PID {failure.pid}"


def test_an_exit_code_with_a_flat_error_file_or_none(tmp_path: Path) -> None:
    flat = (
        "import json, os, sys\n"
        "json.dump({'message': 'OOM in step 3', 'timestamp': '1700000000'},"
        " open(os.environ['TORCHELASTIC_ERROR_FILE'], 'w'))\n"
        "sys.exit(1)\n"
    )
    for code, log_dir, expected in (
        (flat, tmp_path / "flat", "OOM in step 3"),
        ("import sys; sys.exit(2)", tmp_path / "none", "exit code 2; no error file"),
    ):
        procs = WorkerProcs(
            args={0: [PY, "-c", code]},
            envs={0: _env()},
            logs=LogSpec(log_dir=str(log_dir)),
            prefixes={},
        )
        failure = _wait(procs).failures[0]
        assert failure.message.startswith(expected), failure
        assert (failure.timestamp == 1700000000.0) == (log_dir.name == "flat"), failure
    (error_file,) = (tmp_path / "flat").rglob("error.json")
    assert json.loads(error_file.read_text())["timestamp"] == "1700000000"


def test_workers_ended_at_exit_count_as_succeeded(tmp_path: Path) -> None:
    """The master's EndWorkers: a rank hung at exit is SIGKILLed and its end is a success;
    a worker that fails on its own still fails."""
    procs = WorkerProcs(
        args={
            0: [PY, "-c", "pass"],
            1: [PY, "-c", "import time; time.sleep(60)"],  # hangs at exit
        },
        envs={0: _env(), 1: _env()},
        logs=LogSpec(log_dir=str(tmp_path), redirects="0", tee="0"),
        prefixes={0: "", 1: ""},
    )
    hung = procs.pids()[1]
    time.sleep(0.3)
    assert procs.poll() is None  # rank 0 ended well, rank 1 runs on
    procs.end([1])
    assert _wait(procs).failures == {}
    with pytest.raises(ProcessLookupError):
        os.kill(hung, 0)
    failing = WorkerProcs(
        args={0: [PY, "-c", "import sys; sys.exit(3)"]},
        envs={0: _env()},
        logs=LogSpec(log_dir=str(tmp_path / "b"), redirects="0", tee="0"),
        prefixes={0: ""},
    )
    failing.end([])
    assert set(_wait(failing).failures) == {0}
