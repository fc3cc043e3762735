"""Where the suite's CPU goes, per test, exactly: a pytest plugin (``benchmarks/suite_cpu.py``
loads it beside its sampling; ``-p harness.cpu_profile`` with ``tests`` on the path loads it alone).

On 2 cores the suite is bound by CPU, not by its tests' wall time, so what makes it shorter is
less CPU.  Each test worker moves itself into a cpuacct cgroup of its own before it starts
anything; what it starts inherits the cgroup, its local Slurm's daemons and their jobs too (the
local Slurm tracks processes with ``proctrack/linuxproc``, which moves none).  The CPU a test
costs is the cgroup's usage from its start to its end: its workers, agents, masters and
daemons, wherever they run.  Daemons that outlive a test charge their idle ticks to the test
that runs then (a few seconds in a run).

Each worker appends a JSON line per test to ``<dir>/<worker>.jsonl`` (``DLROVER_HPC_TEST_CPU``,
the directory); the controller prints the files that cost most at the end.  Root only (cgroup
v1's cpuacct, as the machine mounts it).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

ENV = "DLROVER_HPC_TEST_CPU"
CPUACCT = Path("/sys/fs/cgroup/cpuacct")
GROUP = "dlrover-hpc-tests"


class _Worker:
    def __init__(self, out_dir: Path, name: str) -> None:
        self.group = CPUACCT / GROUP / name
        self.group.mkdir(parents=True, exist_ok=True)
        (self.group / "cgroup.procs").write_text(str(os.getpid()))
        self.out: IO[str] = (out_dir / f"{name}.jsonl").open("a")

    def usage_s(self) -> float:
        return int((self.group / "cpuacct.usage").read_text()) / 1e9


_worker: _Worker | None = None


def _out_dir() -> Path:
    out = Path(os.environ[ENV])
    if not available():
        raise pytest.UsageError(
            f"{ENV}={out}: per-test CPU needs root and cgroup v1's cpuacct at {CPUACCT}; "
            f"unset {ENV} to run the tests without it"
        )
    out.mkdir(parents=True, exist_ok=True)
    return out


def _controller(config: pytest.Config) -> bool:
    """This process hands tests to xdist workers and runs none itself."""
    return not hasattr(config, "workerinput") and config.getoption("dist", "no") != "no"


def pytest_configure(config: pytest.Config) -> None:
    global _worker
    out = _out_dir()
    if not hasattr(config, "workerinput"):  # the run's own process: a fresh record
        for old in out.glob("*.jsonl"):
            old.unlink()
    if not _controller(config):
        _worker = _Worker(out, os.environ.get("PYTEST_XDIST_WORKER", "main"))


def pytest_unconfigure(config: pytest.Config) -> None:
    """The run's own process removes the cgroups once its workers are gone (a run without
    workers first moves itself back to the root group)."""
    if hasattr(config, "workerinput"):
        return
    if _worker is not None:
        (CPUACCT / "cgroup.procs").write_text(str(os.getpid()))
    for group in [*(CPUACCT / GROUP).glob("*/"), CPUACCT / GROUP]:
        with contextlib.suppress(OSError):  # a process of a worker still in it: left
            group.rmdir()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if _worker is None:
        yield
        return
    t0, c0 = time.monotonic(), _worker.usage_s()
    yield
    row = {"test": item.nodeid, "wall_s": time.monotonic() - t0, "cpu_s": _worker.usage_s() - c0}
    _worker.out.write(json.dumps(row) + "\n")
    _worker.out.flush()


def by_file(out_dir: Path) -> tuple[int, dict[str, tuple[float, float, int]]]:
    """How many tests ran, and per test file: CPU s, wall s and tests, costliest first."""
    rows = [json.loads(line) for f in out_dir.glob("*.jsonl") for line in f.open()]
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    for r in rows:
        acc = files[r["test"].split("::")[0]]
        acc[0] += r["cpu_s"]
        acc[1] += r["wall_s"]
        acc[2] += 1
    ranked = sorted(files.items(), key=lambda kv: -kv[1][0])
    return len(rows), {name: (cpu, wall, int(n)) for name, (cpu, wall, n) in ranked}


def summary(out_dir: Path, top: int = 25) -> list[str]:
    """Lines of the files that cost the most CPU, with their share of the whole run."""
    tests, files = by_file(out_dir)
    total = sum(cpu for cpu, _, _ in files.values()) or 1.0
    lines = [f"CPU of {tests} tests: {total:.0f} s (per file: CPU s, share, wall s, tests)"]
    for name, (cpu, wall, n) in list(files.items())[:top]:
        lines.append(f"{cpu:8.1f} {100 * cpu / total:5.1f} % {wall:8.1f} {n:5d}  {name}")
    return lines


def available() -> bool:
    """Whether this process can measure (root, cgroup v1's cpuacct)."""
    return os.geteuid() == 0 and (CPUACCT / "cpuacct.usage").exists()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not hasattr(terminalreporter.config, "workerinput"):
        for line in summary(Path(os.environ[ENV])):
            terminalreporter.write_line(line)
