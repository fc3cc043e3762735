"""Transparency, switch by switch (issue 45, item 4): under ``dlrover-run --transparent`` a worker
is what torchrun starts (the same command line, nothing imported before the script, no signal
held), and crash recovery still works; by default the pre-warmed interpreter still imports
nothing that leaves state behind (torch._dynamo before the script's DDP: a deadlock at exit)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from runtime_helpers import BIN, TRAIN, events, named

PROBE = """
import json, logging, os, signal, sys
root = logging.getLogger()
handlers, level = len(root.handlers), root.level
at_start = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "dlrover_hpc", "sympy"))
with open("/proc/self/status") as f:
    status = dict(line.split(":", 1) for line in f if ":" in line)
blocked = int(status["SigBlk"].strip(), 16)
with open("/proc/self/cmdline", "rb") as f:
    cmdline = [a.decode() for a in f.read().split(b"\\0") if a][1:]
import torch.distributed as dist
dist.init_process_group("gloo")
out = {
    "modules": at_start,
    "usr1_blocked": bool(blocked & (1 << (signal.SIGUSR1 - 1))),
    "cmdline": cmdline,
    "env": sorted(k for k in os.environ if k.startswith("DLROVER_HPC_NO_")),
    "logging": [handlers, level],
    "numpy_draw": __import__("numpy").random.rand(),
}
with open(f"{sys.argv[1]}-{dist.get_rank()}.json", "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
"""


def _probe(tmp_path: Path, tag: str, *launcher: str, env: dict[str, str] | None = None) -> dict:
    subprocess.run(
        [*launcher, "--standalone", "--nproc-per-node=2", "probe.py", tag],
        cwd=tmp_path,
        check=True,
        timeout=120,
        capture_output=True,
        env={**os.environ, **(env or {})},
    )
    return {r: json.loads((tmp_path / f"{tag}-{r}.json").read_text()) for r in (0, 1)}


def test_a_transparent_worker_is_what_torchrun_starts(tmp_path: Path) -> None:
    (tmp_path / "probe.py").write_text(PROBE)
    torchrun = _probe(tmp_path, "torchrun", str(BIN / "torchrun"))
    transparent = _probe(
        tmp_path,
        "transparent",
        str(BIN / "dlrover-run"),
        f"--job-dir={tmp_path / 'j1'}",
        "--transparent",
    )
    # numpy.random preloaded: each worker still draws its own numbers, as under torchrun
    default = _probe(
        tmp_path,
        "default",
        str(BIN / "dlrover-run"),
        f"--job-dir={tmp_path / 'j2'}",
        env={"DLROVER_HPC_PRELOAD": "numpy.random"},
    )
    assert default[0].pop("numpy_draw") != default[1].pop("numpy_draw")
    for probe in (torchrun, transparent):
        assert probe[0].pop("numpy_draw") != probe[1].pop("numpy_draw")
    assert torchrun[0] == {
        "logging": [0, 30],
        "modules": [],
        "usr1_blocked": False,
        "cmdline": ["-u", "probe.py", "torchrun"],
        "env": [],
    }
    for rank in (0, 1):
        got = transparent[rank]
        assert got["modules"] == [] and got["usr1_blocked"] is False, got
        assert got["cmdline"] == ["-u", "probe.py", "transparent"], got
        assert len(got["env"]) == 5, got  # every switch, told to the worker
    # by default: pre-warmed (torch imported), USR1 held, and never torch._dynamo
    assert "torch" in default[0]["modules"] and default[0]["usr1_blocked"] is True
    assert "torch._dynamo" not in default[0]["modules"], default[0]["modules"]
    # the agent's log handler and level stay with the agent (a framework would log twice)
    assert default[0]["logging"] == transparent[0]["logging"] == [0, 30], default[0]


def test_crash_recovery_works_with_every_injection_off(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    out = subprocess.run(
        [
            str(BIN / "dlrover-run"),
            "--standalone",
            "--nproc-per-node=2",
            "--transparent",
            f"--job-dir={tmp_path / 'job'}",
            str(TRAIN),
            "--steps=40",
            f"--ckpt-dir={ckpt}",
            "--fail-at-step=20",
            "--fail-rank=1",
            f"--result={tmp_path / 'result.json'}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    evs = events(tmp_path / "job")
    assert [e["restart_count"] for e in named(evs, "workers_restarted")] == [1]
    assert not named(evs, "hang_detected") and not named(evs, "straggler_detected")
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["final_step"] == 40 and result["restart_count"] == 1


RACE = """
import sys, threading
import torch
errors, barrier = [], threading.Barrier(8)
def first_parallel_call():
    barrier.wait()  # eight threads' first parallel op at once: each takes the pool
    try:
        torch.ones(10**6).add_(1)
    except RuntimeError as exc:
        errors.append(str(exc).splitlines()[0])
threads = [threading.Thread(target=first_parallel_call) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("errors", errors, "threads", torch.get_num_threads(), flush=True)
sys.exit(1 if errors else 0)
"""


def test_a_forked_worker_owns_its_thread_pool(tmp_path: Path) -> None:
    """Threads that make their first parallel call at once in a forked worker found no pool
    ("Invalid thread pool!") in 7 runs of 8: the worker now makes its own before the script."""
    (tmp_path / "race.py").write_text(RACE)
    for i in range(3):
        out = subprocess.run(
            [
                str(BIN / "dlrover-run"),
                "--standalone",
                "--nproc-per-node=1",
                "--max-restarts=0",
                f"--job-dir={tmp_path / f'job{i}'}",
                "race.py",
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "OMP_NUM_THREADS": "2"},
        )
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        # the worker's own OMP_NUM_THREADS, as `import torch` reads it in a new interpreter
        assert "errors [] threads 2" in out.stdout, out.stdout[-2000:]
        assert "Leaking Caffe2 thread-pool" not in out.stderr, out.stderr[-2000:]
