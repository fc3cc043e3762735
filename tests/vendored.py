"""Public training scripts vendored under ``tests/clients/`` (each with its licence and
provenance), and how the unchanged-client matrix runs them: copied into a test's directory with
the patches of their ``PATCHES.json`` applied (CUDA-only lines made CPU ones, each checked to
occur exactly once), started by a launcher, watched line by line, one worker SIGKILLed on cue."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import psutil

CLIENTS = Path(__file__).resolve().parent / "clients"
_NOT_COPIED = {"PATCHES.json", "PROVENANCE.md", "LICENSE", "RUN.md"}


@dataclasses.dataclass(frozen=True, slots=True)
class Patch:
    file: str
    old: str
    new: str
    why: str

    def line(self) -> str:
        return f"{self.file}: {self.old.strip()!r} -> {self.new.strip()!r} ({self.why})"


def patches(name: str) -> list[Patch]:
    path = CLIENTS / name / "PATCHES.json"
    if not path.exists():
        return []
    table = json.loads(path.read_text())
    return [Patch(file, p["old"], p["new"], p["why"]) for file, ps in table.items() for p in ps]


def materialize(name: str, dest: Path, *, skip: Sequence[str] = ()) -> list[Patch]:
    """``tests/clients/<name>`` copied into ``dest`` with its patches applied (but those whose
    ``why`` starts with one of ``skip``); returns the patches applied.  An ``old`` that does not
    occur exactly once fails: upstream changed, look again."""
    src = CLIENTS / name
    for path in src.rglob("*"):
        rel = path.relative_to(src)
        if path.is_file() and rel.name not in _NOT_COPIED:
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dest / rel)
    applied = []
    for p in patches(name):
        if any(p.why.startswith(s) for s in skip):
            continue
        target = dest / p.file
        text = target.read_text()
        count = text.count(p.old)
        assert count == 1, f"{name}/{p.file}: {p.old!r} occurs {count} times, not once"
        target.write_text(text.replace(p.old, p.new))
        applied.append(p)
    return applied


def nanogpt_data(work: Path) -> None:
    """nanoGPT's ``data/tiny``: random tokens of a 65-token vocabulary (its prepare scripts
    download Shakespeare; the loss is what is compared, not what the text says)."""
    data = work / "data" / "tiny"
    data.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split, n in (("train", 20_000), ("val", 4_000)):
        rng.integers(0, 65, n, dtype=np.uint16).tofile(data / f"{split}.bin")
    with open(data / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 65}, f)


@dataclasses.dataclass
class Run:
    launcher: str
    rc: int | None  # None: it ran past its timeout and was killed
    wall_s: float
    lines: list[tuple[float, str]]  # (wall clock, line) of its output
    ended_at: float
    killed_pid: int = 0  # the worker SIGKILLed on cue (0: none)

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def last(self, pattern: str) -> tuple[float, str] | None:
        """The last output line that matches ``pattern``, and when it came."""
        rx = re.compile(pattern)
        return next(((t, ln) for t, ln in reversed(self.lines) if rx.search(ln)), None)

    def exit_after(self, pattern: str) -> float:
        """Seconds from the last line matching ``pattern`` (the last step's) to the exit of
        the launcher, which exits after its last worker."""
        found = self.last(pattern)
        assert found is not None, f"no line matches {pattern!r}:\n{self.text[-3000:]}"
        return self.ended_at - found[0]


def workers(cwd: Path, script: str) -> list[psutil.Process]:
    """The training processes running ``script`` from ``cwd``, as torchrun starts them
    (``python -u script``; the pre-warmed interpreter's workers show that command line too):
    not a launcher, not a zygote client."""
    found = []
    for proc in psutil.process_iter(["cmdline", "cwd"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if proc.info["cwd"] == str(cwd) and f"-u {script}" in cmd and "zygote" not in cmd:
            found.append(proc)
    return found


def launch(
    argv: Sequence[str],
    *,
    cwd: Path,
    env: dict[str, str] | None = None,
    timeout_s: float = 240,
    kill_when: Callable[[str], bool] | None = None,
    script: str = "",
) -> Run:
    """Run ``argv`` (a launcher and its arguments) in ``cwd``; with ``kill_when``, SIGKILL one
    worker of ``script`` the first time an output line satisfies it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    for name in ("DLROVER_HPC_TOKEN", "DLROVER_HPC_MASTER", "SLURM_JOB_ID"):
        env.pop(name, None)
    start = time.time()
    proc = subprocess.Popen(
        list(argv), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[tuple[float, str]] = []
    killed = [0]

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.time(), line.rstrip("\n")))
            if kill_when is not None and not killed[0] and kill_when(line):
                killed[0] = kill_one(cwd, script)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        rc: int | None = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        rc = None
        stop(proc)
    ended = time.time()
    reader.join(10)
    return Run(Path(argv[0]).name, rc, ended - start, lines, ended, killed[0])


def kill_one(cwd: Path, script: str) -> int:
    """SIGKILL the newest worker of ``script`` (not rank 0's, where it can be told apart);
    its pid, 0 when none runs."""
    procs = sorted(workers(cwd, script), key=lambda p: p.pid)
    if not procs:
        return 0
    victim = procs[-1]
    victim.send_signal(signal.SIGKILL)
    return victim.pid


def stop(proc: subprocess.Popen[str]) -> None:
    """End a launcher that overran: SIGTERM, then SIGKILL; its children with it."""
    family = []
    with contextlib.suppress(psutil.Error):
        family = psutil.Process(proc.pid).children(recursive=True)
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for child in family:
        with contextlib.suppress(psutil.Error):
            child.kill()
