"""Copying many tensors fast: torch's own threads, or a small pool when torch has one thread.

Under torchrun every worker gets OMP_NUM_THREADS=1, so `copy_` is single-threaded; a pool of
Python threads (copy_ releases the GIL) brings back the memory bandwidth of several cores, and
also spreads the page faults of a first copy into fresh shared memory.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from dlrover_hpc.checkpoint.trainer.cuda import copy_cuda

_SPLIT = 16 << 20  # split contiguous tensors into pieces of this many bytes


def default_threads() -> int:
    return max(1, min(4, os.cpu_count() or 1))


class Copier:
    """Copies (dst, src) pairs; `threads` <= 1 means plain `copy_` in the calling thread."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = default_threads() if threads is None else max(1, threads)
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="ckpt-copy")
            return self._pool

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copies every pair; pairs with a GPU side are queued asynchronously (DMA when the
        host side is pinned) and waited for once, the rest are host copies as below."""
        if any(d.is_cuda or s.is_cuda for d, s in pairs):
            copy_cuda([(d, s) for d, s in pairs if d.is_cuda or s.is_cuda])
            pairs = [(d, s) for d, s in pairs if not (d.is_cuda or s.is_cuda)]
            if not pairs:
                return
        total = sum(d.numel() * d.element_size() for d, _ in pairs)
        if self.threads <= 1 or torch.get_num_threads() > 1 or total < (32 << 20):
            with torch.no_grad():
                for dst, src in pairs:
                    dst.copy_(src)
            return
        groups = _partition(_pieces(pairs), self.threads)
        futures = [self._executor().submit(_copy_group, g) for g in groups if g]
        for f in futures:
            f.result()

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


def _pieces(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    out = []
    for dst, src in pairs:
        nbytes = dst.numel() * dst.element_size()
        if nbytes > 2 * _SPLIT and dst.is_contiguous() and src.is_contiguous():
            step = max(1, _SPLIT // dst.element_size())
            flat_d, flat_s = dst.view(-1), src.view(-1)
            for start in range(0, flat_d.numel(), step):
                d = flat_d[start : start + step]
                out.append((d, flat_s[start : start + step], d.numel() * d.element_size()))
        else:
            out.append((dst, src, nbytes))
    return out


def _partition(
    pieces: list[tuple[torch.Tensor, torch.Tensor, int]], n: int
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Contiguous runs of about equal bytes (each thread walks memory forward)."""
    total = sum(p[2] for p in pieces)
    groups: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(n)]
    acc, index = 0, 0
    for dst, src, nbytes in pieces:
        if acc >= total * (index + 1) / n and index < n - 1:
            index += 1
        groups[index].append((dst, src))
        acc += nbytes
    return groups


def _copy_group(group: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for dst, src in group:
            dst.copy_(src)
