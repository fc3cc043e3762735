"""DDP training on shards the job master hands out (dynamic data sharding), with flash
checkpoints: every sample of every epoch reaches the model exactly once, whatever fails.

Run it under ``dlrover-run``.  Each rank asks the master for shards of a synthetic dataset
(``--samples`` per epoch) and draws ``--batch-size`` samples per step.  After a restart it
resumes from the newest checkpoint and tells the client how many batches it had drawn there
(``start_batch``; one batch per step, so the step).  At the end of the data a rank with nothing
left still takes part in each step with a zero-weight batch until every rank is done, so the
collectives stay in step.  With ``--sample-log DIR`` each rank appends one JSON line per step
(round, step, the samples it trained) for tests to count.  ``--fail-at-step N --fail-rank R``
SIGKILLs that rank once.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dlrover_hpc.checkpoint import DdpCheckpointer, StorageType
from dlrover_hpc.data.client import ShardingClient


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=2000, help="samples per epoch")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=4, help="samples per step and rank")
    p.add_argument("--shard-size", type=int, default=40)
    p.add_argument("--ckpt-dir", default="./ckpt-sharded")
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--persist-every", type=int, default=20)
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--sample-log", default=None)
    p.add_argument("--fail-at-step", type=int, default=-1)
    p.add_argument("--fail-rank", type=int, default=0)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = torch.randn(args.samples, 16, generator=torch.Generator().manual_seed(7))
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    net = DDP(model)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    ckpt = DdpCheckpointer(args.ckpt_dir)
    state = ckpt.load_checkpoint(state_dict={"model": model.state_dict(), "opt": opt.state_dict()})
    step = 0
    if state:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = int(state["step"])
    client = ShardingClient(
        "synthetic",
        args.samples,
        batch_size=args.batch_size,
        shard_size=args.shard_size,
        num_epochs=args.epochs,
        start_batch=step,
        shuffle=True,
        seed=3,
    )
    samples = client.indices()
    log = None
    if args.sample_log:
        os.makedirs(args.sample_log, exist_ok=True)
        log = open(os.path.join(args.sample_log, f"rank{rank}.jsonl"), "a")  # noqa: SIM115
        log.write(json.dumps({"round": client.round, "start": step}) + "\n")
    marker = os.path.join(args.ckpt_dir, f".failed-once-{args.fail_rank}")
    while True:
        batch = list(itertools.islice(samples, args.batch_size))
        have = torch.tensor([len(batch)])
        dist.all_reduce(have, op=dist.ReduceOp.MAX)
        if have.item() == 0:
            break  # every rank is out of data
        x = data[batch] if batch else torch.zeros(1, 16)
        loss = net(x).pow(2).mean() * (1.0 if batch else 0.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if log is not None:
            record = {"round": client.round, "step": step, "samples": batch}
            log.write(json.dumps(record) + "\n")
            log.flush()
        if args.step_time:
            time.sleep(args.step_time)
        if step % args.save_every == 0:
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step}
            disk = step % args.persist_every == 0
            ckpt.save_checkpoint(
                step, state, storage_type=StorageType.DISK if disk else StorageType.MEMORY
            )
        if step == args.fail_at_step and rank == args.fail_rank and not os.path.exists(marker):
            with open(marker, "w") as f:
                f.write(str(step))
            os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        print(f"trained {step} steps; no shard left", flush=True)
    client.close()
    ckpt.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
