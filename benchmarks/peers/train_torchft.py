"""examples/train.py's model and steps written against torchft, for benchmarks/side_by_side.py.

One replica group per node (``REPLICA_GROUP_ID``, one rank each, under a standalone torchrun
that restarts it), a lighthouse on the first node (``TORCHFT_LIGHTHOUSE``).  A step commits
only when the quorum agrees; a restarted replica heals from a live peer instead of a
checkpoint.  The first replica group logs ``time step`` per committed step, as examples/train.py
does.  Runs in the peers' venv (benchmarks/peers_venv.sh), not under dlrover-run.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.nn as nn
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--timing-log", default=None)
    args = p.parse_args()
    group = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    inner = torch.optim.SGD(model.parameters(), lr=0.01)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optimizer": inner.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optimizer"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        min_replica_size=2,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"bench_{group}",
        timeout=timedelta(seconds=10),
    )
    ddp = DistributedDataParallel(manager, model)
    opt = Optimizer(manager, inner)
    while manager.current_step() < args.steps:
        x = torch.randn(8, 16)
        opt.zero_grad()  # starts the step's quorum
        loss = ddp(x).pow(2).mean()
        loss.backward()
        opt.step()  # commits only when every replica of the quorum agrees
        time.sleep(args.step_time)
        if group == 0 and args.timing_log and manager.participating_rank() is not None:
            with open(args.timing_log, "a") as f:
                f.write(f"{time.time()} {manager.current_step()}\n")


if __name__ == "__main__":
    main()
