"""Where the test suite's CPU goes (issue 30): per test file and per kind of process.

On a 2-core machine the suite side by side is bound by its CPU, so cutting its time means
cutting core-seconds. This runs a pytest command (by default the one ``make test`` runs, without
the lint) and samples every process on the machine once a second: its user+system time, charged
to the test whose ``PYTEST_CURRENT_TEST`` is in the process's environment (a job's processes
inherit it through sbatch, the agents' zygotes and workers through the agent; processes started
over SSH, and pytest's own workers, are charged to ``?``), and to a kind (the pre-warmed
interpreters, agents, masters, probes, Slurm, pytest ...; a worker forked from an interpreter
shows its own script, as a torchrun worker does, and counts as ``other``).

The baseline in the same run is the machine's own count (``/proc/stat``): how many of its core-
seconds the sampling saw, and how busy the cores were.

Prints one JSON line: wall time, core-seconds (machine and sampled), the cores' busy share, the
costliest test files, kinds of process, and kinds of process per test file.  As root, also each
test file's exact CPU (``exact_by_file``: CPU s, wall s, tests) from a cpuacct cgroup per test
worker (``tests/harness/cpu_profile.py``), which short-lived processes, never seen by a sample,
and processes started over SSH do not escape.

    python benchmarks/suite_cpu.py                       # the whole suite, 4 workers
    python benchmarks/suite_cpu.py -- -n 2 tests/runtime/test_slurm_jobs.py
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from harness import cpu_profile  # noqa: E402

HZ = os.sysconf("SC_CLK_TCK")
KINDS = (
    ("zygote serve", "pre-warmed interpreters and their workers"),
    ("zygote client", "worker clients"),
    ("dlrover-run", "agents"),
    ("dlrover-hpc master", "masters"),
    ("netcheck", "network-check probes"),
    ("pytest", "pytest and the tests' own processes"),
    ("slurm", "Slurm"),
    ("sshd", "sshd"),
)


def _kind(cmdline: str) -> str:
    for needle, kind in KINDS:
        if needle in cmdline:
            return kind
    return "other"


def _machine_ticks() -> int:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields[:3]) + fields[5] + fields[6]  # user nice system irq softirq


class Sampler:
    """Charges every process's new CPU ticks, once a second, to its test and its kind."""

    def __init__(self) -> None:
        self.by_file: collections.Counter[str] = collections.Counter()
        self.by_kind: collections.Counter[str] = collections.Counter()
        self.by_file_kind: collections.Counter[str] = collections.Counter()
        self._seen: dict[int, tuple[str, str, int]] = {}  # pid -> (test file, kind, ticks)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._sample(count_existing=False)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sample(count_existing=True)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self._sample(count_existing=True)

    def _sample(self, *, count_existing: bool) -> None:
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            pid = int(name)
            try:
                with open(f"/proc/{pid}/stat") as f:
                    stat = f.read()
                rest = stat[stat.rfind(")") + 2 :].split()
                ticks = int(rest[11]) + int(rest[12])
                if pid not in self._seen:
                    self._seen[pid] = (*self._identify(pid, stat), 0 if count_existing else ticks)
                test, kind, before = self._seen[pid]
            except (OSError, IndexError, ValueError):
                continue  # it ended meanwhile
            self.by_file[test] += ticks - before
            self.by_kind[kind] += ticks - before
            if test != "?":
                self.by_file_kind[f"{test} {kind}"] += ticks - before
            self._seen[pid] = (test, kind, ticks)

    @staticmethod
    def _identify(pid: int, stat: str) -> tuple[str, str]:
        test = "?"
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                for entry in f.read().split(b"\0"):
                    if entry.startswith(b"PYTEST_CURRENT_TEST="):
                        test = entry.split(b"=", 1)[1].decode(errors="replace").split("::")[0]
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            cmdline = ""
        return test, _kind(cmdline or stat[stat.find("(") + 1 : stat.rfind(")")])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=12, help="test files to list")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments")
    args = parser.parse_args()
    pytest_args = args.pytest_args or ["-n", "4", "--dist", "loadgroup", "tests"]
    exact = Path(tempfile.mkdtemp(prefix="suite-cpu-")) if cpu_profile.available() else None
    env, plugin = dict(os.environ), []
    if exact is not None:
        env[cpu_profile.ENV] = str(exact)
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(REPO / "tests"), env.get("PYTHONPATH")])
        )
        plugin = ["-p", "harness.cpu_profile"]
    sampler = Sampler()
    machine0, wall0 = _machine_ticks(), time.monotonic()
    sampler.start()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin, *pytest_args],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        check=False,
    )
    sampler.stop()
    wall = time.monotonic() - wall0
    machine = (_machine_ticks() - machine0) / HZ
    sampled = sum(sampler.by_file.values()) / HZ
    report: dict[str, object] = {}
    if exact is not None:
        tests, files = cpu_profile.by_file(exact)
        report["exact_cpu_s"] = round(sum(cpu for cpu, _, _ in files.values()), 1)
        report["exact_tests"] = tests
        report["exact_by_file"] = {
            name: [round(cpu, 1), round(wall, 1), n]
            for name, (cpu, wall, n) in list(files.items())[: args.top]
        }
        shutil.rmtree(exact)
    print(
        json.dumps(
            {
                "pytest_exit": proc.returncode,
                "wall_s": round(wall, 1),
                "machine_cpu_s": round(machine, 1),
                "sampled_cpu_s": round(sampled, 1),
                "busy_cores": round(machine / wall, 2),
                "cores": os.cpu_count(),
                "by_kind_s": {k: round(v / HZ, 1) for k, v in sampler.by_kind.most_common()},
                "by_file_s": {
                    k: round(v / HZ, 1) for k, v in sampler.by_file.most_common(args.top)
                },
                "by_file_and_kind_s": {
                    k: round(v / HZ, 1) for k, v in sampler.by_file_kind.most_common(args.top)
                },
                **report,
            }
        )
    )


if __name__ == "__main__":
    main()
