"""The in-process wrapper (issue 26) with real gloo processes; this test plays the agent.

Three worker processes run a wrapped function that all-reduces in a loop.  The test writes
the agent's notices (:mod:`dlrover_hpc.membership`) and hosts each round's store: a round
change with every worker healthy, a peer SIGKILLed, a peer SIGSTOPped (the survivors wait in
gloo's all-reduce until the notice makes them leave), and an exception no notice explains.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.distributed import TCPStore

from dlrover_hpc import membership
from dlrover_hpc.testing import wait_for

pytestmark = [pytest.mark.timeout(180), pytest.mark.runtime]

WORKER = """\
import json, os, sys, time
import torch, torch.distributed as dist
from dlrover_hpc.trainer import inprocess

out = sys.argv[1]

backend = os.environ.get("BACKEND", "gloo")
device = "cuda" if backend == "nccl" else "cpu"
if device == "cuda":
    torch.cuda.set_device(0)

@inprocess.wrap
def train():
    dist.init_process_group(backend)
    rank, world, rnd = dist.get_rank(), dist.get_world_size(), os.environ["DLROVER_HPC_ROUND"]
    flag = torch.zeros(2, device=device)
    n = 0
    while True:
        flag[0], flag[1] = 1.0, float(os.path.exists(f"{out}/stop-{rnd}"))
        dist.all_reduce(flag)  # blocks while a peer is stopped; fails once one is gone
        assert flag[0].item() == world
        n += 1
        if n == 3:
            open(f"{out}/running-{rnd}-{os.getpid()}", "w").close()
        if n == int(os.environ.get("FAIL_AT", "0")):
            raise ValueError("a bug of the script")
        if flag[1] > 0:
            break
        time.sleep(0.01)
    with open(f"{out}/done-{os.getpid()}.json", "w") as f:
        json.dump({"rank": rank, "world": world, "round": int(rnd),
                   "restarts": inprocess.restarts()}, f)
    dist.destroy_process_group()

train()
"""


class Round:
    """A round's store, hosted here as the master hosts it."""

    def __init__(self) -> None:
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def env(self, number: int, rank: int, world: int) -> dict[str, str]:
        return {
            "RANK": str(rank),
            "LOCAL_RANK": "0",
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self.store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": str(number - 1),
            "DLROVER_HPC_ROUND": str(number),
        }


