"""A framework's checkpoint files, saved through shared memory: `FileSetCheckpointer`.

Hugging Face's Trainer, Lightning and DeepSpeed write a checkpoint as files of their own
(`checkpoint-<step>/model.safetensors`, `optimizer.pt`, `trainer_state.json`,
`rng_state_<rank>.pth`; `epoch=0-step=50.ckpt`; `mp_rank_00_model_states.pt`) and read them
back with their own code.
This checkpointer takes one rank's files of a step as the objects the framework would have
written (`torch.save` objects, safetensors dicts, bytes), lays them out in a segment as those
files' exact bytes with the tensors copied straight into place (the only blocking part), and
the agent's saver writes them under the step's directory: the framework's loader reads them
as if it had written them.

A step is a part per rank (`PartKind.RANK`), committed once every rank's files are durable.
`restore_files()` agrees with the other ranks on the newest step (memory first); when storage
lacks it, each rank writes its own files from memory, so the framework then resumes from a
directory that holds the newest step.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import struct
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from dlrover_hpc.checkpoint.api import EventSink, PartKind, StorageType
from dlrover_hpc.checkpoint.env import WorkerEnv
from dlrover_hpc.checkpoint.formats.dcp_layout import align
from dlrover_hpc.checkpoint.formats.torchfile import (
    TorchFileLayout,
    buffer_view,
    pickle_state,
    placed_at,
    tensor_signature,
)
from dlrover_hpc.checkpoint.saver.commit_records import CommitRecord
from dlrover_hpc.checkpoint.saver.part_files import persist_part
from dlrover_hpc.checkpoint.saver.segments import HEADER_SIZE
from dlrover_hpc.checkpoint.trainer.checkpointer import CheckpointerBase
from dlrover_hpc.checkpoint.trainer.restore_agreement import Load, Source
from dlrover_hpc.checkpoint.trainer.restored_state import StepBytes
from dlrover_hpc.checkpoint.trainer.saver_connection import SaverLink
from dlrover_hpc.errors import CheckpointError
from dlrover_hpc.worker import progress

logger = logging.getLogger(__name__)

#: safetensors' dtype names (the format's specification)
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}


@dataclasses.dataclass(frozen=True, slots=True)
class SafetensorsFile:
    """A file that `safetensors.torch.save_file(tensors, path, metadata)` would write."""

    tensors: Mapping[str, torch.Tensor]
    metadata: Mapping[str, str] | None = None


#: one rank's files of a step: name (relative to the step directory) -> bytes, a
#: `SafetensorsFile`, or any object `torch.save` takes
FileSet = Mapping[str, Any]


@dataclasses.dataclass(slots=True)
class _Image:
    """A file set laid out as one segment image."""

    files: list[list[Any]]  # [name, start, end]
    chunks: list[tuple[int, bytes]]  # bytes written as they are (headers, pickles, JSON)
    copies: list[tuple[int, torch.Tensor]]  # tensors copied to these offsets
    crc: list[list[Any]]  # CRC ranges the saver computes (torch.save archives)
    length: int


def safetensors_bytes(entry: SafetensorsFile) -> tuple[bytes, list[tuple[int, torch.Tensor]]]:
    """The header of `entry`'s safetensors file and where each tensor goes after it.

    Tensors are ordered by element size, largest first (as safetensors orders them), so that
    each is aligned to its size when the data starts at a multiple of 8; the header is padded
    with spaces to keep that start aligned."""
    header: dict[str, Any] = {}
    if entry.metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in entry.metadata.items()}
    order = sorted(entry.tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))
    places: list[tuple[int, torch.Tensor]] = []
    at = 0
    for name, tensor in order:
        dtype = _SAFETENSORS_DTYPES.get(tensor.dtype)
        if dtype is None:
            raise CheckpointError(f"safetensors has no dtype for tensor {name!r} ({tensor.dtype})")
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": dtype,
            "shape": list(tensor.shape),
            "data_offsets": [at, at + nbytes],
        }
        places.append((at, tensor.detach()))
        at += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    prefix = struct.pack("<Q", len(text)) + text
    return prefix, [(len(prefix) + offset, t) for offset, t in places]


class FileSetCheckpointer(CheckpointerBase):
    """Flash checkpoints of a framework's files: each rank saves its own files of a step."""

    def __init__(
        self,
        checkpoint_dir: str,
        *,
        keep_last: int | None = None,
        keep_interval: int | None = None,
        replica_count: int = 0,
        copy_threads: int | None = None,
        io_threads: int = 4,
        tag: str = "",
        events: EventSink | None = None,
        env: WorkerEnv | None = None,
        link: SaverLink | None = None,
    ) -> None:
        super().__init__(
            checkpoint_dir,
            kind=PartKind.RANK,
            verify=True,
            keep_last=keep_last,
            copy_threads=copy_threads,
            io_threads=io_threads,
            tag=tag,
            events=events,
            env=env,
            link=link,
            device_snapshot=False,
            keep_interval=keep_interval,
            replicas=replica_count,
        )
        self._layouts: dict[str, TorchFileLayout] = {}

    # ------------------------------------------------------------------------ saving
    @progress.sectioned("checkpoint")
    def save_files(
        self, step: int, files: FileSet, path: str, storage_type: StorageType = StorageType.DISK
    ) -> bool:
        """Copies this rank's `files` of `step` into shared memory; with DISK the agent's
        saver then writes each one as `<path>/<name>`.  Every rank saves each step it saves
        (an empty set where a rank has no file).  False (with a warning) when the step could
        not be kept; the previous checkpoint is then untouched."""
        progress.step(step)
        t0 = time.perf_counter()
        storage_type = self._stop_storage(step, storage_type)
        try:
            since = self._engine.save_epoch(step)
            saved = self._save(step, files, path, storage_type, t0, since)
        except CheckpointError as exc:  # also SegmentSpaceError: no room in shared memory
            self._save_failed(step, exc)
            saved = False
        return self._stop_if_asked(step, saved)

    def _save(
        self,
        step: int,
        files: FileSet,
        path: str,
        storage_type: StorageType,
        t0: float,
        since: int,
    ) -> bool:
        engine = self._engine
        image = self._image(files)
        meta = engine.meta_bytes(
            step=step, path=path, storage_type=storage_type, files=image.files, crc=image.crc
        )
        seg, _ = engine.acquire(image.length, len(meta) + 4096)
        try:
            seq = seg.begin_write()
            assert seg.mm is not None
            for at, raw in image.chunks:
                seg.mm[HEADER_SIZE + at : HEADER_SIZE + at + len(raw)] = raw
            pairs = [
                (buffer_view(seg.mm, HEADER_SIZE + at, t.dtype, t.numel()).view(t.shape), t)
                for at, t in image.copies
            ]
            engine.copier.copy(pairs)
            engine.finish(seg, seq=seq, step=step, image_len=image.length, meta=meta, since=since)
        except BaseException:
            seg.invalidate()
            raise
        finally:
            seg.unlock()
        blocking = time.perf_counter() - t0
        return engine.after_write(seg, step=step, storage_type=storage_type, blocking_s=blocking)

    def _image(self, files: FileSet) -> _Image:
        image = _Image(files=[], chunks=[], copies=[], crc=[], length=0)
        for name, value in files.items():
            start = align(image.length)
            if isinstance(value, bytes | bytearray | memoryview):
                raw = bytes(value)
                image.chunks.append((start, raw))
                end = start + len(raw)
            elif isinstance(value, SafetensorsFile):
                prefix, places = safetensors_bytes(value)
                image.chunks.append((start, prefix))
                image.copies += [(start + at, t) for at, t in places]
                end = start + len(prefix) + sum(t.numel() * t.element_size() for _, t in places)
            else:
                end = start + self._torch_file(name, value, start, image)
            image.files.append([name, start, end])
            image.length = end
        return image

    def _torch_file(self, name: str, obj: Any, start: int, image: _Image) -> int:
        """Places a torch.save archive of `obj` at `start`; returns its length."""
        pkl, tensors = pickle_state(obj)
        tensors = [t.detach() for t in tensors]
        layout = self._layouts.get(name)
        if layout is None or layout.signature != tensor_signature(tensors):
            layout = self._layouts[name] = TorchFileLayout(tensors)
        tail = layout.tail(pkl, {})
        chunks, crc = placed_at(layout, tail, start)
        image.chunks += chunks
        image.crc += crc
        image.copies += [(start + s.offset, t) for s, t in zip(layout.slots, tensors, strict=True)]
        return tail.offset + len(tail.data)

    # ------------------------------------------------------------------------ restoring
    @progress.sectioned("checkpoint")
    def restore_files(self) -> tuple[int, str] | None:
        """The newest step every rank agrees on, and its directory, with its files on storage:
        from memory (this node's, or a peer's copy) when a rank holds a step that storage
        lacks, each rank writing its own files from there; else the newest committed step.
        None when there is none.  Every rank must call it; it returns once every rank's files
        are written."""
        t0 = time.perf_counter()
        engine = self._engine
        committed = {r.step for r in engine.cdir.records()}

        def from_memory(held: StepBytes) -> Load:
            header = held.header
            if header.step not in committed:  # the saver may be writing them too: atomic
                with held.reading():
                    persist_part(engine.storage, held.buf, header)
            path = str(header.meta["path"])
            return lambda: (path, held.token)

        def from_storage(record: CommitRecord) -> Load:
            return lambda: (record.path, record.token)

        source, step, path = self._load_agreed(from_memory, from_storage)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()  # every rank's files are there before any rank reads
        self._report_restored(source, step, t0)
        if source == Source.NONE:
            return None
        return step, str(path)

    def newest_committed(self) -> int | None:
        """The newest step committed on storage (no agreement: any rank may call it)."""
        return max((r.step for r in self._engine.cdir.records()), default=None)
