"""Healthy public scripts under torchrun and dlrover-run, start to exit (issue 45, item 6).

PyTorch's DDP tutorial (``multinode.py``, 4 ranks, 40 epochs) and nanoGPT's ``train.py`` (2
ranks, the tiny CPU config of ``tests/clients/nanogpt/config/dlrover_tiny.py``), vendored under
``tests/clients/`` and patched only from CUDA to CPU, each run ``--repeats`` times under both
launchers, alternating (these machines are noisy: the pair shares the conditions).  Per script:
the median wall time of each launcher, their ratio, each launcher's median seconds from the last
step's line to its exit, and every run's exit code.  Prints one JSON line.

    python benchmarks/exit_parity.py                 # 3 repeats each, about 2 minutes here
    python benchmarks/exit_parity.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from vendored import launch, materialize, nanogpt_data  # noqa: E402

BIN = Path(sys.executable).parent
#: name -> (client, ranks, arguments, the last step's line)
SCRIPTS = {
    "ddp_tutorial": ("ddp_tutorial", 4, ["multinode.py", "40", "10"], r"Epoch 39 \|"),
    "nanogpt": ("nanogpt", 2, ["train.py", "config/dlrover_tiny.py"], r"iter 60: loss"),
}


def _prepare(client: str, work: Path) -> None:
    materialize(client, work)
    if client == "nanogpt":
        nanogpt_data(work)


def _clean(work: Path) -> None:
    (work / "snapshot.pt").unlink(missing_ok=True)
    for old in (work / "out-tiny").glob("*"):
        old.unlink()


def bench(name: str, repeats: int) -> dict:
    client, nproc, argv, last = SCRIPTS[name]
    with tempfile.TemporaryDirectory(prefix=f"exit-parity-{name}-", dir="/tmp") as tmp:
        work = Path(tmp)
        _prepare(client, work)
        walls: dict[str, list[float]] = {"torchrun": [], "dlrover-run": []}
        tails: dict[str, list[float]] = {"torchrun": [], "dlrover-run": []}
        codes: dict[str, list[int | None]] = {"torchrun": [], "dlrover-run": []}
        for i in range(repeats):
            for launcher in ("torchrun", "dlrover-run"):
                _clean(work)
                extra = [f"--job-dir={work / f'job{i}'}"] if launcher == "dlrover-run" else []
                cmd = [str(BIN / launcher), "--standalone", f"--nproc-per-node={nproc}", *extra]
                run = launch([*cmd, *argv], cwd=work, timeout_s=300)
                codes[launcher].append(run.rc)
                walls[launcher].append(round(run.wall_s, 2))
                if run.rc == 0:
                    tails[launcher].append(round(run.exit_after(last), 2))
    med = {k: statistics.median(v) for k, v in walls.items()}
    tail = {k: statistics.median(v) if v else None for k, v in tails.items()}
    return {
        "wall_s": walls,
        "median_s": med,
        "ratio": round(med["dlrover-run"] / med["torchrun"], 3),
        "bound_s": round(1.3 * med["torchrun"] + 5, 2),  # issue 45: at most 1.3 x torchrun + 5 s
        "exit_after_last_step_s": tail,
        "exit_codes": codes,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--scripts", default=",".join(SCRIPTS))
    args = p.parse_args()
    out = {name: bench(name, args.repeats) for name in args.scripts.split(",")}
    print(json.dumps({"exit_parity": out, "repeats": args.repeats}))


if __name__ == "__main__":
    main()
