"""Helpers for testing code that uses flash checkpoints (and for our own tests).

- `filled_state(step)` / `check_filled(state, step)`: state dicts whose every value says which
  step wrote it, so a torn or mixed checkpoint cannot pass for a good one;
- `NullLink`: a saver link that persists nothing (memory-only engines in tests);
- `job_segments`, `remove_job_segments`: the /dev/shm entries of one job id.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from dlrover_hpc.checkpoint.env import DEFAULT_SHM_DIR, SEGMENT_PREFIX, current_user, safe_component


def filled_state(step: int, *, tensors: int = 6, numel: int = 4096) -> dict[str, Any]:
    """A model-and-optimizer-like state whose tensors and scalars all encode `step`."""
    model = {}
    for i in range(tensors):
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        rows = max(1, numel // 64)
        model[f"layer{i}.weight"] = torch.full((rows, 64), float(_tag(step, i)), dtype=dtype)
        model[f"layer{i}.bias"] = torch.full((64,), float(_tag(step, i)), dtype=torch.float32)
    state = {
        i: {"step": torch.tensor(float(step)), "exp_avg": torch.full((8,), float(step))}
        for i in range(2)
    }
    optim = {
        "state": state,
        "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1]}],
    }
    return {"model": model, "optim": optim, "step": step, "meta": {"tags": ["a", step]}}


def _tag(step: int, index: int) -> int:
    # exact in bf16 (8 bits of mantissa): small integers only
    return (step * 7 + index) % 200


def check_filled(state: Any, step: int) -> None:
    """Raises AssertionError unless `state` is exactly what `filled_state(step)` saved."""
    assert state["step"] == step, f"step {state['step']} != {step}"
    assert state["meta"] == {"tags": ["a", step]}, state["meta"]
    for name, t in state["model"].items():
        i = int(name.split(".")[0].removeprefix("layer"))
        want = float(_tag(step, i))
        assert bool((t == want).all()), f"{name} is not uniformly {want} (torn or mixed)"
    for entry in state["optim"]["state"].values():
        assert float(entry["step"]) == float(step)
        assert bool((entry["exp_avg"] == float(step)).all())
    assert state["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)


class NullLink:
    """A saver link that accepts and drops persist requests (memory-only tests)."""

    in_process = False

    def __init__(self, prefix: str, shm_dir: str = DEFAULT_SHM_DIR) -> None:
        self.prefix = prefix
        self.shm_dir = shm_dir
        self.submitted: list[tuple[str, int]] = []
        self.replicated: list[tuple[str, int, int]] = []

    def submit(self, segment_path: str, step: int) -> None:
        self.submitted.append((segment_path, step))

    def replicate(self, segment_path: str, step: int, count: int) -> None:
        self.replicated.append((segment_path, step, count))

    def release(self, segment_path: str) -> bool:
        return False  # nothing is ever pinned

    def wait_committed(
        self, ckpt_dir: str, step: int, timeout_s: float, rank: int, token: int
    ) -> bool:
        return False

    def close(self) -> None:
        return None


def job_prefix(job_id: str) -> str:
    return f"{SEGMENT_PREFIX}{safe_component(current_user())}-{safe_component(job_id)}-"


def job_segments(job_id: str, shm_dir: str = DEFAULT_SHM_DIR) -> list[str]:
    prefix = job_prefix(job_id)
    try:
        return sorted(os.path.join(shm_dir, n) for n in os.listdir(shm_dir) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def remove_job_segments(job_id: str, shm_dir: str = DEFAULT_SHM_DIR) -> list[str]:
    removed = []
    for path in job_segments(job_id, shm_dir):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed
