"""ElasticDistributedSampler: DLRover's behaviour, and exact resumption across world sizes."""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlrover_hpc.trainer.elastic import ElasticDistributedSampler


class Data(torch.utils.data.Dataset[int]):
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


def samplers(size: int, world: int, **kw: Any) -> list[ElasticDistributedSampler[int]]:
    return [
        ElasticDistributedSampler(Data(size), num_replicas=world, rank=r, **kw)
        for r in range(world)
    ]


@dataclass
class Job:
    """Every rank's sampler simulated in one process, one segment (world size) at a time."""

    size: int
    seed: int = 7
    drop_last: bool = False
    state: dict[str, int] | None = None
    counter: int = 0  # the script's step counter (batches per rank), saved with the state
    micro_steps: list[list[int]] = field(default_factory=list)  # each global micro-step
    finishing_pass: tuple[int, int] | None = None  # (position, world) of the pass that ended

    def segment(self, world: int, micro: int, steps: int | None) -> None:
        """``steps`` micro-steps (None: to the end of the pass) at ``world`` ranks."""
        ranks = samplers(self.size, world, seed=self.seed, drop_last=self.drop_last)
        for s in ranks:
            if self.state is not None:
                s.load_state_dict(self.state)
            s.set_epoch(3)  # the script's loop: keeps the loaded position of epoch 3
        start = self.state["completed_num"] if self.state else 0
        streams = [list(s) for s in ranks]
        assert len({len(x) for x in streams}) == 1 and len(streams[0]) == len(ranks[0])
        available = math.ceil(len(streams[0]) / micro)
        taken = available if steps is None else min(steps, available)
        for j in range(taken):
            self.micro_steps.append([i for x in streams for i in x[j * micro : (j + 1) * micro]])
        if taken == available and available and self.finishing_pass is None:
            self.finishing_pass = (start, world)
        self.counter += taken
        states = [s.state_dict(self.counter, micro) for s in ranks]
        assert all(x == states[0] for x in states)
        self.state = states[0]


def permutation(size: int, seed: int) -> list[int]:
    g = torch.Generator()
    g.manual_seed(seed + 3)
    return torch.randperm(size, generator=g).tolist()


# --- DLRover's behaviour ------------------------------------------------------------------


def test_dlrover_checkpoint_and_resume_at_another_world_size() -> None:
    """DLRover's test: 4 batches of 8 on 2 ranks = 64 samples; 5 ranks resume at 64."""
    sampler = samplers(100, 2, shuffle=False)[0]
    it = iter(sampler)
    for _ in range(32):
        next(it)
    state = sampler.state_dict(4.0, 8)  # type: ignore[arg-type]  # DLRover's test passes i / b
    assert state == {"completed_num": 64, "epoch": 0, "iter_step": 4}
    resumed = samplers(100, 5, shuffle=False)
    for s in resumed:
        s.load_state_dict(state)
    # 36 left on 5 ranks: 8 each, padded with positions 64.. (ranks 1-4 repeat one each)
    assert [list(s) for s in resumed] == [
        list(range(64 + r, 100, 5)) + ([63 + r] if r else []) for r in range(5)
    ]
    resumed[0].set_epoch(1)  # a new epoch starts at 0
    assert next(iter(resumed[0])) == 0 and len(resumed[0]) == 20


def test_defaults_without_torch_distributed() -> None:
    sampler = ElasticDistributedSampler(Data(10), shuffle=False)
    assert (sampler.num_replicas, sampler.rank, list(sampler)) == (1, 0, list(range(10)))


def test_state_saved_by_dlrover_counts_as_dlrover() -> None:
    """No ``iter_step`` in the state: ``state_dict`` uses DLRover's formula in that epoch."""
    s = samplers(96, 4, shuffle=False)[0]
    s.load_state_dict({"completed_num": 32, "epoch": 0})
    assert next(iter(s)) == 32 and len(s) == 16
    assert s.state_dict(6, 2)["completed_num"] == 48  # 6 x 2 x 4, from the epoch's start


