"""Pure pieces of the flash checkpoint: file format, naming, commit bookkeeping.

The restore decision's table is in test_restore_agreement.py."""

from __future__ import annotations

import collections
import os
import struct
import threading
import zipfile
import zlib
from pathlib import Path

import pytest
import torch

from dlrover_hpc.checkpoint.api import TRACKER_FILE
from dlrover_hpc.checkpoint.env import WorkerEnv, segment_name, segment_prefix
from dlrover_hpc.checkpoint.formats.torchfile import (
    MANIFEST,
    TorchFileLayout,
    ViewUnpickler,
    buffer_view,
    manifest_bytes,
    pickle_state,
)
from dlrover_hpc.checkpoint.formats.torchfile_reader import views_from_file
from dlrover_hpc.checkpoint.formats.zip_archive import read_directory
from dlrover_hpc.checkpoint.saver.commit_records import CheckpointDir, CommitRecord
from dlrover_hpc.checkpoint.saver.commits import (
    CommitCounter,
    LocalCommitCoordinator,
    StoreCommitCoordinator,
)
from dlrover_hpc.checkpoint.saver.segments import HEADER_SIZE, Segment, read_header
from dlrover_hpc.checkpoint.saver.storage import Storage
from dlrover_hpc.checkpoint.saver.worker_protocol import decode_request
from dlrover_hpc.checkpoint.trainer.restored_state import merge_into
from dlrover_hpc.checkpoint.trainer.tensor_copy import Copier
from dlrover_hpc.errors import CheckpointError

pytestmark = pytest.mark.timeout(60)


def _image(state: object, *, zip64: bool = False) -> tuple[bytearray, list[list[object]]]:
    """The image a save would put in shared memory (CRC fields still zero)."""
    pkl, tensors = pickle_state(state)
    layout = TorchFileLayout(tensors, zip64=zip64)
    tail = layout.tail(pkl, {MANIFEST: manifest_bytes(step=7, token=3)})
    image = bytearray(tail.offset + len(tail.data))
    for at, header in layout.headers:
        image[at : at + len(header)] = header
    for slot, t in zip(layout.slots, tensors, strict=True):
        view = buffer_view(image, slot.offset, slot.dtype, t.numel())
        view.view(slot.shape).copy_(t)
    image[tail.offset :] = tail.data
    return image, tail.crc_patches


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(_bytes(a), _bytes(b))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _rich_state() -> dict[str, object]:
    shared = torch.randn(5, 3)
    params = [torch.nn.Parameter(torch.randn(4, 4))]
    opt = torch.optim.Adam(params)
    params[0].grad = torch.ones(4, 4)
    opt.step()
    return {
        "fp32": torch.arange(10, dtype=torch.float32),
        "nested": {
            "bf16": torch.ones(3, dtype=torch.bfloat16),
            1: 2.5,
            "f8": torch.zeros(4, dtype=torch.float8_e4m3fn),
        },
        "list": [1, (2, 3), "x", None, b"raw", {"u16": torch.arange(3).to(torch.uint16)}],
        "tied_a": shared,
        "tied_b": shared,
        "transposed": torch.randn(4, 6).t(),
        "empty": torch.zeros(0, 3),
        "scalar": torch.tensor(7),
        "bool": torch.tensor([True, False]),
        "complex": torch.randn(2, dtype=torch.complex64),
        "optimizer": opt.state_dict(),
        "ordered": collections.OrderedDict(x=1),
        "set": {1, 2},
    }


@pytest.mark.parametrize("zip64", [False, True])
def test_image_written_by_storage_loads_with_torch_zipfile_and_ours(
    tmp_path: Path, zip64: bool
) -> None:
    state = _rich_state()
    image, crc = _image(state, zip64=zip64)
    path = str(tmp_path / "ckpt.pt")
    Storage(str(tmp_path), threads=3).write_image(path, memoryview(image), crc)

    assert zipfile.ZipFile(path).testzip() is None  # every CRC was computed and patched
    assert _same(state, torch.load(path))
    assert _same(state, torch.load(path, mmap=True))
    loaded = torch.load(path)
    assert loaded["tied_a"].data_ptr() == loaded["tied_b"].data_ptr()  # one storage, as torch.save
    ours = views_from_file(bytearray(Path(path).read_bytes()), verify=True, weights_only=True)
    assert _same(state, ours)


