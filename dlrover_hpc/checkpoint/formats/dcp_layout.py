"""torch.distributed.checkpoint's layout, as our shared-memory parts describe it.

A rank's segment meta holds `restore`: its items (`md`, per fully qualified name: bytes, or
dtype, size and chunks), the placement of each item in the image (`items` rows keyed by
`item_key`) and DCP's planner data; `metadata_from_restore` rebuilds DCP `Metadata` from it,
so a memory restore needs no `.metadata` file.  Persisted parts use DCP's own file names:
`__<rank>_<token>.distcp` and the coordinator's `.metadata`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from dlrover_hpc.checkpoint.formats.torchfile import dtype_from_name, dtype_name

METADATA_FILE = ".metadata"


def align(n: int) -> int:
    return (n + 63) // 64 * 64


def item_key(index: MetadataIndex) -> str:
    offset = "" if index.offset is None else ",".join(str(int(x)) for x in index.offset)
    return f"{index.fqn}\x00{offset}"


def local_metadata(items: list[WriteItem]) -> dict[str, Any]:
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


def plain_planner_data(data: Any) -> dict[str, list[Any]] | None:
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


def narrow(tensor: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    for dim, (off, length) in enumerate(zip(offsets, lengths, strict=True)):
        if off != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, int(off), int(length))
    return tensor
