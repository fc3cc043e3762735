"""torch.distributed.checkpoint storage backed by shared memory, and a verifying reader.

`ShmStorageWriter` lays a rank's write items out in its segment exactly as
`FileSystemWriter` would put them in one `.distcp` file (a `torch.save` archive per tensor,
raw bytes per object), so persisting is a byte copy and the result loads with plain
`torch.distributed.checkpoint`.  Items that DCP deduplicated away from this rank are kept in
memory too (not persisted), so a memory restore never needs another rank's segment.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import pickle
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from dlrover_hpc.checkpoint.cuda import cuda_device
from dlrover_hpc.checkpoint.restore import views_from_file
from dlrover_hpc.checkpoint.shm import HEADER_SIZE, Header, Segment
from dlrover_hpc.checkpoint.storage import Storage
from dlrover_hpc.checkpoint.torchfile import (
    TorchFileLayout,
    buffer_view,
    dtype_from_name,
    dtype_name,
    pickle_state,
)
from dlrover_hpc.errors import CheckpointError

logger = logging.getLogger(__name__)

METADATA_FILE = ".metadata"


def _align(n: int) -> int:
    return (n + 63) // 64 * 64


def _key(index: MetadataIndex) -> str:
    offset = "" if index.offset is None else ",".join(str(int(x)) for x in index.offset)
    return f"{index.fqn}\x00{offset}"


@dataclasses.dataclass(frozen=True, slots=True)
class _Placed:
    item: WriteItem
    start: int
    length: int
    chunks: list[tuple[int, bytes]]  # (image offset, bytes) written besides tensor data
    in_file: bool


@dataclasses.dataclass(slots=True, kw_only=True)
class ShmWrite:
    """What one `dcp.save` put into a locked segment; completed by the checkpointer."""

    segment: Segment
    seq: int
    image_len: int
    files: list[list[Any]]
    crc: list[list[Any]]
    restore: dict[str, Any]
    metadata_at: int  # image offset reserved for `.metadata` (coordinator only)
    metadata_room: int


class ShmStorageWriter(StorageWriter):
    """A DCP StorageWriter into this rank's shared-memory segment."""

    def __init__(
        self,
        *,
        acquire: Callable[[int, int, torch.device | None], Segment],
        copy: Callable[[list[tuple[torch.Tensor, torch.Tensor]]], None],
        rank: int,
        token: int,
        path: str,
    ) -> None:
        super().__init__()
        self._acquire = acquire
        self._copy = copy
        self._rank = rank
        self._token = token
        self._path = path
        self._local: list[WriteItem] = []
        self._planner_data: Any = None
        self._total_items = 0
        self.is_coordinator = False
        self.result: ShmWrite | None = None
        self.metadata: Metadata | None = None

    def reset(self, checkpoint_id: Any = None) -> None:
        self.result = None
        self.metadata = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._local = list(plan.items)
        self._planner_data = plan.planner_data
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self._total_items = sum(len(p.items) for p in plans)
        return plans

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self._path, save_id=f"{self._token:x}")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        fname = f"__{self._rank}_{self._token:x}.distcp"
        persisted = {_key(item.index) for item in plan.items}
        extra = [item for item in self._local if _key(item.index) not in persisted]
        placed: list[_Placed] = []
        copies: list[tuple[int, torch.Tensor]] = []
        crc: list[list[Any]] = []
        rows: list[list[Any]] = []
        pos = 0
        for item in [*plan.items, *extra]:
            key = _key(item.index)
            start = _align(pos)
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                placed.append(_Placed(item, start, len(raw), [(start, raw)], key in persisted))
                rows.append([key, "b", start, len(raw), None, None])
                pos = start + len(raw)
                continue
            assert isinstance(data, torch.Tensor)
            tensor = data.detach()
            nbytes = tensor.numel() * tensor.element_size()
            if key in persisted:  # a torch.save archive of the tensor, as FileSystemWriter does
                pkl, tensors = pickle_state(tensor)
                layout = TorchFileLayout(tensors)
                tail = layout.tail(pkl, {})
                length = tail.offset + len(tail.data)
                chunks = [(start + at, header) for at, header in layout.headers]
                chunks.append((start + tail.offset, tail.data))
                crc += [[start + a, n, [start + f for f in fs]] for a, n, fs in tail.crc_patches]
                data_at = start + layout.slots[0].offset
                placed.append(_Placed(item, start, length, chunks, True))
            else:  # kept for a memory restore only
                data_at, length = start, nbytes
            copies.append((data_at, tensor))
            rows.append([key, "t", data_at, nbytes, dtype_name(tensor.dtype), list(tensor.shape)])
            pos = start + length
        file_end = max((p.start + p.length for p in placed if p.in_file), default=0)
        metadata_room = 65536 + 2048 * self._total_items if self.is_coordinator else 0
        metadata_at = _align(pos)
        image_len = metadata_at + metadata_room
        restore = {
            "md": _local_metadata(self._local),
            "items": rows,
            "planner_data": _plain_planner_data(self._planner_data),
        }
        device = cuda_device(t for _, t in copies)  # the segment is page-locked for it
        segment = self._acquire(image_len, 4096 + 160 * len(rows) + 48 * len(crc), device)
        assert segment.mm is not None
        try:
            seq = segment.begin_write()
            for p in placed:
                for at, raw in p.chunks:
                    segment.mm[HEADER_SIZE + at : HEADER_SIZE + at + len(raw)] = raw
            pairs = [
                (
                    buffer_view(segment.mm, HEADER_SIZE + at, t.dtype, t.numel()).view(t.shape),
                    t,
                )
                for at, t in copies
            ]
            self._copy(pairs)
        except BaseException:
            segment.invalidate()
            segment.unlock()
            raise
        self.result = ShmWrite(
            segment=segment,
            seq=seq,
            image_len=image_len,
            files=[[fname, 0, file_end]],
            crc=crc,
            restore=restore,
            metadata_at=metadata_at,
            metadata_room=metadata_room,
        )
        results = [
            WriteResult(
                index=p.item.index,
                size_in_bytes=p.length,
                storage_data=_StorageInfo(fname, p.start, p.length),
            )
            for p in placed
            if p.in_file
        ]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = CURRENT_DCP_VERSION
        storage_md = {}
        for wr_list in results:
            storage_md.update({wr.index: wr.storage_data for wr in wr_list})
        metadata.storage_data = storage_md
        metadata.storage_meta = self.storage_meta()
        self.metadata = metadata


