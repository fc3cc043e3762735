"""Sections and step statistics in a rank's progress record (issue 25): the record a worker
writes in /dev/shm, the hooks that open sections on their own (eval, a data loader's start) and
time each step's compute and wait, and the watchdog that reads them from a real process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlrover_hpc.agent import watchdog as wd
from dlrover_hpc.localslurm import wait_for
from dlrover_hpc.worker import progress


@pytest.fixture
def record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    path = str(tmp_path / "rank.progress")
    monkeypatch.setenv(progress.PATH_ENV, path)
    monkeypatch.setattr(progress, "_reporter", progress._Reporter())
    return path


def test_the_p99_leaves_out_warm_up_and_steps_that_overlap_a_section(record: str) -> None:
    clock = [100.0]
    progress._reporter.clock = lambda: clock[0]
    progress.step(0)
    for seconds in (50.0, 20.0):  # compilation, warm-up: never counted
        clock[0] += seconds
        progress.step()
    assert progress.read(record).p99_s == 0.0  # type: ignore[union-attr]
    for i in range(40):
        clock[0] += 0.5 if i % 10 else 0.7
        progress.step()
    with progress.section("eval"):
        clock[0] += 90.0  # a step that spans an evaluation
    progress.step()
    for _ in range(10):
        clock[0] += 0.5
        progress.step()
    got = progress.read(record)
    assert got is not None and got.step == 53
    assert got.p99_s == pytest.approx(0.7)  # neither the 50 s, the 20 s nor the 90 s step


def test_the_timed_steps_sums_leave_out_warm_up_and_steps_that_overlap_a_section(
    record: str,
) -> None:
    """What the master's fail-slow check takes the means of (issue 50)."""
    assert progress.timed_at(record) == (0, 0.0, 0.0)  # no record yet
    progress.step(0, compute_s=30.0)
    progress.step(compute_s=20.0, wait_s=1.0)  # warm-up: never counted
    progress.step(compute_s=9.0, wait_s=9.0)
    assert progress.timed_at(record) == (0, 0.0, 0.0)
    for _ in range(4):
        progress.step(compute_s=0.25, wait_s=0.5)
    with progress.section("eval"):
        progress.step(compute_s=90.0)  # overlaps the evaluation
    progress.step(compute_s=50.0)  # a section was open since the step before
    progress.step(compute_s=0.25, wait_s=0.5)
    progress.step()  # a step with no timing (progress.step() by the script)
    assert progress.timed_at(record) == (5, 1.25, 2.5)


def test_sections_nest_and_the_innermost_one_is_written(record: str) -> None:
    assert progress.read_section(record) is None
    before = time.time()
    with progress.section("eval"):
        outer = progress.read_section(record)
        assert outer is not None and outer.name == "eval" and outer.bound_s == 0.0
        assert before <= outer.since <= time.time()
        with progress.section("a-very-long-section-name-indeed", timeout_s=120):
            inner = progress.read_section(record)
            assert inner == progress.Section("a-very-long-section-name", inner.since, 120.0)
        assert progress.read_section(record) == outer
    assert progress.read_section(record) is None


def test_a_section_is_closed_when_its_block_raises(record: str) -> None:
    @progress.sectioned("checkpoint")
    def save() -> None:
        assert progress.read_section(record).name == "checkpoint"  # type: ignore[union-attr]
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save()
    assert progress.read_section(record) is None


def test_a_bad_section_bound_is_refused(record: str) -> None:
    with (
        pytest.raises(ValueError, match="timeout_s=-1 must be 0"),
        progress.section("x", timeout_s=-1),
    ):
        pass


def test_outside_dlrover_run_sections_do_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(progress.PATH_ENV, raising=False)
    with progress.section("eval"):
        progress.step()


HOOKED = """
import sys, time, json
import torch, torch.nn as nn
from torch.utils.data import DataLoader, Dataset
from dlrover_hpc.worker import hooks as worker_hooks
from dlrover_hpc.worker import progress
worker_hooks.install()
path = sys.argv[1]

class Slow(Dataset):
    def __len__(self): return 4
    def __getitem__(self, i):
        if i == 0:
            print(json.dumps({"in_loader": progress.read_section(path).name}), flush=True)
        return torch.randn(8)

model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
seen = {}
for i, x in enumerate(DataLoader(Slow(), batch_size=2)):
    if i == 0:
        seen["after_first_batch"] = progress.read_section(path)
    time.sleep(0.05)  # the step's own work (data, forward)
    model(x).sum().backward()
    time.sleep(0.03)  # after the last gradient: where DDP waits for its peers
    opt.step()
    opt.zero_grad()
r = progress.read(path)
seen["compute"], seen["wait"] = r.compute_s, r.wait_s
model.eval()
seen["eval"] = progress.read_section(path).name
model(torch.randn(2, 8))
model.train()
seen["train"] = progress.read_section(path)
model.eval()  # and left in eval: the next optimizer step ends the section
model(torch.randn(2, 8)).sum().backward()
opt.step()
seen["stepped"] = progress.read_section(path)
r = progress.read(path)
print(json.dumps({**seen, "step": r.step}))
"""


