"""Reading a torch.save archive held in a buffer (an mmap'd file): verify, then view.

The tensors of the result are views over the buffer (nothing is copied); the caller copies
them out (`trainer.restored_state.merge_into`) before the buffer goes away.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from dlrover_hpc.checkpoint.formats.torchfile import MANIFEST, ViewUnpickler, buffer_view
from dlrover_hpc.checkpoint.formats.zip_archive import crc32, read_directory
from dlrover_hpc.errors import CheckpointError


def views_from_file(
    buf: Any,
    *,
    verify: bool,
    weights_only: bool,
    expect: dict[str, Any] | None = None,
    threads: int = 4,
) -> Any:
    """The state in a torch.save-format archive held in `buf` (an mmap'd file)."""
    records = read_directory(buf)
    pkl_name = next((n for n in records if n.endswith("/data.pkl")), None)
    if pkl_name is None:
        raise CheckpointError("the archive has no data.pkl record; not a torch.save file")
    prefix = pkl_name[: -len("data.pkl")]
    view = memoryview(buf)
    if verify:
        verify_records(view, records.values(), threads=threads)
    if expect:
        raw = records.get(MANIFEST)
        manifest = {}
        if raw is not None:
            manifest = json.loads(bytes(view[raw.data_offset : raw.data_offset + raw.size]))
        for key, want in expect.items():
            if manifest.get(key) != want:
                raise CheckpointError(
                    f"the file holds {key}={manifest.get(key)!r}, expected {want!r}; "
                    "it belongs to another save"
                )
    pkl = records[pkl_name]
    data = bytes(view[pkl.data_offset : pkl.data_offset + pkl.size])

    def resolve(key: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
        rec = records.get(f"{prefix}data/{key}")
        if rec is None:
            raise CheckpointError(f"data.pkl refers to storage {key} that the archive lacks")
        if numel * torch.empty(0, dtype=dtype).element_size() > rec.size:
            raise CheckpointError(f"storage {key} is shorter than data.pkl says")
        return buffer_view(buf, rec.data_offset, dtype, numel)

    return ViewUnpickler(data, resolve, weights_only=weights_only).load()


def verify_records(view: memoryview, records: Iterable[Any], *, threads: int = 4) -> None:
    """Checks every record's CRC-32 (in parallel; zlib releases the GIL)."""
    items = sorted(records, key=lambda r: r.size, reverse=True)

    def check(rec: Any) -> str | None:
        value = crc32(view[rec.data_offset : rec.data_offset + rec.size])
        if value != rec.crc:
            return f"record {rec.name} has CRC {value:08x}, the directory says {rec.crc:08x}"
        return None

    with ThreadPoolExecutor(max(1, threads)) as pool:
        errors = [e for e in pool.map(check, items) if e]
    if errors:
        raise CheckpointError("checkpoint file is corrupt: " + "; ".join(errors[:3]))
