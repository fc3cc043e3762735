"""What watching a worker costs its training step (issues 13 and 25).

One worker process trains a small MLP on CPU (forward, backward, Adam) and times its steps,
in interleaved runs of each mode, so every mode sees the same machine:

- ``bare``: no hooks, nothing watching (the baseline);
- ``hooks``: the worker hooks dlrover-run installs by default (the optimizer step hooks
  writing the progress record with the step-time p99 and the step's compute and wait, one
  gradient hook per parameter, the eval and data-loader sections, faulthandler on SIGUSR2):
  what hang and fail-slow detection cost;
- ``hooks+forward``: plus the global module hooks that time the forward (straggler detection);
- ``sampled``: hooks, and the agent reading the worker's stack with py-spy every
  ``--sample-s`` seconds all along (the watchdog only samples while steps stall: this is the
  worst case, e.g. a long evaluation with no optimizer step).

Prints one JSON line: the median step time per mode and its ratio to ``bare``.

    python benchmarks/hang_overhead.py --steps 400 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

WORKER = r"""
import json, os, sys, time
import torch
steps, mode, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
if mode != "bare":
    os.environ["DLROVER_HPC_FORWARD_TIMING"] = "1" if mode == "hooks+forward" else "0"
    from dlrover_hpc.worker import hooks as worker_hooks
    worker_hooks.install()
torch.manual_seed(0)
torch.set_num_threads(1)
layers = []
for _ in range(8):
    layers += [torch.nn.Linear(256, 256), torch.nn.ReLU()]
model = torch.nn.Sequential(*layers)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x = torch.randn(64, 256)
times = []
for step in range(steps):
    t0 = time.perf_counter()
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    times.append(time.perf_counter() - t0)
json.dump(times[steps // 10:], open(out, "w"))
"""


def run(mode: str, steps: int, sample_s: float, tmp: str) -> list[float]:
    out = os.path.join(tmp, f"{mode}.json")
    script = os.path.join(tmp, "worker.py")
    env = dict(os.environ)
    if mode != "bare":
        env["DLROVER_HPC_PROGRESS_FILE"] = os.path.join(tmp, f"{mode}.progress")
    proc = subprocess.Popen([sys.executable, script, str(steps), mode, out], env=env)
    stop = threading.Event()
    samples = 0

    def sample() -> None:
        nonlocal samples
        from dlrover_hpc.agent.watchdog import StackReader

        reader = StackReader()
        stop.wait(1.0)  # let the interpreter start (py-spy needs it)
        while not stop.wait(sample_s):
            reader.read(proc.pid, env.get("DLROVER_HPC_PROGRESS_FILE", ""))
            samples += 1

    sampler = threading.Thread(target=sample) if mode == "sampled" else None
    if sampler is not None:
        sampler.start()
    proc.wait()
    stop.set()
    if sampler is not None:
        sampler.join()
    with open(out) as f:
        times: list[float] = json.load(f)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sample-s", type=float, default=1.0, help="py-spy interval in 'sampled'")
    args = p.parse_args()
    modes = ["bare", "hooks", "hooks+forward", "sampled"]
    per_mode: dict[str, list[float]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "worker.py"), "w") as f:
            f.write(WORKER)
        for _ in range(args.repeats):
            for mode in modes:
                per_mode[mode].append(statistics.median(run(mode, args.steps, args.sample_s, tmp)))
    medians = {mode: statistics.median(v) for mode, v in per_mode.items()}
    base = medians["bare"]
    print(
        json.dumps(
            {
                "step_ms": {mode: round(v * 1000, 3) for mode, v in medians.items()},
                "ratio_to_bare": {mode: round(v / base, 4) for mode, v in medians.items()},
                "steps": args.steps,
                "repeats": args.repeats,
                "sample_s": args.sample_s,
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
        )
    )


if __name__ == "__main__":
    main()
