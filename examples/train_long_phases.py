"""A DDP job whose long phases are not hangs: a slow first step, an evaluation every N steps,
a data loader whose first batch of an epoch takes long, a section the script marks itself, and
a large flash checkpoint persisted on exit.

Under ``dlrover-run`` with the default ``--hang-timeout auto`` it must run to the end without a
``hang_detected``, a ``straggler_detected`` or a restart: each phase is recognised (the first
steps as warm-up, ``model.eval()`` as ``eval``, the data loader's start as ``data``, the saves as
``checkpoint``, ``progress.section`` as what the script names) and held to its own bound, not
to the bound learned from the step times (about 30 s here).  ``benchmarks/false_alarms.py``
runs it at full size; ``tests/runtime/test_hang.py`` a shorter one.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

from dlrover_hpc import progress
from dlrover_hpc.checkpoint import DdpCheckpointer, StorageType


class Samples(Dataset):
    """Random samples; the first batch of epoch ``slow_epoch`` takes ``first_s`` seconds (a
    data loader opening files on a slow file system, in its worker process)."""

    def __init__(self, n: int, *, first_s: float, slow: bool) -> None:
        self.n, self.first_s, self.slow = n, first_s, slow

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 0 and self.slow:
            time.sleep(self.first_s)
        return torch.randn(32, generator=torch.Generator().manual_seed(i))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--epoch-steps", type=int, default=100)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--first-step-s", type=float, default=60.0, help="the first step's extra time")
    p.add_argument("--eval-every", type=int, default=100, help="steps between evaluations")
    p.add_argument("--eval-s", type=float, default=90.0, help="seconds each evaluation runs")
    p.add_argument("--loader-first-s", type=float, default=30.0, help="epoch 2's first batch")
    p.add_argument("--section-s", type=float, default=0.0, help="a marked section, in epoch 3")
    p.add_argument(
        "--busy-eval-at",
        type=int,
        default=0,
        help="a step after which every rank evaluates without model.eval() (0: none)",
    )
    p.add_argument("--busy-eval-s", type=float, default=90.0, help="seconds it computes")
    p.add_argument(
        "--busy-eval-rank0",
        action="store_true",
        help="only rank 0 evaluates; the others wait for it in a barrier (blocked, no CPU)",
    )
    p.add_argument("--persist-mb", type=int, default=1024, help="checkpoint size saved on exit")
    p.add_argument("--ckpt-dir", default="./ckpt-long-phases")
    p.add_argument("--result", default=None)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    net = DDP(model)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    ckpt = DdpCheckpointer(args.ckpt_dir)

    step, evals, t0 = 0, 0, time.time()
    for epoch in range(args.epochs):
        data = Samples(args.epoch_steps * 4, first_s=args.loader_first_s, slow=epoch == 1)
        loader = DataLoader(data, batch_size=4, num_workers=1)
        for x in loader:
            if step == 0:
                time.sleep(args.first_step_s)  # compilation, autotuning: the first step only
            loss = net(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            time.sleep(args.step_time)
            if args.eval_every and step % args.eval_every == 0:
                evaluate(net, args.eval_s)
                evals += 1
            if step == args.busy_eval_at:
                if rank == 0 or not args.busy_eval_rank0:
                    busy_evaluate(model, args.busy_eval_s)
                dist.barrier()
                evals += 1
            if args.section_s and epoch == 2 and step % args.epoch_steps == 1:
                with progress.section("export", timeout_s=args.section_s * 2 + 60):
                    time.sleep(args.section_s)  # e.g. exporting a model, on every rank
    # A large state persisted on exit: the copy into memory blocks, then the wait for the
    # agent's write to storage.
    state = {"model": model.state_dict(), "step": step}
    if args.persist_mb:
        state["big"] = torch.zeros(args.persist_mb * 2**20 // 4)
    ckpt.save_checkpoint(step, state, storage_type=StorageType.DISK)
    committed = ckpt.wait_latest_checkpoint(timeout_s=1200)
    if rank == 0 and args.result:
        summary = {"steps": step, "evals": evals, "committed": committed, "s": time.time() - t0}
        with open(args.result, "w") as f:
            json.dump(summary, f)
    ckpt.close()
    dist.destroy_process_group()
    raise SystemExit(0 if committed else 1)


def evaluate(net: nn.Module, seconds: float) -> None:
    """``seconds`` of evaluation: forward passes without gradients, a little compute each."""
    net.eval()
    deadline = time.time() + seconds
    with torch.no_grad():
        while time.time() < deadline:
            net.module(torch.randn(64, 32))
            time.sleep(0.02)
    net.train()
    dist.barrier()


def busy_evaluate(model: nn.Module, seconds: float) -> None:
    """An evaluation as many scripts write it: forward passes under ``no_grad()`` on a busy
    CPU for ``seconds``, without ``model.eval()`` (so no hook can tell it from training)."""
    deadline = time.time() + seconds
    head = nn.Linear(1024, 1024)  # one large layer: the stack stays on one line throughout
    batch = torch.randn(1024, 1024)
    with torch.no_grad():
        while time.time() < deadline:
            head(model[0].weight.sum() + batch)


if __name__ == "__main__":
    main()
