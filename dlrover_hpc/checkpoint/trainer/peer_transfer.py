"""Peer restore: a rank that lacks its part of the memory step receives it from a holder.

The bytes of the holder's segment (header, image, meta) travel as they are, by point-to-point
sends over the job's process group: with gloo straight from the mapping over TCP, with NCCL
staged through the GPU chunk by chunk.  The receiver then restores from those bytes exactly as
it would from a segment of its own (`ReceivedStep`), after checking that the header is intact
and names the step, save and part it asked for.

Both ends know every transfer and its size from the agreed plan (`restore_agreement.Choice`),
so each posts exactly its own sends and receives and waits only for them.  The transfers run
in rounds of one chunk each, so NCCL's staging memory stays bounded by a chunk per transfer,
and a rank that both sends and receives posts both in one batch (no ordering deadlock).
Nothing on the sending side can fail after the vote that precedes the load: a segment that
turned out shorter than planned is padded, and the receiver's checks reject it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import mmap
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from dlrover_hpc.checkpoint.saver.segments import Header, read_header
from dlrover_hpc.checkpoint.trainer.restore_agreement import Agreement, Transfer
from dlrover_hpc.errors import CheckpointError

logger = logging.getLogger(__name__)

#: bytes per round and transfer; with NCCL also the GPU staging per transfer
CHUNK = 64 << 20


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Outgoing:
    """A planned send and the holder's bytes it sends (a mapped segment)."""

    transfer: Transfer
    buf: Any


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ReceivedStep:
    """A part received from a peer: the bytes of the holder's segment, checked."""

    step: int
    header: Header
    #: an anonymous mapping: unlike a bytearray it is not zeroed up front (0.4 s at 400 MB)
    buf: mmap.mmap
    src: int

    @property
    def token(self) -> int:
        token = self.header.meta.get("token")
        return token if isinstance(token, int) else -1

    @property
    def name(self) -> str:
        return f"the part of step {self.step} received from rank {self.src}"

    def reading(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()  # nobody else writes these bytes


def exchange(
    agreement: Agreement, sends: Sequence[Outgoing], receive: Transfer | None
) -> mmap.mmap | None:
    """Runs this rank's planned sends and its receive; returns the received bytes."""
    dist = agreement.dist
    if dist is None or (not sends and receive is None):
        return None
    t0 = time.perf_counter()
    device = agreement.device()
    received = mmap.mmap(-1, receive.nbytes) if receive is not None else None
    into = torch.frombuffer(received, dtype=torch.uint8) if received is not None else None
    sources = [_as_bytes(s.buf, s.transfer.nbytes) for s in sends]
    sizes = [s.transfer.nbytes for s in sends] + ([receive.nbytes] if receive else [])
    for start in range(0, max(sizes), CHUNK):
        ops, staged = [], None
        for out, data in zip(sends, sources, strict=True):
            if start < out.transfer.nbytes:
                chunk = data[start : start + CHUNK].to(device)
                ops.append(dist.P2POp(dist.isend, chunk, out.transfer.dst, tag=start // CHUNK))
        if receive is not None and into is not None and start < receive.nbytes:
            target = into[start : start + CHUNK]
            staged = target if device.type == "cpu" else torch.empty_like(target, device=device)
            ops.append(dist.P2POp(dist.irecv, staged, receive.src, tag=start // CHUNK))
        for work in dist.batch_isend_irecv(ops) if ops else ():
            work.wait()
        if staged is not None and staged.device.type != "cpu":
            target.copy_(staged)
    logger.debug(
        "checkpoint peer_exchange sent=%s received=%d seconds=%.3f",
        [(s.transfer.dst, s.transfer.nbytes) for s in sends],
        receive.nbytes if receive is not None else 0,
        time.perf_counter() - t0,
    )
    return received


def _as_bytes(buf: Any, nbytes: int) -> torch.Tensor:
    """`nbytes` of `buf` as a uint8 tensor (a view, no copy), zero-padded when shorter."""
    size = len(memoryview(buf)) if buf is not None else 0
    if size >= nbytes:
        return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)
    padded = torch.zeros(nbytes, dtype=torch.uint8)
    if size:
        padded[:size] = torch.frombuffer(buf, dtype=torch.uint8, count=size)
    return padded


def received_step(
    data: mmap.mmap | None, *, want: Transfer, step: int, save: int, kind: str
) -> ReceivedStep:
    """The received bytes as a step to restore from; raises unless they hold a complete
    segment of exactly the wanted step, save and part (a torn or swapped part never loads)."""
    header = read_header(data) if data is not None else None
    if data is None or header is None:
        raise CheckpointError(
            f"the part of step {step} received from rank {want.src} is not a complete segment"
        )
    meta = header.meta
    part = 0 if want.parts == 1 else meta.get("rank")
    parts = 1 if want.parts == 1 else meta.get("world_size")
    got = (header.step, meta.get("token"), meta.get("kind"), part, parts)
    expected = (step, save, kind, want.part, want.parts)
    if got != expected:
        raise CheckpointError(
            f"rank {want.src} sent (step, save, kind, part, parts) {got} instead of {expected}"
        )
    return ReceivedStep(step=step, header=header, buf=data, src=want.src)
