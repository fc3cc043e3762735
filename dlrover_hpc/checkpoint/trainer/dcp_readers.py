"""torch.distributed.checkpoint StorageReaders: a rank's own segment, or persisted files.

`ShmStorageReader` reads a rank's items straight from its segment, or from a peer's copy of
it (same world size and sharding); `VerifyingFileReader` reads a persisted DCP directory
through fsspec and checks every tensor's CRC-32 first.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from dlrover_hpc.checkpoint.formats.dcp_layout import (
    METADATA_FILE,
    item_key,
    metadata_from_restore,
    narrow,
)
from dlrover_hpc.checkpoint.formats.torchfile import buffer_view, dtype_from_name
from dlrover_hpc.checkpoint.formats.torchfile_reader import views_from_file
from dlrover_hpc.checkpoint.saver.segments import HEADER_SIZE
from dlrover_hpc.checkpoint.saver.storage import Storage
from dlrover_hpc.checkpoint.trainer.restored_state import StepBytes
from dlrover_hpc.errors import CheckpointError


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
        source = narrow(loaded, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != source.size():
            raise CheckpointError(
                f"{req.storage_index.fqn}: stored chunk {tuple(source.size())} does not match "
                f"the target {tuple(target.size())}"
            )
        target.copy_(source)
        planner.commit_tensor(req, target)


class ShmStorageReader(_ReaderBase):
    """Reads a rank's own items straight from its segment's bytes (same world size and
    sharding)."""

    def __init__(self, held: StepBytes) -> None:
        super().__init__()
        self.held = held
        self.header = held.header
        restore = self.header.meta["restore"]
        self._items = {row[0]: row for row in restore["items"]}
        self._metadata = metadata_from_restore(restore)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        mm = self.held.buf
        if mm is None:
            raise CheckpointError(f"{self.held.name} is not mapped")
        for req in plan.items:
            row = self._items.get(item_key(req.storage_index))
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
