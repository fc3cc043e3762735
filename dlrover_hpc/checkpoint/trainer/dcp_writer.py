"""A torch.distributed.checkpoint StorageWriter into this rank's shared-memory segment.

`ShmStorageWriter` lays a rank's write items out in its segment exactly as
`FileSystemWriter` would put them in one `.distcp` file (a `torch.save` archive per tensor,
raw bytes per object), so persisting is a byte copy and the result loads with plain
`torch.distributed.checkpoint`.  Items that DCP deduplicated away from this rank are kept in
memory too (not persisted), so a memory restore never needs another rank's segment.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from dlrover_hpc.checkpoint.formats.dcp_layout import (
    align,
    item_key,
    local_metadata,
    plain_planner_data,
)
from dlrover_hpc.checkpoint.formats.torchfile import (
    TorchFileLayout,
    buffer_view,
    dtype_name,
    pickle_state,
    placed_at,
)
from dlrover_hpc.checkpoint.saver.segments import HEADER_SIZE, Segment
from dlrover_hpc.checkpoint.trainer.cuda import cuda_device


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
        persisted = {item_key(item.index) for item in plan.items}
        extra = [item for item in self._local if item_key(item.index) not in persisted]
        placed: list[_Placed] = []
        copies: list[tuple[int, torch.Tensor]] = []
        crc: list[list[Any]] = []
        rows: list[list[Any]] = []
        pos = 0
        for item in [*plan.items, *extra]:
            key = item_key(item.index)
            start = align(pos)
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
                chunks, archive_crc = placed_at(layout, tail, start)
                crc += archive_crc
                data_at = start + layout.slots[0].offset
                placed.append(_Placed(item, start, length, chunks, True))
            else:  # kept for a memory restore only
                data_at, length = start, nbytes
            copies.append((data_at, tensor))
            rows.append([key, "t", data_at, nbytes, dtype_name(tensor.dtype), list(tensor.shape)])
            pos = start + length
        file_end = max((p.start + p.length for p in placed if p.in_file), default=0)
        metadata_room = 65536 + 2048 * self._total_items if self.is_coordinator else 0
        metadata_at = align(pos)
        image_len = metadata_at + metadata_room
        restore = {
            "md": local_metadata(self._local),
            "items": rows,
            "planner_data": plain_planner_data(self._planner_data),
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
