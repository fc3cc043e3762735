"""A complete step found in a segment of this node, as a restore and a peer send see it."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

from dlrover_hpc.checkpoint.saver.segments import Header, Segment
from dlrover_hpc.checkpoint.trainer.restore_agreement import Part


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MemoryStep:
    """A complete step found in a segment of this node."""

    step: int
    buffer: int
    segment: Segment
    header: Header
    #: which part of its step it holds and how many parts the step has (`Part`)
    part: int = 0
    parts: int = 1

    @property
    def token(self) -> int:
        """The generation token of the save that wrote it (-1 when the meta lacks it)."""
        token = self.header.meta.get("token")
        return token if isinstance(token, int) else -1

    @property
    def buf(self) -> Any:
        return self.segment.mm

    @property
    def name(self) -> str:
        return self.segment.path

    @property
    def key(self) -> tuple[int, int, int, int]:
        return (self.step, self.token, self.part, self.parts)

    def as_part(self) -> Part:
        return Part(
            step=self.step,
            token=self.token,
            part=self.part,
            parts=self.parts,
            nbytes=self.header.size,
        )

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        self.segment.lock(exclusive=False)
        try:
            yield
        finally:
            self.segment.unlock()