def _local_metadata(items: list[WriteItem]) -> dict[str, Any]:
    md: dict[str, Any] = {}
    for item in items:
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
            md[fqn] = ["b"]
            continue
        td = item.tensor_data
        entry = md.setdefault(fqn, ["t", dtype_name(td.properties.dtype), list(td.size), []])
        entry[3].append([list(td.chunk.offsets), list(td.chunk.sizes)])
    return md


def _plain_planner_data(data: Any) -> dict[str, list[Any]] | None:
    if not isinstance(data, dict):
        return None
    out = {}
    for fqn, path in data.items():
        if all(isinstance(p, str | int) for p in path):
            out[str(fqn)] = list(path)
    return out


def metadata_from_restore(restore: dict[str, Any]) -> Metadata:
    md: dict[str, Any] = {}
    for fqn, entry in restore["md"].items():
        if entry[0] == "b":
            md[fqn] = BytesStorageMetadata()
            continue
        _, dtype, size, chunks = entry
        md[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype_from_name(dtype)),
            size=torch.Size(size),
            chunks=[
                ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in chunks
            ],
        )
    planner = restore.get("planner_data")
    planner_data = {k: tuple(v) for k, v in planner.items()} if planner else None
    return Metadata(state_dict_metadata=md, planner_data=planner_data)


def _narrow(tensor: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    for dim, (off, length) in enumerate(zip(offsets, lengths, strict=True)):
        if off != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, int(off), int(length))
    return tensor


class _ReaderBase(StorageReader):
    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    @staticmethod
    def _deliver(planner: LoadPlanner, req: Any, loaded: torch.Tensor | bytes) -> None:
        if req.type == LoadItemType.BYTE_IO:
            assert isinstance(loaded, bytes)
            planner.load_bytes(req, io.BytesIO(loaded))
            return
        assert isinstance(loaded, torch.Tensor)
        source = _narrow(loaded, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != source.size():
            raise CheckpointError(
                f"{req.storage_index.fqn}: stored chunk {tuple(source.size())} does not match "
                f"the target {tuple(target.size())}"
            )
        target.copy_(source)
        planner.commit_tensor(req, target)


class ShmStorageReader(_ReaderBase):
    """Reads a rank's own items straight from its segment (same world size and sharding)."""

    def __init__(self, segment: Segment, header: Header) -> None:
        super().__init__()
        self.segment = segment
        self.header = header
        restore = header.meta["restore"]
        self._items = {row[0]: row for row in restore["items"]}
        self._metadata = metadata_from_restore(restore)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        mm = self.segment.mm
        if mm is None:
            raise CheckpointError(f"{self.segment.path} is not mapped")
        for req in plan.items:
            row = self._items.get(_key(req.storage_index))
            if row is None:
                raise CheckpointError(
                    f"{req.storage_index.fqn} at {req.storage_index.offset} is not in this "
                    "rank's memory checkpoint (was the model resharded?)"
                )
            _, kind, at, length, dtype, shape = row
            if kind == "b":
                self._deliver(planner, req, bytes(mm[HEADER_SIZE + at : HEADER_SIZE + at + length]))
                continue
            numel = 1
            for d in shape:
                numel *= d
            view = buffer_view(mm, HEADER_SIZE + at, dtype_from_name(dtype), numel).view(shape)
            self._deliver(planner, req, view)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


class VerifyingFileReader(_ReaderBase):
    """Reads a persisted DCP directory through fsspec, checking each tensor's CRC-32."""

    def __init__(self, storage: Storage, path: str, *, verify: bool = True) -> None:
        super().__init__()
        self.storage = storage
        self.path = storage.path(path).rstrip("/")
        self.verify = verify

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        raw = self.storage.read_bytes(f"{self.path}/{METADATA_FILE}")
        if raw is None:
            raise CheckpointError(f"{self.path} has no {METADATA_FILE}; not a DCP checkpoint")
        metadata = pickle.loads(raw)
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{self.path}/{METADATA_FILE} does not hold DCP metadata")
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        files: dict[str, Any] = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            buf = files.get(info.relative_path)
            if buf is None:
                buf = files[info.relative_path] = self.storage.map_file(
                    f"{self.path}/{info.relative_path}"
                )
            blob = memoryview(buf)[info.offset : info.offset + info.length]
            if req.type == LoadItemType.BYTE_IO:
                self._deliver(planner, req, bytes(blob))
            else:
                tensor = views_from_file(blob, verify=self.verify, weights_only=True)
                self._deliver(planner, req, tensor)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut
