"""Turning one rank's part, as laid out in its segment, into durable files.

The segment's meta lists the files (`[name, start, end]` ranges of the image; name "" is the
step path itself) and the CRC ranges with the offsets of the fields that receive them.  Files
are written in order, each atomically; the last one (DCP's `.metadata`) goes last.
"""

from __future__ import annotations

import dataclasses
import posixpath
from typing import Any, TypedDict

from dlrover_hpc.checkpoint.api import FaultHook
from dlrover_hpc.checkpoint.saver.segments import HEADER_SIZE, Header
from dlrover_hpc.checkpoint.saver.storage import Storage, _no_fault
from dlrover_hpc.errors import CheckpointError


class Retention(TypedDict):
    """Which committed steps a commit keeps (`CheckpointDir.apply_retention`)."""

    keep_last: int | None
    keep_interval: int | None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PartInfo:
    """What the saver needs to know about a persisted part, read from a segment's meta."""

    step: int
    rank: int
    token: int
    kind: str
    ckpt_dir: str
    path: str
    keep_last: int | None
    parts: int  # number of parts of the whole step (commit world size)
    ranks: tuple[int, ...]
    keep_interval: int | None = None

    @classmethod
    def from_header(cls, header: Header) -> PartInfo | None:
        """None when this segment contributes no storage part (DDP, rank != 0)."""
        meta = header.meta
        part = meta.get("part")
        if not part:
            return None
        try:
            return cls(
                step=header.step,
                rank=int(meta["rank"]),
                token=int(meta["token"]),
                kind=str(meta["kind"]),
                ckpt_dir=str(meta["ckpt_dir"]),
                path=str(meta["path"]),
                keep_last=meta.get("keep_last"),
                parts=int(part["parts"]),
                ranks=tuple(int(r) for r in part["ranks"]),
                keep_interval=meta.get("keep_interval"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(
                f"segment meta of step {header.step} is malformed: {exc}"
            ) from exc

    def retention(self) -> Retention:
        return {"keep_last": self.keep_last, "keep_interval": self.keep_interval}


def file_path(step_path: str, name: str) -> str:
    return step_path if not name else posixpath.join(step_path.rstrip("/"), name)


def persist_part(
    storage: Storage,
    buf: Any,
    header: Header,
    *,
    fault: FaultHook = _no_fault,
    step_path: str | None = None,
) -> int:
    """Writes the part held in segment buffer `buf` (to `step_path`, else to the step path
    its meta names); returns the number of bytes written."""
    meta = header.meta
    step_path = step_path or storage.path(str(meta["path"]))
    image = memoryview(buf)[HEADER_SIZE : HEADER_SIZE + header.image_len]
    crc_ranges = meta.get("crc", [])
    total = 0
    for name, start, end in meta["files"]:
        if not 0 <= start <= end <= header.image_len:
            raise CheckpointError(f"file {name!r} [{start}, {end}) lies outside the image")
        ranges = [
            [s - start, n, [f - start for f in fields]]
            for s, n, fields in crc_ranges
            if start <= s and s + n <= end
        ]
        storage.write_image(file_path(step_path, name), image[start:end], ranges, fault=fault)
        total += end - start
    return total