def test_verify_detects_a_flipped_byte_and_a_truncated_file(tmp_path: Path) -> None:
    image, crc = _image({"w": torch.arange(1000, dtype=torch.float32)})
    path = str(tmp_path / "c.pt")
    Storage(str(tmp_path)).write_image(path, memoryview(image), crc)
    data = bytearray(Path(path).read_bytes())
    rec = read_directory(data)["archive/data/0"]
    data[rec.data_offset + 17] ^= 0xFF
    with pytest.raises(CheckpointError, match="record archive/data/0 has CRC"):
        views_from_file(data, verify=True, weights_only=True)
    with pytest.raises(CheckpointError):
        views_from_file(
            bytearray(Path(path).read_bytes())[: len(data) // 2], verify=True, weights_only=True
        )


def test_manifest_mismatch_is_refused(tmp_path: Path) -> None:
    image, crc = _image({"w": torch.ones(3)})
    path = str(tmp_path / "c.pt")
    Storage(str(tmp_path)).write_image(path, memoryview(image), crc)
    buf = bytearray(Path(path).read_bytes())
    with pytest.raises(CheckpointError, match="step=7, expected 8"):
        views_from_file(buf, verify=True, weights_only=True, expect={"step": 8})


def test_weights_only_refuses_foreign_classes_with_the_fix_in_the_message() -> None:
    class Odd:
        pass

    globals()["Odd"] = Odd  # picklable by reference
    Odd.__qualname__ = "Odd"
    pkl, _ = pickle_state({"odd": Odd()})
    with pytest.raises(CheckpointError, match="add_safe_globals"):
        ViewUnpickler(pkl, lambda *a: torch.empty(0)).load()
    assert isinstance(
        ViewUnpickler(pkl, lambda *a: torch.empty(0), weights_only=False).load()["odd"], Odd
    )


def test_unpicklable_state_is_a_checkpoint_error() -> None:
    with pytest.raises(CheckpointError, match="cannot be pickled"):
        pickle_state({"lock": threading.Lock()})
    with pytest.raises(CheckpointError, match="dense tensor"):
        pickle_state({"sparse": torch.eye(3).to_sparse()})


def test_merge_copies_into_matching_targets_and_clones_the_rest() -> None:
    src = {"a": torch.ones(3), "b": [torch.full((2,), 2.0), 5], "c": torch.zeros(4)}
    target = {"a": torch.empty(3), "b": [torch.empty(2)], "c": torch.empty(5)}
    keep_a, keep_b, view_c = target["a"], target["b"][0], src["c"]
    out = merge_into(src, target, Copier(2))
    assert out["a"] is keep_a and torch.equal(keep_a, torch.ones(3))
    assert out["b"][0] is keep_b and out["b"][1] == 5
    assert out["c"] is not view_c and out["c"].shape == (4,)  # shape differs: fresh copy


def test_segment_names_carry_user_job_node_and_stay_filesystem_safe() -> None:
    a = segment_prefix(user="alice", job_id="123", node_name="node01")
    b = segment_prefix(user="alice", job_id="124", node_name="node01")
    assert a == "dlrover-hpc-alice-123-node01-" and a != b
    weird = segment_prefix(user="bob/x", job_id="j" * 200, node_name="n.a-b")
    assert "/" not in weird and len(weird) < 200
    assert segment_name(a, rank=3, buffer=1, tag="opt") == "dlrover-hpc-alice-123-node01-r3-opt-b"


def test_worker_env_defaults_and_errors() -> None:
    env = WorkerEnv.from_environ({"SLURM_JOB_ID": "77", "SLURMD_NODENAME": "n3.cluster"})
    assert (env.rank, env.world_size, env.job_id, env.node_name) == (0, 1, "77", "n3")
    env = WorkerEnv.from_environ({"DLROVER_HPC_JOB_ID": "j", "SLURM_JOB_ID": "77"})
    assert env.job_id == "j" and env.saver_socket is None
    assert WorkerEnv.from_environ({}).job_id == f"standalone-{os.getppid()}"
    with pytest.raises(CheckpointError, match="RANK=4 is outside WORLD_SIZE=2"):
        WorkerEnv.from_environ({"RANK": "4", "WORLD_SIZE": "2"})
    with pytest.raises(CheckpointError, match="WORLD_SIZE='two' is not an integer"):
        WorkerEnv.from_environ({"WORLD_SIZE": "two"})
    two = {"WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_RESTART_COUNT": "1"}
    assert (
        WorkerEnv.from_environ(two).generation_token()
        == WorkerEnv.from_environ({**two, "RANK": "1"}).generation_token()
    )


def test_segment_header_rejects_torn_and_corrupt_states(tmp_path: Path) -> None:
    seg = Segment(str(tmp_path / "seg"), writable=True)
    try:
        assert seg.try_lock(exclusive=True)
        seg.ensure_size(1 << 20)
        assert seg.header() is None  # empty
        seq = seg.begin_write()
        assert seg.header() is None  # being written
        seg.finish_write(seq=seq, step=5, image_len=100, meta=b'{"step": 5}')
        assert seg.header() is not None and seg.header().step == 5  # type: ignore[union-attr]
        assert seg.mm is not None
        torn = bytearray(seg.mm)
        torn[HEADER_SIZE + 128 + 3] ^= 1  # a byte of the meta, placed after the image
        assert read_header(torn) is None  # meta CRC mismatch
        torn = bytearray(seg.mm)
        struct.pack_into("<q", torn, 24, 6)  # the step field
        assert read_header(torn) is None  # header CRC mismatch
        seg.invalidate()
        assert seg.header() is None
    finally:
        seg.close()


def test_local_coordinator_has_exactly_one_winner_under_threads() -> None:
    coord = LocalCommitCoordinator()
    wins: list[int] = []
    barrier = threading.Barrier(8)

    def report(rank: int) -> None:
        barrier.wait()
        if coord.part_durable(step=3, ranks=[rank], world_size=8, path="p"):
            wins.append(rank)
        coord.part_durable(step=3, ranks=[rank], world_size=8, path="p")  # a repeat never wins

    threads = [threading.Thread(target=report, args=(r,)) for r in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1


@pytest.mark.parametrize(
    ("reports", "winners"),
    [
        ([(1, [0], "p"), (1, [1], "p")], [False, True]),  # the part completing the set wins
        ([(1, [0, 1], "p")], [True]),  # one node's saver reports all ranks at once
        ([(1, [0], "p"), (1, [0], "p"), (1, [1], "p")], [False, False, True]),  # duplicate
        ([(1, [0], "p"), (1, [1], "p"), (1, [1], "p")], [False, True, False]),  # committed once
        ([(1, [0], "p"), (1, [1], "q")], [False, False]),  # another step path never completes it
        ([(1, [0], "p"), (2, [1], "p")], [False, False]),  # nor another step
    ],
)
def test_commit_counter_tells_exactly_the_completing_caller(
    reports: list[tuple[int, list[int], str]], winners: list[bool]
) -> None:
    counter = CommitCounter()
    got = [
        counter.part_durable(step=step, ranks=ranks, world_size=2, path=path)
        for step, ranks, path in reports
    ]
    assert got == winners


def test_commit_counter_forgets_parts_of_an_older_generation() -> None:
    counter = CommitCounter(remember=1)
    assert not counter.part_durable(step=1, ranks=[0], world_size=2, path="p")
    counter.new_generation()  # the workers restarted: rank 0's part never counts now
    assert not counter.part_durable(step=1, ranks=[1], world_size=2, path="p")
    assert counter.part_durable(step=1, ranks=[0], world_size=2, path="p")
    assert counter.part_durable(step=2, ranks=[0, 1], world_size=2, path="p")
    # only `remember` committed steps are kept: step 1 may be counted again after that
    assert not counter.part_durable(step=1, ranks=[0], world_size=2, path="p")
    assert LocalCommitCoordinator is CommitCounter  # the public name of the in-process counter


def test_store_coordinator_counts_each_rank_once_per_generation_and_path() -> None:
    coord = StoreCommitCoordinator(torch.distributed.HashStore(), namespace="g1")
    assert not coord.part_durable(step=1, ranks=[0], world_size=2, path="p")
    assert not coord.part_durable(step=1, ranks=[0], world_size=2, path="p")  # duplicate
    assert coord.part_durable(step=1, ranks=[1], world_size=2, path="p")
    assert not coord.part_durable(step=1, ranks=[0], world_size=2, path="q")  # another dir
    assert coord.part_durable(step=1, ranks=[1], world_size=2, path="q")
    coord.namespace = "g2"  # a new worker generation starts counting afresh
    assert not coord.part_durable(step=1, ranks=[1], world_size=2, path="p")


def test_commit_tracker_and_retention(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path))
    cdir = CheckpointDir(str(tmp_path), storage)
    for step in (10, 20, 30):
        (tmp_path / f"ck-{step}.pt").write_bytes(b"x")
        record = CommitRecord(
            step=step, path=str(tmp_path / f"ck-{step}.pt"), kind="ddp", parts=1, token=1, time=0.0
        )
        cdir.commit(record, keep_last=2)
    assert (tmp_path / TRACKER_FILE).read_text() == "30\n"
    assert [r.step for r in cdir.records()] == [30, 20]
    assert not (tmp_path / "ck-10.pt").exists() and (tmp_path / "ck-20.pt").exists()
    # an older commit arriving late never moves the tracker back
    cdir.commit(
        CommitRecord(step=25, path=str(tmp_path / "x"), kind="ddp", parts=1, token=1, time=0.0),
        keep_last=None,
    )
    assert (tmp_path / TRACKER_FILE).read_text() == "30\n"
    # a path shared by a kept step is never deleted
    shared = str(tmp_path / "same.pt")
    Path(shared).write_bytes(b"y")
    for step in (40, 50, 60):
        cdir.commit(
            CommitRecord(step=step, path=shared, kind="ddp", parts=1, token=1, time=0.0),
            keep_last=1,
        )
    assert Path(shared).exists() and [r.step for r in cdir.records()] == [60]
    assert not [p for p in os.listdir(tmp_path) if ".dlrover-tmp-" in p]


def test_protocol_rejects_unknown_types_and_versions() -> None:
    with pytest.raises(CheckpointError, match="unknown request type 'explode'"):
        decode_request({"v": 1, "id": 1, "type": "explode"})
    with pytest.raises(CheckpointError, match="protocol version 9"):
        decode_request({"v": 9, "id": 1, "type": "ping"})
    with pytest.raises(CheckpointError, match="bad saved request"):
        decode_request({"v": 1, "id": 1, "type": "saved", "step": 1})


def test_crc_fields_match_zlib(tmp_path: Path) -> None:
    payload = torch.arange(1 << 16, dtype=torch.int32)
    image, crc = _image({"p": payload})
    Storage(str(tmp_path), threads=4).write_image(str(tmp_path / "f.pt"), memoryview(image), crc)
    zf = zipfile.ZipFile(str(tmp_path / "f.pt"))
    raw = zf.read("archive/data/0")
    assert raw == bytes(payload.view(torch.uint8).tolist())
    assert zlib.crc32(raw) == zf.getinfo("archive/data/0").CRC
