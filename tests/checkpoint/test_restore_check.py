"""Validated restore: a step whose state holds a NaN (or that the user's `validate` refuses)
is never trained on; the next older step is restored, from memory, else from storage.

The check itself is table-driven (`first_nonfinite`, `plan_older`); the restores run in one
process with its in-process saver, on the real /dev/shm and real storage (a directory).
Two real ranks (gloo), where one rank alone rejects a step: test_restore_agreement.py.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from dlrover_hpc.checkpoint import DdpCheckpointer, FsdpShardCheckpointer, StorageType
from dlrover_hpc.checkpoint.env import WorkerEnv
from dlrover_hpc.checkpoint.event_sinks import ListEventSink
from dlrover_hpc.checkpoint.testing import check_filled, filled_state
from dlrover_hpc.checkpoint.trainer.restore_agreement import (
    Agreement,
    Choice,
    Holdings,
    Part,
    Rejection,
    Source,
    plan_older,
    restore_agreed,
)
from dlrover_hpc.checkpoint.trainer.restore_check import RestoreCheck, first_nonfinite
from dlrover_hpc.errors import RestoreRejectedError
from dlrover_hpc.trainer.flash_checkpoint.ddp import DdpCheckpointer as DlroverDdpCheckpointer

pytestmark = pytest.mark.timeout(120)

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        ({"w": torch.ones(4)}, None),
        ({"w": torch.tensor([1.0, NAN, 2.0])}, "non-finite values in w (1 of 3: nan)"),
        (
            {"a": {"b": [torch.zeros(2), torch.tensor([INF])]}},
            "non-finite values in a.b.1 (1 of 1: inf)",
        ),
        (
            {"opt": {0: {"exp_avg": torch.tensor([-INF, -INF])}}},
            "non-finite values in opt.0.exp_avg (2 of 2: -inf)",
        ),
        (
            (torch.ones(2), torch.tensor([NAN], dtype=torch.bfloat16)),
            "non-finite values in 1 (1 of 1: nan)",
        ),
        (torch.tensor([NAN, NAN]), "non-finite values in the state (2 of 2: nan)"),
        # whose sum overflows, yet every element is finite: fp16 (max 65504) and fp32
        ({"h": torch.full((64,), 60000.0, dtype=torch.float16)}, None),
        ({"f": torch.full((4,), 3e38)}, None),
        ({"c": torch.tensor([complex(1, NAN)])}, "non-finite values in c (1 of 1: (1+nanj))"),
        # not floating: never checked; not tensors: ignored
        ({"i": torch.tensor([2**62, 2**62]), "step": 5, "lr": NAN, "s": "nan"}, None),
        ({"empty": torch.empty(0)}, None),
    ],
)
def test_first_nonfinite(state: Any, expected: str | None) -> None:
    assert first_nonfinite(state) == expected


@pytest.mark.parametrize(
    ("check", "state", "expected"),
    [
        (RestoreCheck(), {"w": torch.tensor([NAN])}, "non-finite values in w (1 of 1: nan)"),
        (RestoreCheck(finite=False), {"w": torch.tensor([NAN])}, None),
        (RestoreCheck(validate=lambda s: s["step"] > 3), {"step": 2}, "validate() returned False"),
        (RestoreCheck(validate=lambda s: s["step"] > 3), {"step": 4}, None),
        (RestoreCheck(validate=lambda s: s["nope"]), {}, "validate() raised KeyError: 'nope'"),
        (RestoreCheck(validate=lambda s: 1), {}, "validate() returned 1, not True or False"),
        # the finite check first: the user's check never sees a NaN
        (
            RestoreCheck(validate=lambda s: True),
            {"w": torch.tensor([INF])},
            "non-finite values in w (1 of 1: inf)",
        ),
    ],
)
def test_restore_check(check: RestoreCheck, state: Any, expected: str | None) -> None:
    assert check.why_rejected(state) == expected


def _p(step: int, save: int = 7, part: int = 0, parts: int = 1) -> Part:
    return Part(step=step, token=save, part=part, parts=parts, nbytes=100)


@pytest.mark.parametrize(
    ("ranks", "below", "storage_next", "expected"),
    [
        # a node's second buffer holds the step before the rejected one
        ([Holdings(memory=(_p(6), _p(4)), newest_committed=6, token=9)], 6, 2, (4, 7, ())),
        # storage has a newer step than memory's older one: storage's next
        ([Holdings(memory=(_p(6), _p(4)), newest_committed=6, token=9)], 6, 5, None),
        # the same step committed and in memory: memory's (no storage read)
        ([Holdings(memory=(_p(6), _p(4)), newest_committed=6, token=9)], 6, 4, (4, 7, ())),
        # nothing older in memory
        ([Holdings(memory=(_p(6),), newest_committed=6, token=9)], 6, -1, None),
        # sharded: step 4 has both parts on rank 0's node only, rank 1 receives its part
        (
            [
                Holdings(
                    memory=(_p(4, part=0, parts=2), _p(4, part=1, parts=2)),
                    newest_committed=-1,
                    token=9,
                    need=(0, 2),
                ),
                Holdings(
                    memory=(_p(6, part=1, parts=2),), newest_committed=-1, token=9, need=(1, 2)
                ),
            ],
            6,
            -1,
            (4, 7, ((0, 1),)),
        ),
        # sharded: a part of step 4 is nowhere
        (
            [
                Holdings(
                    memory=(_p(4, part=0, parts=2),), newest_committed=-1, token=9, need=(0, 2)
                ),
                Holdings(
                    memory=(_p(6, part=1, parts=2),), newest_committed=-1, token=9, need=(1, 2)
                ),
            ],
            6,
            -1,
            None,
        ),
    ],
)
def test_plan_older(
    ranks: list[Holdings], below: int, storage_next: int, expected: tuple[int, int, Any] | None
) -> None:
    plan = plan_older(ranks, below=below, storage_next=storage_next, token=9)
    if expected is None:
        assert plan is None
        return
    assert plan is not None and plan.source == Source.MEMORY and plan.token == 9
    assert (plan.step, plan.save, tuple((t.src, t.dst) for t in plan.transfers)) == expected


# ---------------------------------------------------------------------------- real restores
def _env(job: str) -> WorkerEnv:
    env = {"DLROVER_HPC_JOB_ID": job, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    return WorkerEnv.from_environ({**env, "LOCAL_WORLD_SIZE": "1"})


def _poisoned(step: int) -> dict[str, Any]:
    state = filled_state(step)
    state["model"]["layer2.weight"][3, 5] = NAN
    return state


def _rejected(events: ListEventSink) -> list[tuple[int, str, str, int, str]]:
    return [
        (e["step"], e["source"], e["why"], e["next_step"], e["next_source"])
        for e in events.named("restore_rejected")
    ]


WHY = "non-finite values in model.layer2.weight (1 of 4096: nan)"


def test_a_nan_in_the_newest_memory_step_restores_the_older_buffer(
    tmp_path: Path, job: str
) -> None:
    events = ListEventSink()
    ckpt = DdpCheckpointer(str(tmp_path), env=_env(job), events=events)
    try:
        assert ckpt.save_checkpoint(4, filled_state(4), storage_type=StorageType.DISK)
        assert ckpt.wait_latest_checkpoint(30)
        assert ckpt.save_checkpoint(5, filled_state(5), storage_type=StorageType.MEMORY)
        assert ckpt.save_checkpoint(6, _poisoned(6), storage_type=StorageType.DISK)
        assert ckpt.wait_latest_checkpoint(30)  # step 6 is committed on storage too

        target = filled_state(0)
        state = ckpt.load_checkpoint(state_dict=target)
        check_filled(state, 5)  # the second buffer's step, newer than storage's next (4)
        assert ckpt.last_restored == (5, "memory")
        assert state["model"]["layer2.weight"] is target["model"]["layer2.weight"]
        assert _rejected(events) == [(6, "memory", WHY, 5, "memory")]
        assert [e["step"] for e in events.named("checkpoint_restored")] == [5]

        # step 6 is out of storage's commits (its record renamed, its file kept) and out of
        # memory (its segment emptied): no later restore sees it, none rejects it again
        commits = tmp_path / ".dlrover-hpc" / "commits"
        assert sorted(p.name for p in commits.iterdir()) == [
            "step-000000000004.json",
            "step-000000000006.json.rejected",
        ]
        assert (tmp_path / "dlrover_latest.txt").read_text() == "4\n"
        assert (tmp_path / "checkpoint-6.pt").exists()
        check_filled(ckpt.load_checkpoint(), 5)
        assert ckpt.last_restored == (5, "memory")
        check_filled(ckpt.load_checkpoint(memory=False), 4)
        assert ckpt.last_restored == (4, "storage")
        assert len(events.named("restore_rejected")) == 1
        # the next save goes to the emptied buffer: step 5, restored, stays in the other
        assert ckpt.save_checkpoint(7, filled_state(7), storage_type=StorageType.MEMORY)
        assert sorted(ckpt.engine.memory_steps()) == [5, 7]
    finally:
        ckpt.close()


def test_a_nan_on_storage_restores_the_older_committed_step(tmp_path: Path, job: str) -> None:
    events = ListEventSink()
    ckpt = DdpCheckpointer(str(tmp_path), env=_env(job), events=events, keep_last=3)
    try:
        for step in (2, 4):  # each persisted before the next (a save does not wait for it)
            assert ckpt.save_checkpoint(step, filled_state(step), storage_type=StorageType.DISK)
            assert ckpt.wait_latest_checkpoint(30)
        assert ckpt.save_checkpoint(6, _poisoned(6), storage_type=StorageType.DISK)
        assert ckpt.wait_latest_checkpoint(30)
        # memory=False (as after a node was replaced): storage's 6 is rejected, 4 loads
        check_filled(ckpt.load_checkpoint(memory=False), 4)
        assert ckpt.last_restored == (4, "storage")
        assert _rejected(events) == [(6, "storage", WHY, 4, "storage")]
        assert [r.step for r in ckpt.engine.cdir.records()] == [4, 2]
        # retention no longer counts step 6: a new step 5 keeps 2, 4 and 5
        assert ckpt.save_checkpoint(5, filled_state(5), storage_type=StorageType.DISK)
        assert ckpt.wait_latest_checkpoint(30)
        assert [r.step for r in ckpt.engine.cdir.records()] == [5, 4, 2]
        assert (tmp_path / "dlrover_latest.txt").read_text() == "5\n"
    finally:
        ckpt.close()


def test_a_user_check_rejects_steps_until_one_passes(tmp_path: Path, job: str) -> None:
    events = ListEventSink()
    seen: list[int] = []

    def validate(state: Any) -> bool:
        seen.append(state["step"])
        return bool(state["step"] <= 2)

    ckpt = DdpCheckpointer(str(tmp_path), env=_env(job), events=events, validate=validate)
    try:
        for step in (1, 2, 3):  # each persisted before the next (a save does not wait for it)
            assert ckpt.save_checkpoint(step, filled_state(step), storage_type=StorageType.DISK)
            assert ckpt.wait_latest_checkpoint(30)
        assert ckpt.save_checkpoint(4, filled_state(4), storage_type=StorageType.MEMORY)
        check_filled(ckpt.load_checkpoint(), 2)
        # memory 4, then memory 3 (the second buffer; storage's newest is 3 too), then 2
        assert seen == [4, 3, 2] and ckpt.last_restored == (2, "storage")
        assert [(s, src, nxt) for s, src, _, nxt, _ in _rejected(events)] == [
            (4, "memory", 3),
            (3, "memory", 2),
        ]
        assert {why for _, _, why, _, _ in _rejected(events)} == {"validate() returned False"}
        # the rejected saves are gone: memory holds neither 4 nor 3, storage commits 1 and 2
        assert ckpt.engine.memory_steps() == {}
        assert [r.step for r in ckpt.engine.cdir.records()] == [2, 1]
        # a validate of this call replaces the constructor's (which refuses step 5)
        assert ckpt.save_checkpoint(5, filled_state(5), storage_type=StorageType.MEMORY)
        check_filled(ckpt.load_checkpoint(validate=lambda s: s["step"] == 5), 5)
        assert seen == [4, 3, 2] and len(_rejected(events)) == 2
    finally:
        ckpt.close()


def test_no_step_left_is_an_error_that_names_every_step(tmp_path: Path, job: str) -> None:
    events = ListEventSink()
    ckpt = DdpCheckpointer(str(tmp_path), env=_env(job), events=events)
    try:
        assert ckpt.save_checkpoint(1, _poisoned(1), storage_type=StorageType.DISK)
        assert ckpt.wait_latest_checkpoint(30)
        assert ckpt.save_checkpoint(2, _poisoned(2), storage_type=StorageType.MEMORY)
        with pytest.raises(RestoreRejectedError) as caught:
            ckpt.load_checkpoint()
        assert str(caught.value) == (
            f"checkpoint restore: no step left to train on in memory or in {tmp_path}: "
            f"step 2 (memory): {WHY}; step 1 (memory): {WHY}. "
            "No state was restored; starting over would silently lose the training so far. "
            "Fix: look at those steps (their files stay on storage), remove them to start "
            "over, or pass check_finite=False (or another validate=) to load them anyway"
        )
        assert _rejected(events)[-1][3:] == (-1, "none")
        assert events.named("checkpoint_restored") == []
        # nothing was taken out: the next try refuses them again, as loudly
        with pytest.raises(RestoreRejectedError):
            ckpt.load_checkpoint()
        assert len(_rejected(events)) == 4
        # memory only (the caller has a fallback, e.g. DLRover's resume_path): no state, {}
        assert ckpt.load_checkpoint(storage=False) == {}
        assert len(_rejected(events)) == 6
        # the off switch loads it as it is
        off = DdpCheckpointer(str(tmp_path), env=_env(job), check_finite=False, tag="off")
        try:
            state = off.load_checkpoint(memory=False)
            assert state["step"] == 1 and math.isnan(float(state["model"]["layer2.weight"][3, 5]))
        finally:
            off.close(remove_segments=True)
    finally:
        ckpt.close()
    assert os.path.exists(tmp_path / "checkpoint-1.pt")  # a rejected step is never deleted


def test_dlrover_checkpointer_takes_validate(tmp_path: Path, job: str) -> None:
    events = ListEventSink()
    ckpt = DlroverDdpCheckpointer(str(tmp_path), env=_env(job), events=events)
    try:
        for step in (1, 2):
            assert ckpt.save_checkpoint(step, filled_state(step), storage_type=StorageType.DISK)
        assert ckpt.wait_latest_checkpoint(30)
        check_filled(ckpt.load_checkpoint(validate=lambda s: s["step"] == 1), 1)
        assert ckpt.last_restored == (1, "memory")
        assert [e["step"] for e in events.named("restore_rejected")] == [2]
    finally:
        ckpt.close()


def test_fsdp_checkpointer_rejects_a_nan_shard(tmp_path: Path, job: str) -> None:
    events = ListEventSink()
    ckpt = FsdpShardCheckpointer(str(tmp_path), env=_env(job), events=events)
    try:
        assert ckpt.save_checkpoint(1, {"w": torch.full((8,), 1.0)}, storage_type=StorageType.DISK)
        bad = {"w": torch.full((8,), 2.0)}
        bad["w"][7] = INF
        assert ckpt.save_checkpoint(2, bad, storage_type=StorageType.DISK)
        assert ckpt.wait_latest_checkpoint(30)
        target = {"w": torch.zeros(8)}
        assert ckpt.load_checkpoint(target) is target
        assert torch.equal(target["w"], torch.full((8,), 1.0))
        assert ckpt.last_restored == (1, "memory")
        assert _rejected(events) == [
            (2, "memory", "non-finite values in w (1 of 8: inf)", 1, "memory")
        ]
    finally:
        ckpt.close()


def test_a_check_that_raises_rejects_the_step_instead_of_leaving_other_ranks_waiting() -> None:
    def check(state: Any) -> str | None:
        if state["step"] == 3:
            raise RuntimeError("boom")
        return None

    seen: list[Rejection] = []
    choice = Choice(source=Source.STORAGE, step=3, token=1, storage_step=3)
    restored = restore_agreed(
        Agreement(),
        choice,
        [3, 2],
        lambda source, step, plan: lambda: ({"step": step}, 0),
        check=check,
        on_rejected=seen.append,
    )
    assert (restored.source, restored.step, restored.result) == (Source.STORAGE, 2, {"step": 2})
    assert [(r.step, r.why, r.next_step) for r in seen] == [
        (3, "the check itself failed: RuntimeError: boom", 2)
    ]