class Workers:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.procs: list[subprocess.Popen[str]] = []
        self.records: list[str] = []
        self.rounds: list[Round] = []  # each store lives as long as the test

    def start(
        self, n: int, rnd: Round, extra: dict[str, str] | None = None, backend: str = "gloo"
    ) -> None:
        self.rounds.append(rnd)
        script = self.out / "worker.py"
        script.write_text(WORKER)
        for rank in range(n):
            record = str(self.out / f"rank{rank}.progress")
            env = {
                **os.environ,
                **rnd.env(1, rank, n),
                "DLROVER_HPC_PROGRESS_FILE": record,
                "OMP_NUM_THREADS": "1",
                "BACKEND": backend,
                # NCCL refuses two ranks of one host on one GPU: each process a "host" of its own
                "NCCL_HOSTID": f"inprocess-test-{rank}",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",  # as dlrover-run sets it
                **(extra or {}),
            }
            self.records.append(record)
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), str(self.out)],
                    env=env,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        wait_for(
            lambda: len(list(self.out.glob("running-1-*"))) == n,
            timeout_s=90,
            what="every worker all-reducing in round 1",
        )
        for record, proc in zip(self.records, self.procs, strict=True):
            assert membership.opted_in(record) == proc.pid

    def leave(self, indices: list[int], number: int) -> float:
        """Tell them to leave; seconds until every one has acknowledged."""
        began = time.monotonic()
        for i in indices:
            membership.tell(self.records[i], membership.Notice(number, membership.LEAVE))
        wait_for(
            lambda: all(membership.left(self.records[i]) >= number for i in indices),
            timeout_s=30,
            what=f"workers {indices} leaving for round {number}",
        )
        return time.monotonic() - began

    def join(self, placement: dict[int, int], number: int, rnd: Round) -> None:
        """``placement``: worker index -> its rank in round ``number``."""
        self.rounds.append(rnd)
        for i, rank in placement.items():
            env = rnd.env(number, rank, len(placement))
            membership.tell(self.records[i], membership.Notice(number, membership.JOIN, env))

    def finish(self, indices: list[int], number: int) -> dict[int, dict]:
        (self.out / f"stop-{number}").touch()
        results = {}
        for i in indices:
            proc = self.procs[i]
            _, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err[-3000:]
            results[i] = json.loads((self.out / f"done-{proc.pid}.json").read_text())
            results[i]["stderr"] = err
        return results


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Workers]:
    group = Workers(tmp_path)
    yield group
    for proc in group.procs:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_healthy_workers_change_rounds_without_a_new_process(workers: Workers) -> None:
    workers.start(3, Round())
    took = workers.leave([0, 1, 2], 2)
    workers.join({0: 2, 1: 0, 2: 1}, 2, Round())  # new ranks, a new store
    results = workers.finish([0, 1, 2], 2)
    assert {i: (r["rank"], r["world"], r["round"]) for i, r in results.items()} == {
        0: (2, 3, 2),
        1: (0, 3, 2),
        2: (1, 3, 2),
    }
    assert all(r["restarts"] == 1 for r in results.values()), results
    assert all("in-process restart 1" in r["stderr"] for r in results.values())
    print(f"three healthy workers left their round in {took:.2f} s")


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_survivors_leave_a_collective_that_lost_a_peer(workers: Workers, fault: str) -> None:
    """SIGKILL: the survivors' all-reduce fails at once and they wait for the agent's word.
    SIGSTOP: it would wait for gloo's 30-minute timeout; the notice makes it fail now."""
    workers.start(3, Round())
    victim = workers.procs[1]
    victim.send_signal(getattr(signal, fault))
    time.sleep(1.0)  # the master's decision takes a moment; the survivors wait meanwhile
    assert all(p.poll() is None for p in (workers.procs[0], workers.procs[2]))
    took = workers.leave([0, 2], 2)
    assert took < 10.0, took  # not gloo's timeout
    victim.kill()
    workers.join({0: 1, 2: 0}, 2, Round())
    results = workers.finish([0, 2], 2)
    assert {i: (r["rank"], r["world"]) for i, r in results.items()} == {0: (1, 2), 2: (0, 2)}
    assert all(r["restarts"] == 1 for r in results.values()), results
    print(f"{fault}: the survivors left in {took:.2f} s")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL)")
@pytest.mark.parametrize("fault", ["none", "SIGSTOP"])
def test_nccl_communicators_abort_and_initialise_again(workers: Workers, fault: str) -> None:
    """Issue 26, item 4: the survivors' NCCL all-reduce waits on the GPU for a stopped peer;
    the notice aborts the communicators, and the next round's are initialised in-process."""
    workers.start(3, Round(), backend="nccl")
    survivors = [0, 1, 2]
    if fault == "SIGSTOP":
        workers.procs[1].send_signal(signal.SIGSTOP)
        survivors = [0, 2]
        time.sleep(1.0)
    took = workers.leave(survivors, 2)
    assert took < 10.0, took  # not NCCL's 10-minute timeout
    if fault == "SIGSTOP":
        workers.procs[1].kill()
    began = time.monotonic()
    workers.join({i: rank for rank, i in enumerate(survivors)}, 2, Round())
    wait_for(
        lambda: len(list(workers.out.glob("running-2-*"))) == len(survivors),
        timeout_s=60,
        what="every survivor all-reducing in round 2",
    )
    again = time.monotonic() - began
    results = workers.finish(survivors, 2)
    assert all(r["restarts"] == 1 and r["world"] == len(survivors) for r in results.values())
    print(f"NCCL, {fault}: left in {took:.2f} s, all-reducing again {again:.2f} s after the join")


def test_an_exception_no_round_change_explains_ends_the_process(workers: Workers) -> None:
    workers.start(3, Round(), extra={"FAIL_AT": "6", "DLROVER_HPC_INPROCESS_WAIT_S": "1"})
    for proc in workers.procs:
        _, err = proc.communicate(timeout=60)
        assert proc.returncode != 0 and "a bug of the script" in err, err[-2000:]
        assert "in-process restart" not in err


def test_outside_dlrover_run_the_wrapper_only_calls(tmp_path: Path) -> None:
    code = (
        "from dlrover_hpc.trainer import inprocess\n"
        "f = inprocess.wrap(lambda x: x + 1)\n"
        "assert f(1) == 2 and inprocess.restarts() == 0\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "DLROVER_HPC_PROGRESS_FILE"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
