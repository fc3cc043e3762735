"""The trainer API in one process (in-process saver), on the real /dev/shm."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from dlrover_hpc.checkpoint import (
    DdpCheckpointer,
    FsdpShardCheckpointer,
    LocalCommitCoordinator,
    RankCheckpointer,
    StorageType,
)
from dlrover_hpc.checkpoint.env import WorkerEnv
from dlrover_hpc.checkpoint.event_sinks import ListEventSink
from dlrover_hpc.checkpoint.testing import (
    check_filled,
    filled_state,
    job_segments,
    remove_job_segments,
)
from dlrover_hpc.checkpoint.trainer.saver_connection import InProcessSaver
from dlrover_hpc.localslurm import wait_for
from dlrover_hpc.worker import membership

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]


def _env(job: str, *, rank: int = 0, world: int = 1, **extra: str) -> WorkerEnv:
    env = {
        "DLROVER_HPC_JOB_ID": job,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        **extra,
    }
    return WorkerEnv.from_environ(env)


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(8, 32)).sum().backward()
    opt.step()
    return model, opt


def test_ddp_memory_and_disk_saves_persist_commit_and_restore(tmp_path: Path, job: str) -> None:
    events = ListEventSink()
    ckpt = DdpCheckpointer(str(tmp_path), env=_env(job), keep_last=2, events=events)
    try:
        for step in range(1, 7):
            kind = StorageType.DISK if step % 2 == 0 else StorageType.MEMORY
            assert ckpt.save_checkpoint(step, filled_state(step), storage_type=kind)
        assert ckpt.wait_latest_checkpoint(30)
        assert (tmp_path / "dlrover_latest.txt").read_text() == "6\n"
        # Saves outpace the persists here: a DISK step still queued when the next save found
        # both buffers pinned is superseded, and the step that took its buffer (a MEMORY one
        # too) is persisted in its place; every DISK step is committed or superseded by a newer
        # committed one, never waited for.
        committed = sorted(
            {e["step"] for e in events.named("checkpoint_persisted") if e["committed"]}
        )
        superseded = {e["step"] for e in events.named("checkpoint_superseded")}
        assert committed[-1] == 6
        for step in (2, 4, 6):
            assert step in committed or (step in superseded and any(c > step for c in committed)), (
                step,
                committed,
                superseded,
            )
        # keep_last=2: the saver removes the older ones right after it commits step 6; the wait
        # can return from the commit record on storage in between (cc28)
        kept = [f"checkpoint-{s}.pt" for s in committed[-2:]]
        wait_for(
            lambda: sorted(p.name for p in tmp_path.glob("*.pt")) == kept,
            timeout_s=10,
            what=f"keep_last=2 to keep only {kept}",
        )
        check_filled(torch.load(tmp_path / "checkpoint-6.pt"), 6)  # plain torch.load
        assert len(job_segments(job)) == 2  # double-buffered

        state = ckpt.load_checkpoint()
        check_filled(state, 6)
        assert ckpt.last_restored == (6, "memory")
        saved = events.named("checkpoint_saved")
        assert [e["storage"] for e in saved[:2]] == ["memory", "disk"]
        assert all(e["blocking_s"] >= 0 and e["rank"] == 0 for e in saved)
        assert events.named("checkpoint_restored")[-1]["source"] == "memory"
    finally:
        ckpt.close()
    assert job_segments(job) == []  # the in-process owner removes its segments


def test_restore_copies_into_existing_tensors(tmp_path: Path, job: str) -> None:
    model, opt = _model_and_optimizer()
    ckpt = DdpCheckpointer(str(tmp_path), env=_env(job))
    try:
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        ckpt.save_checkpoint(3, {"model": model.state_dict(), "optim": opt.state_dict(), "step": 3})
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        target = {"model": model.state_dict(), "optim": opt.state_dict()}
        state = ckpt.load_checkpoint(state_dict=target)
        assert state["step"] == 3
        assert state["model"]["0.weight"].data_ptr() == model[0].weight.data_ptr()
        for key, value in model.state_dict().items():
            assert torch.equal(value, saved[key])
        opt.load_state_dict(state["optim"])

        assert ckpt.wait_latest_checkpoint(30)
        from_disk = ckpt.load_checkpoint(state_dict=target, memory=False)
        assert from_disk["step"] == 3 and ckpt.last_restored == (3, "storage")
    finally:
        ckpt.close()


def test_a_save_during_a_hung_persist_never_waits_and_the_newest_step_is_persisted(
    tmp_path: Path, job: str
) -> None:
    """Storage hangs in the persist of step 1.  Saves go on without waiting: MEMORY ones into
    the free buffer; a DISK step queued behind the hung persist is superseded when the next save
    needs its buffer, and once storage answers the newest step is the one persisted."""
    gate = threading.Event()
    entered = threading.Event()

    def slow(point: str) -> None:
        if point == "persist:start" and not entered.is_set():
            entered.set()
            gate.wait(30)

    env = _env(job)
    events = ListEventSink()
    link = InProcessSaver(env, commit=LocalCommitCoordinator(), fault=slow, events=events)
    link.core.stalls.stall_s = 0.5  # 5 s in a job
    ckpt = DdpCheckpointer(str(tmp_path), env=env, link=link, events=events)
    try:
        assert ckpt.save_checkpoint(1, filled_state(1), storage_type=StorageType.DISK)
        assert entered.wait(10)  # the saver holds step 1's buffer while persisting
        assert ckpt.save_checkpoint(2, filled_state(2), storage_type=StorageType.MEMORY)
        assert ckpt.save_checkpoint(3, filled_state(3), storage_type=StorageType.MEMORY)
        check_filled(ckpt.load_checkpoint(), 3)  # nothing was skipped
        # a DISK save now pins the second buffer too (queued behind step 1)
        assert ckpt.save_checkpoint(4, filled_state(4), storage_type=StorageType.DISK)
        for step in (5, 6, 7):  # each takes the queued buffer: no wait
            assert ckpt.save_checkpoint(step, filled_state(step))
        check_filled(ckpt.load_checkpoint(), 7)
        assert not (tmp_path / "checkpoint-1.pt").exists()  # storage still hangs
        superseded = events.named("checkpoint_superseded")
        assert [e["step"] for e in superseded][:1] == [4], superseded
        blocking = [e["blocking_s"] for e in events.named("checkpoint_saved") if e["step"] >= 5]
        assert len(blocking) == 3 and max(blocking) < 2.0, blocking
        stalled = wait_for(
            lambda: events.named("persist_stalled"), timeout_s=10, what="persist_stalled"
        )
        assert stalled[0]["ongoing"] is True and stalled[0]["step"] == 1
        assert stalled[0]["seconds"] >= 0.5 and stalled[0]["path"].endswith("checkpoint-1.pt")
        time.sleep(1.0)
        gate.set()
        assert ckpt.wait_latest_checkpoint(30)
        check_filled(torch.load(tmp_path / "checkpoint-1.pt"), 1)
        ended = [e for e in events.named("persist_stalled") if not e["ongoing"]]
        assert len(ended) == 1 and ended[0]["seconds"] >= 1.5, ended
        assert ended[0]["since"] == stalled[0]["since"]
        # the released buffer's newest step is persisted in the superseded one's place
        wait_for(
            lambda: (tmp_path / "checkpoint-7.pt").exists(),
            timeout_s=30,
            what="the newest step, 7, to be persisted once storage answers",
        )
        check_filled(torch.load(tmp_path / "checkpoint-7.pt"), 7)
        assert not (tmp_path / "checkpoint-4.pt").exists()
        assert (tmp_path / "dlrover_latest.txt").read_text() == "7\n"
        steps = [e["step"] for e in events.named("checkpoint_persisted") if e["committed"]]
        assert steps == sorted(steps) == [1, 7], steps  # steps commit in order
    finally:
        gate.set()
        ckpt.close()


def test_rank_checkpointer_commits_only_when_every_rank_is_durable(
    tmp_path: Path, job: str
) -> None:
    envs = [_env(job, rank=r, world=2) for r in range(2)]
    link = InProcessSaver(envs[0], commit=LocalCommitCoordinator())
    ckpts = [RankCheckpointer(str(tmp_path), env=e, link=link) for e in envs]
    try:
        assert ckpts[0].save_checkpoint(1, filled_state(1), storage_type=StorageType.DISK)
        assert link.core.wait_idle(30)
        assert not (tmp_path / "dlrover_latest.txt").exists()  # rank 1's part is missing
        assert ckpts[1].save_checkpoint(1, filled_state(101), storage_type=StorageType.DISK)
        assert ckpts[1].wait_latest_checkpoint(30)
        assert (tmp_path / "dlrover_latest.txt").read_text() == "1\n"
        check_filled(torch.load(tmp_path / "checkpoint-1" / "rank_00000.pt"), 1)
        check_filled(torch.load(tmp_path / "checkpoint-1" / "rank_00001.pt"), 101)
        check_filled(ckpts[1].load_checkpoint(memory=False), 101)
    finally:
        for c in ckpts:
            c.close()


def test_fsdp_checkpointer_single_process(tmp_path: Path, job: str) -> None:
    model, _ = _model_and_optimizer()
    ckpt = FsdpShardCheckpointer(str(tmp_path), env=_env(job))
    try:
        sd = {"model": model.state_dict(), "step": 2, "extra": {"lr": 0.5, "ids": [1, 2]}}
        assert ckpt.save_checkpoint(2, sd, storage_type=StorageType.DISK)
        assert ckpt.wait_latest_checkpoint(30)
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        target = {"model": model.state_dict(), "step": 0, "extra": {"lr": 0.0, "ids": [0, 0]}}
        out = ckpt.load_checkpoint(target)
        assert out["step"] == 2 and out["extra"] == {"lr": 0.5, "ids": [1, 2]}
        assert ckpt.last_restored == (2, "memory")
        assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
        files = sorted(os.listdir(tmp_path / "2"))
        assert files[0] == ".metadata" and files[1].startswith("__0_") and len(files) == 2
    finally:
        ckpt.close()


def test_checkpoints_load_without_this_package(tmp_path: Path, job: str) -> None:
    """No lock-in: torch.load for DDP files, torch.distributed.checkpoint for FSDP ones."""
    model, _ = _model_and_optimizer()
    ddp = DdpCheckpointer(str(tmp_path / "ddp"), env=_env(job))
    fsdp = FsdpShardCheckpointer(str(tmp_path / "fsdp"), env=_env(job), tag="fsdp")
    try:
        ddp.save_checkpoint(5, {"model": model.state_dict(), "step": 5})
        fsdp.save_checkpoint(5, {"model": model.state_dict(), "step": 5})
        assert ddp.wait_latest_checkpoint(30) and fsdp.wait_latest_checkpoint(30)
    finally:
        ddp.close()
        fsdp.close()
    torch.save(model.state_dict(), tmp_path / "expected.pt")
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["dlrover_hpc"] = None  # as if not installed: any import of it fails
        import torch, torch.distributed.checkpoint as dcp
        want = torch.load({str(tmp_path / "expected.pt")!r})
        got = torch.load({str(tmp_path / "ddp" / "checkpoint-5.pt")!r})
        assert got["step"] == 5 and all(torch.equal(got["model"][k], v) for k, v in want.items())
        sd = {{"model": {{k: torch.zeros_like(v) for k, v in want.items()}}, "step": 0}}
        dcp.load(sd, checkpoint_id={str(tmp_path / "fsdp" / "5")!r})
        assert sd["step"] == 5 and all(torch.equal(sd["model"][k], v) for k, v in want.items())
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_memory_restore_after_a_sigkilled_process_then_persisted(tmp_path: Path, job: str) -> None:
    """A process saves to memory only and is SIGKILLed; the next one restores from memory and,
    with no agent around, persists that step itself."""
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {str(REPO)!r})
        from dlrover_hpc.checkpoint import DdpCheckpointer, StorageType
        from dlrover_hpc.checkpoint.testing import filled_state
        ckpt = DdpCheckpointer({str(tmp_path)!r})
        ckpt.save_checkpoint(1, filled_state(1), storage_type=StorageType.DISK)
        assert ckpt.wait_latest_checkpoint(30)
        for step in (2, 3):
            ckpt.save_checkpoint(step, filled_state(step), storage_type=StorageType.MEMORY)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    env = {**os.environ, "DLROVER_HPC_JOB_ID": job}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=60)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert len(job_segments(job)) == 2  # the killed process's memory survives it

    events = ListEventSink()
    ckpt = DdpCheckpointer(str(tmp_path), env=_env(job), events=events)
    try:
        check_filled(ckpt.load_checkpoint(), 3)
        assert ckpt.last_restored == (3, "memory")
        assert ckpt.engine.link.wait_committed(str(tmp_path), 3, 30, 0, 0) or _committed(
            tmp_path, 3
        )
        check_filled(torch.load(tmp_path / "checkpoint-3.pt"), 3)
    finally:
        ckpt.close()


def _committed(path: Path, step: int) -> bool:
    tracker = path / "dlrover_latest.txt"
    return tracker.exists() and int(tracker.read_text()) >= step


def test_two_jobs_on_one_node_never_collide(tmp_path: Path, job: str) -> None:
    other = f"{job}x"
    a = DdpCheckpointer(str(tmp_path / "a"), env=_env(job))
    b = DdpCheckpointer(str(tmp_path / "b"), env=_env(other))
    try:
        a.save_checkpoint(1, filled_state(1), storage_type=StorageType.MEMORY)
        b.save_checkpoint(2, filled_state(2), storage_type=StorageType.MEMORY)
        assert set(job_segments(job)).isdisjoint(job_segments(other))
        check_filled(a.load_checkpoint(), 1)
        check_filled(b.load_checkpoint(), 2)
    finally:
        a.close()
        b.close()
        remove_job_segments(other)


def test_events_go_to_the_job_event_log(tmp_path: Path, job: str) -> None:
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    ckpt = DdpCheckpointer(str(tmp_path / "ck"), env=_env(job, DLROVER_HPC_JOB_DIR=str(job_dir)))
    try:
        ckpt.save_checkpoint(1, filled_state(1), storage_type=StorageType.DISK)
        ckpt.wait_latest_checkpoint(30)
        ckpt.load_checkpoint()
    finally:
        ckpt.close()
    lines = [json.loads(x) for x in (job_dir / "events.jsonl").read_text().splitlines()]
    names = [e["event"] for e in lines]
    assert "checkpoint_saved" in names and "checkpoint_restored" in names
    assert "checkpoint_persisted" in names
    for e in lines:
        assert isinstance(e["time"], float) and e["node"]
        assert e.get("rank") == 0 or e.get("ranks") == [0]


def _mount_tmpfs(path: Path, size: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)


def _umount(path: Path) -> None:
    with contextlib.suppress(subprocess.CalledProcessError):
        subprocess.run(["umount", str(path)], check=True)


def test_a_step_saved_across_an_abort_of_the_collectives_is_not_kept(
    tmp_path: Path, job: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 26 on NCCL: the in-process wrapper aborts a round's communicators; a GPU
    all-reduce that waited on a lost peer then ends with a partial sum, and the step computed
    from it must not become the newest in memory (the next round would restore it)."""
    ckpt = DdpCheckpointer(str(tmp_path), env=_env(job))
    copy = ckpt.engine.copier.copy
    try:
        assert ckpt.save_checkpoint(1, filled_state(1), storage_type=StorageType.MEMORY)
        membership.collectives_aborted()  # the round's collectives fail from here on
        assert not ckpt.save_checkpoint(2, filled_state(2), storage_type=StorageType.MEMORY)
        assert "step 2 not saved" in caplog.text
        membership.collectives_rejoined()  # the next round's process group

        def aborted_meanwhile(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
            copy(pairs)
            membership.collectives_aborted()  # the wrapper's thread, while the step is copied

        ckpt.engine.copier.copy = aborted_meanwhile  # type: ignore[method-assign]
        assert not ckpt.save_checkpoint(3, filled_state(3), storage_type=StorageType.MEMORY)
        assert "step 3 not kept" in caplog.text
        check_filled(ckpt.load_checkpoint(), 1)

        ckpt.engine.copier.copy = copy  # type: ignore[method-assign]
        membership.collectives_rejoined()
        assert ckpt.save_checkpoint(4, filled_state(4), storage_type=StorageType.MEMORY)
        check_filled(ckpt.load_checkpoint(), 4)
    finally:
        membership.collectives_rejoined()
        ckpt.close()


def test_full_shared_memory_warns_and_keeps_the_previous_step(
    tmp_path: Path, job: str, caplog: pytest.LogCaptureFixture
) -> None:
    shm = tmp_path / "shm"
    _mount_tmpfs(shm, "3m")  # room for one 2 MiB segment, not two
    ckpt = None
    try:
        ckpt = DdpCheckpointer(str(tmp_path / "ck"), env=_env(job, DLROVER_HPC_SHM_DIR=str(shm)))
        assert ckpt.save_checkpoint(
            1, filled_state(1, numel=64 << 10), storage_type=StorageType.MEMORY
        )
        assert not ckpt.save_checkpoint(
            2, filled_state(2, numel=64 << 10), storage_type=StorageType.MEMORY
        )
        assert "cannot reserve" in caplog.text and "training continues" in caplog.text
        check_filled(ckpt.load_checkpoint(), 1)
    finally:
        if ckpt is not None:
            ckpt.close()
        _umount(shm)


def test_a_disk_save_that_shared_memory_has_no_room_for_spills_and_is_persisted(
    tmp_path: Path, job: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 28, item 2: /dev/shm too small for the second buffer. The DISK save still
    reaches storage (through a file in the spill directory); a MEMORY save is skipped with
    the size needed and the fix; training never stops."""
    shm, spill = tmp_path / "shm", tmp_path / "spill"
    _mount_tmpfs(shm, "3m")  # room for one 2 MiB segment, not two
    spill.mkdir()
    monkeypatch.setenv("DLROVER_HPC_SPILL_DIR", str(spill))
    events = ListEventSink()
    ckpt = None
    try:
        ckpt = DdpCheckpointer(
            str(tmp_path / "ck"), env=_env(job, DLROVER_HPC_SHM_DIR=str(shm)), events=events
        )
        state = filled_state(1, numel=64 << 10)
        assert ckpt.save_checkpoint(1, state, storage_type=StorageType.MEMORY)
        assert ckpt.save_checkpoint(2, filled_state(2, numel=64 << 10))  # DISK: spilled
        assert ckpt.wait_latest_checkpoint(30)
        assert "checkpoint spilled step=2" in caplog.text and str(spill) in caplog.text
        assert "--shm-size" in caplog.text and "--mem" in caplog.text
        [saved] = [e for e in events.named("checkpoint_saved") if e["step"] == 2]
        assert saved["storage"] == "disk" and "cannot reserve" in saved["spilled"]
        assert os.listdir(spill) == []  # the saver had it mapped; the name is gone
        check_filled(ckpt.load_checkpoint(memory=False), 2)  # from storage, whole
        check_filled(ckpt.load_checkpoint(), 2)
        assert ckpt.save_checkpoint(3, filled_state(3, numel=64 << 10))  # spills again
        assert ckpt.wait_latest_checkpoint(30)
        check_filled(ckpt.load_checkpoint(memory=False), 3)
        assert not ckpt.save_checkpoint(
            4, filled_state(4, numel=64 << 10), storage_type=StorageType.MEMORY
        )  # no room in memory, and a MEMORY save does not spill
        [failed] = events.named("checkpoint_save_failed")
        assert failed["step"] == 4 and "needs two such buffers" in failed["error"]
    finally:
        if ckpt is not None:
            ckpt.close()
        _umount(shm)


def test_persisting_resumes_by_itself_when_another_program_frees_the_disk(
    tmp_path: Path, job: str
) -> None:
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, "2m")
    events = ListEventSink()
    ckpt = None
    try:
        ckpt = DdpCheckpointer(str(disk / "ck"), env=_env(job), events=events)
        state = lambda step: filled_state(step, numel=16 << 10)  # noqa: E731 (512 KiB)
        assert ckpt.save_checkpoint(1, state(1)) and ckpt.wait_latest_checkpoint(30)
        filler = disk / "filler"
        with contextlib.suppress(OSError):  # another program takes every byte left
            filler.write_bytes(bytes(2 << 20))
        assert ckpt.save_checkpoint(2, state(2))  # in memory; its persist fails
        assert not ckpt.wait_latest_checkpoint(30)
        assert [e["step"] for e in events.named("checkpoint_persist_failed")] == [2]
        check_filled(ckpt.load_checkpoint(memory=False), 1)  # intact and readable
        filler.unlink()
        assert ckpt.save_checkpoint(3, state(3)) and ckpt.wait_latest_checkpoint(30)
        check_filled(ckpt.load_checkpoint(memory=False), 3)
        assert (disk / "ck" / "dlrover_latest.txt").read_text() == "3\n"
    finally:
        if ckpt is not None:
            ckpt.close()
        _umount(disk)


def test_full_disk_warns_keeps_the_previous_checkpoint_and_leaves_no_temp_files(
    tmp_path: Path, job: str, caplog: pytest.LogCaptureFixture
) -> None:
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, "1m")
    events = ListEventSink()
    ckpt = None
    try:
        ckpt = DdpCheckpointer(str(disk), env=_env(job), events=events)
        assert ckpt.save_checkpoint(1, filled_state(1), storage_type=StorageType.DISK)
        assert ckpt.wait_latest_checkpoint(30)
        assert ckpt.save_checkpoint(
            2, filled_state(2, numel=1 << 18), storage_type=StorageType.DISK
        )
        assert not ckpt.wait_latest_checkpoint(30)  # fails fast, no timeout
        assert "persist_failed" in caplog.text and "previous checkpoint stays intact" in caplog.text
        assert events.named("checkpoint_persist_failed")[0]["step"] == 2
        assert (disk / "dlrover_latest.txt").read_text() == "1\n"
        assert not [p for p in os.listdir(disk) if "tmp" in p]
        check_filled(ckpt.load_checkpoint(memory=False), 1)
        assert ckpt.save_checkpoint(3, filled_state(3), storage_type=StorageType.MEMORY)  # goes on
    finally:
        if ckpt is not None:
            ckpt.close()
        _umount(disk)