def test_completed_num_beyond_the_dataset_wraps_as_dlrover(
    caplog: pytest.LogCaptureFixture,
) -> None:
    s = samplers(50, 2, shuffle=False)[0]
    with caplog.at_level(logging.WARNING):
        s.load_state_dict({"completed_num": 120, "epoch": 2})
    assert s.epoch == 2 and next(iter(s)) == 20 and "modulo" in caplog.text


def test_counter_across_epochs_falls_back_to_dlrover_formula(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """DLRover's examples count steps across epochs: more batches than the pass has."""
    s = samplers(64, 2, shuffle=False)[0]
    s.set_epoch(1)
    with caplog.at_level(logging.WARNING):
        state = s.state_dict(20, 2)  # epoch 0 took 16 steps of 2 x 2; 4 more in epoch 1
    assert state["completed_num"] == 80 and "across epochs" in caplog.text
    resumed = samplers(64, 2, shuffle=False)[0]
    resumed.load_state_dict(state)
    assert next(iter(resumed)) == 16  # 80 mod 64: the 4 steps of epoch 1


def test_step_counter_must_continue_from_the_checkpoint() -> None:
    s = samplers(64, 2)[0]
    s.load_state_dict({"completed_num": 16, "epoch": 0, "iter_step": 10})
    assert s.state_dict(12, 2)["completed_num"] == 16 + 2 * 2 * 2
    with pytest.raises(ValueError, match="iter_step=3 is less than the step the sampler resumed"):
        s.state_dict(3, 2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_replicas": 0}, "num_replicas must be >= 1"),
        ({"num_replicas": 2, "rank": 2}, "Invalid rank 2"),
    ],
)
def test_bad_arguments(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ElasticDistributedSampler(Data(4), **kwargs)


def test_bad_state_and_counts() -> None:
    s = samplers(8, 1)[0]
    with pytest.raises(ValueError, match="micro_batch_size must be an integer >= 1"):
        s.state_dict(1, 0)
    with pytest.raises(ValueError, match="iter_step must be an integer >= 0"):
        s.state_dict(-1, 2)
    with pytest.raises(ValueError, match="completed_num >= 0"):
        s.load_state_dict({"completed_num": -1, "epoch": 0})


def test_drop_last_drops_the_tail_of_the_pass() -> None:
    ranks = samplers(10, 4, shuffle=False, drop_last=True)
    assert [list(s) for s in ranks] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    state = ranks[0].state_dict(1, 2)
    assert state["completed_num"] == 8
    small = samplers(10, 2, shuffle=False, drop_last=True)  # the tail fits 2 ranks
    for s in small:
        s.load_state_dict(state)
    assert [list(s) for s in small] == [[8], [9]]


# --- resumption across world sizes (property tests) ----------------------------------------

WORLDS = [1, 2, 3, 4, 6]  # divisors of 12: the global batch 12 x g splits evenly


@st.composite
def fixed_global_batch_runs(draw: st.DrawFn) -> tuple[int, int, list[tuple[int, int, int]]]:
    g = draw(st.integers(1, 3))
    global_batch = 12 * g
    n_steps = draw(st.integers(1, 6))
    segments = []
    for _ in range(draw(st.integers(1, 4))):
        world = draw(st.sampled_from(WORLDS))
        per_rank = global_batch // world
        micro = draw(st.sampled_from([d for d in range(1, per_rank + 1) if per_rank % d == 0]))
        accumulate = per_rank // micro
        segments.append((world, micro, accumulate * draw(st.integers(0, n_steps))))
    return global_batch, n_steps, segments


@settings(max_examples=200, deadline=None, database=None)
@given(fixed_global_batch_runs(), st.sampled_from(WORLDS))
def test_fixed_global_batch_resumes_exactly(
    run: tuple[int, int, list[tuple[int, int, int]]], last_world: int
) -> None:
    """World sizes change between checkpoints (e.g. 4 -> 3 -> 4) at a fixed global batch:
    each optimizer step takes the same indices as an undisturbed run, each index once."""
    global_batch, n_steps, segments = run
    size = global_batch * n_steps
    job = Job(size)
    windows: list[int] = []  # micro-steps per optimizer step, in order
    for world, micro, steps in [*segments, (last_world, global_batch // last_world, None)]:
        before = len(job.micro_steps)
        job.segment(world, micro, steps)
        accumulate = global_batch // (world * micro)
        taken = len(job.micro_steps) - before
        assert taken % accumulate == 0
        windows += [accumulate] * (taken // accumulate)
    perm = permutation(size, job.seed)
    optimizer_steps, i = [], 0
    for w in windows:
        optimizer_steps.append(sorted(x for m in job.micro_steps[i : i + w] for x in m))
        i += w
    expected = [sorted(perm[k * global_batch : (k + 1) * global_batch]) for k in range(n_steps)]
    assert optimizer_steps == expected
    assert job.state == {"completed_num": size, "epoch": 3, "iter_step": job.counter}


@settings(max_examples=200, deadline=None, database=None)
@given(
    size=st.integers(1, 90),
    segments=st.lists(
        st.tuples(st.integers(1, 7), st.integers(1, 5), st.integers(0, 12)), max_size=4
    ),
    last=st.tuples(st.integers(1, 7), st.integers(1, 5)),
    drop_last=st.booleans(),
)
def test_any_sizes_account_for_padding_exactly(
    size: int,
    segments: list[tuple[int, int, int]],
    last: tuple[int, int],
    drop_last: bool,
) -> None:
    """Any dataset size, world sizes and batch sizes: each global micro-step is the next
    block of the permutation; an index is repeated only as the finishing pass's padding
    (drop_last=False), or dropped only as its tail (drop_last=True)."""
    job = Job(size, drop_last=drop_last)
    for world, micro, steps in [*segments, (*last, None)]:
        job.segment(world, micro, steps)
    perm = permutation(size, job.seed)
    consumed = [i for m in job.micro_steps for i in m]
    position = 0
    for m in job.micro_steps:  # each micro-step short of the padded tail: the next block
        if position + len(m) <= size:
            assert sorted(m) == sorted(perm[position : position + len(m)])
        position += len(m)
    assert job.state is not None
    if drop_last:
        end = job.state["completed_num"]
        assert sorted(consumed) == sorted(perm[:end]) and 0 <= size - end < last[0]
    else:
        assert job.finishing_pass is not None and job.state["completed_num"] == size
        start, world = job.finishing_pass
        rest = perm[start:]
        extra = [rest[i % len(rest)] for i in range(-len(rest) % world)]
        assert Counter(consumed) == Counter(perm) + Counter(extra)


def test_four_three_four_with_real_dataloaders() -> None:
    """The scenario with real DataLoaders (num_workers=0): 4 ranks, then 3, then 4 again."""
    size, global_batch = 120, 12
    seen: list[int] = []
    state: dict[str, int] | None = None
    counter = 0
    for world, steps in ((4, 3), (3, 2), (4, None)):
        micro = global_batch // world
        loaders = []
        for r in range(world):
            s = ElasticDistributedSampler(Data(size), num_replicas=world, rank=r, seed=1)
            if state is not None:
                s.load_state_dict(state)
            loaders.append(torch.utils.data.DataLoader(Data(size), batch_size=micro, sampler=s))
        taken = 0
        for batches in zip(*loaders, strict=True):
            seen += [int(i) for b in batches for i in b]
            taken += 1
            if taken == steps:
                break
        counter += taken
        state = loaders[0].sampler.state_dict(counter, micro)  # type: ignore[attr-defined]
    assert sorted(seen) == list(range(size)) and state == {
        "completed_num": size,
        "epoch": 0,
        "iter_step": counter,
    }