def test_the_worker_hooks_open_eval_and_data_sections_and_time_compute(tmp_path: Path) -> None:
    path = str(tmp_path / "rank.progress")
    script = tmp_path / "hooked.py"
    script.write_text(HOOKED)
    env = {**os.environ, progress.PATH_ENV: path, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, str(script), path], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert lines[0] == {"in_loader": "data"}  # the data loader's first batch is a section
    seen = lines[-1]
    assert seen["after_first_batch"] is None and seen["eval"] == "eval"
    assert seen["train"] is None and seen["stepped"] is None
    assert seen["step"] == 3
    assert 0.05 <= seen["compute"] < 5.0, seen
    assert 0.03 <= seen["wait"] < 0.05 + seen["compute"], seen


BUSY_EVAL = """
import sys, time
from dlrover_hpc.worker import hooks as worker_hooks
from dlrover_hpc.worker import progress
worker_hooks.install()
for _ in range(5):
    time.sleep(0.05)
    progress.step()
with progress.section(sys.argv[1]):
    deadline = time.time() + 60
    while time.time() < deadline:  # an evaluation: busy, no steps
        sum(i * i for i in range(10000))
"""


def test_a_busy_rank_in_a_section_progresses_an_idle_one_outside_stalls(tmp_path: Path) -> None:
    template = wd.progress_template(f"sect-{os.getpid()}", tmp_path.name, agent_pid=os.getpid())
    path = template.format(0)
    script = tmp_path / "busy.py"
    script.write_text(BUSY_EVAL)
    env = {**os.environ, progress.PATH_ENV: path}
    proc = subprocess.Popen([sys.executable, str(script), "eval"], env=env)
    watchdog = wd.Watchdog(sample_s=1000.0)  # no stack samples: the CPU alone must tell
    try:
        wait_for(lambda: progress.read(path) is not None, timeout_s=30, what="the worker")
        watchdog.start_round({0: (0, proc.pid, path)})
        wait_for(lambda: progress.read_section(path) is not None, timeout_s=30, what="the section")
        time.sleep(3)
        stalled = []
        for _ in range(4):
            [p] = watchdog.poll()
            stalled.append(p.stalled_s)
            assert p.section == "eval" and p.section_s > 0
            time.sleep(1)
        assert max(stalled) < 1.5, stalled  # its CPU use counts as progress
    finally:
        proc.kill()
        proc.wait()
        watchdog.stop_round()


ODD_SCRIPTS = """
import json, os, sys
import torch, torch.nn as nn
from torch.utils.data import DataLoader
from dlrover_hpc.worker import hooks as worker_hooks
from dlrover_hpc.worker import progress
worker_hooks.install()
path = sys.argv[1]
out = {}

# A non-leaf parameter (retain_grad): the optimizer steps; the hooks stay out of its way.
a = torch.randn(3, requires_grad=True)
b = a * 2
b.retain_grad()
opt = torch.optim.SGD([b], lr=0.1)
b.sum().backward()
opt.step()
out["non_leaf_step"] = progress.read(path).step

# Optimizers made again and again: one gradient hook per parameter, not one per optimizer.
model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
for _ in range(20):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
out["hooks_on_weight"] = len(model[0].weight._post_accumulate_grad_hooks or {})

# A frozen part put in eval mode every step is not an evaluation.
sections = []
for _ in range(3):
    model.train()
    model[1].eval()
    sections.append(progress.read_section(path))
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
out["frozen_bn_sections"] = [s.name if s else None for s in sections]
model.eval()
out["model_eval"] = progress.read_section(path).name
model.train()

# An iterator made early and not advanced: its section ends at the next optimizer step.
early = iter(DataLoader(list(range(8)), batch_size=2))
out["early_iter"] = progress.read_section(path).name
model(torch.randn(8, 4)).sum().backward()
opt.step()
out["after_step"] = progress.read_section(path)

# A forked child (a data-loader worker) does not write the rank's sections.
pid = os.fork()
if pid == 0:
    with progress.section("child"):
        pass
    progress.enter_section("child-left-open")
    os._exit(0)
os.waitpid(pid, 0)
out["after_child"] = progress.read_section(path)
print(json.dumps(out))
"""


def test_the_hooks_survive_odd_scripts(tmp_path: Path) -> None:
    path = str(tmp_path / "rank.progress")
    script = tmp_path / "odd.py"
    script.write_text(ODD_SCRIPTS)
    env = {**os.environ, progress.PATH_ENV: path, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, str(script), path], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    got = json.loads(out.stdout.splitlines()[-1])
    assert got["non_leaf_step"] == 1, got
    assert got["hooks_on_weight"] == 1, got
    assert got["frozen_bn_sections"] == [None, None, None], got
    assert got["model_eval"] == "eval" and got["early_iter"] == "data", got
    assert got["after_step"] is None and got["after_child"] is None, got
