"""`ElasticDistributedSampler`: a `DistributedSampler` that resumes mid-epoch at any world size.

DLRover's ``dlrover.trainer.torch.elastic.sampler`` API, with exact resumption when the number
of ranks changes between a checkpoint and the restart.

**Positions.**  An epoch is one permutation of the dataset (``seed + epoch`` seeds it, the
same at every world size; ``shuffle=False``: ``0 .. N-1``).  The job consumes it in order:
*position* ``p`` means its first ``p`` indices were consumed, by all ranks together.  A pass
that starts at ``p`` with ``W`` ranks gives rank ``r`` the remaining indices at positions
``p + r, p + r + W, p + r + 2W, ...`` (interleaved, like `DistributedSampler`), so one global
step (one batch of ``b`` on every rank) consumes the contiguous block ``[p, p + b*W)``.

**The tail** of a pass, when the ``R = N - p`` remaining indices are not a multiple of ``W``:

- ``drop_last=False`` (default): like `DistributedSampler`, the pass is padded to
  ``ceil(R / W) * W`` by repeating its own first indices (positions ``p, p + 1, ...``), so
  ``ceil(R / W) * W - R`` samples are seen twice in that epoch;
- ``drop_last=True``: each rank gets ``R // W`` samples and the last ``R % W`` indices are not
  used in this epoch (a restart at a smaller world size before the epoch ends may still use
  them: they are after the saved position).

**Checkpoints.**  ``state_dict(iter_step, micro_batch_size)`` (DLRover's signature) returns
``{"completed_num": p, "epoch": e, "iter_step": iter_step}``; ``load_state_dict`` restores
the position, and the next pass of epoch ``e`` starts there at the current world size.
``iter_step`` is the training script's step counter (batches per rank), the one it saves in
the same checkpoint and restores with it: the sampler counts the batches since the
checkpoint it resumed from (``iter_step`` minus the saved one), so the position stays exact
when the world size changed between them.  DLRover's formula, ``iter_step *
micro_batch_size * num_replicas``, assumes the world size never changed in the epoch.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping, Sized
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler

log = logging.getLogger(__name__)

T_co = TypeVar("T_co", covariant=True)

_UNKNOWN = -1  # a loaded state without "iter_step" (DLRover's own): count as DLRover does


class ElasticDistributedSampler(DistributedSampler[T_co]):
    """Shards an epoch's permutation across ranks and resumes it at any world size.

    Args (as `torch.utils.data.DistributedSampler` and DLRover's sampler):
        dataset: a sized dataset.
        num_replicas: the world size; default ``torch.distributed``'s, or 1 when it is not
            initialized (DLRover's default).
        rank: this rank; default ``torch.distributed``'s, or 0 when it is not initialized.
        shuffle: permute each epoch with ``seed + epoch``.
        seed: the permutation's seed; the same on every rank.
        drop_last: drop a pass's tail instead of padding it (see the module docstring).

    Example::

        sampler = ElasticDistributedSampler(dataset=train_data)
        loader = ElasticDataLoader(train_data, batch_size=32, sampler=sampler)
        sampler.load_state_dict(ckpt["sampler"])  # if resuming
        for epoch in range(sampler.epoch, n_epochs):
            sampler.set_epoch(epoch)  # keeps the loaded position for the loaded epoch
            for batch in loader:
                step += 1
                ...
                ckpt["sampler"] = sampler.state_dict(step, loader.batch_size)
    """

    def __init__(
        self,
        dataset: Dataset[T_co],
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if not isinstance(dataset, Sized):
            raise ValueError(
                f"dataset must have a length (len(dataset)); got {type(dataset).__name__}: "
                "use an iterable-style dataset without a sampler instead"
            )
        if num_replicas is not None and num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1 (the world size), got {num_replicas}")
        if not (dist.is_available() and dist.is_initialized()):
            rank = 0 if rank is None else rank
            num_replicas = 1 if num_replicas is None else num_replicas
        super().__init__(dataset, num_replicas, rank, shuffle, seed, drop_last)
        # epoch -> (position to resume at, the caller's iter_step at that position)
        self._resume: dict[int, tuple[int, int]] = {}
        self._warned_epoch = -1
        self._plan()

    # --- positions -------------------------------------------------------------------------

    def _dataset_size(self) -> int:
        return len(cast(Sized, self.dataset))

    def _start(self) -> tuple[int, int]:
        return self._resume.get(self.epoch, (0, 0))

    def _plan(self) -> None:
        """Sets ``num_samples`` (this rank's share of the pass) and ``total_size``."""
        remaining = max(self._dataset_size() - self._start()[0], 0)
        if self.drop_last:
            self.num_samples = remaining // self.num_replicas
        else:
            self.num_samples = math.ceil(remaining / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def permutation(self) -> list[int]:
        """The epoch's order of the dataset's indices; the same at every world size."""
        size = self._dataset_size()
        if not self.shuffle:
            return list(range(size))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return cast(list[int], torch.randperm(size, generator=generator).tolist())

    def __iter__(self) -> Iterator[T_co]:
        self._plan()
        rest = self.permutation()[self._start()[0] :]
        if self.drop_last:
            rest = rest[: self.total_size]
        elif rest and len(rest) < self.total_size:
            padding = self.total_size - len(rest)
            rest += (rest * math.ceil(padding / len(rest)))[:padding]
        return cast(Iterator[T_co], iter(rest[self.rank : self.total_size : self.num_replicas]))

    def set_epoch(self, epoch: int) -> None:
        """Starts ``epoch`` at position 0, or where `load_state_dict` left it for that epoch."""
        self.epoch = epoch
        self._plan()

    # --- checkpoints -----------------------------------------------------------------------

    def state_dict(self, iter_step: int, micro_batch_size: int) -> dict[str, int]:
        """The position after this rank took ``iter_step`` batches of ``micro_batch_size``.

        ``iter_step`` is the script's step counter, restored from the checkpoint the sampler
        was loaded from (it continues from the saved value), or counted from 0 in an epoch
        the sampler did not resume.  Every rank returns the same state.
        """
        iter_step = _count("iter_step", iter_step, least=0)
        micro_batch_size = _count("micro_batch_size", micro_batch_size, least=1)
        start, step0 = self._start()
        world = self.num_replicas
        if step0 == _UNKNOWN:  # resumed from a DLRover state: DLRover's own formula
            return self._state(iter_step * micro_batch_size * world, iter_step)
        steps = iter_step - step0
        if steps < 0:
            raise ValueError(
                f"iter_step={iter_step} is less than the step the sampler resumed from "
                f"({step0}, saved with its state): pass the step counter restored from the "
                "same checkpoint, which continues from there"
            )
        if steps > math.ceil(self.num_samples / micro_batch_size):
            # More batches than this pass has: a counter that does not restart at each epoch
            # (DLRover's examples count across epochs).  DLRover's formula, wrapped modulo the
            # dataset size on load: exact while the world and batch sizes never changed.
            if self._warned_epoch != self.epoch:
                self._warned_epoch = self.epoch
                log.warning(
                    "iter_step=%d: %d batches since the start of epoch %d's pass, which has "
                    "only %d batches of %d per rank; taking iter_step as a count across "
                    "epochs (DLRover's formula, exact only if the world size and batch size "
                    "never changed): pass the step within the epoch for exact resumption",
                    iter_step,
                    steps,
                    self.epoch,
                    math.ceil(self.num_samples / micro_batch_size),
                    micro_batch_size,
                )
            return self._state(iter_step * micro_batch_size * world, iter_step)
        consumed = min(steps * micro_batch_size, self.num_samples) * world
        return self._state(min(start + consumed, self._dataset_size()), iter_step)

    def _state(self, completed_num: int, iter_step: int) -> dict[str, int]:
        return {"completed_num": completed_num, "epoch": self.epoch, "iter_step": iter_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resumes ``state["epoch"]`` at ``state["completed_num"]``, at this world size.

        Missing keys default to 0 (DLRover's behaviour); a ``completed_num`` beyond the dataset
        (DLRover's count across epochs) is taken modulo the dataset size, as DLRover does.
        A state without ``iter_step`` (saved by DLRover) makes `state_dict` count as DLRover
        does in the resumed epoch.
        """
        epoch = int(state.get("epoch", 0))
        completed = int(state.get("completed_num", 0))
        if epoch < 0 or completed < 0:
            raise ValueError(
                f"a sampler state needs epoch >= 0 and completed_num >= 0, got {dict(state)}"
            )
        step0 = int(state["iter_step"]) if "iter_step" in state else _UNKNOWN
        size = self._dataset_size()
        if completed > size and size > 0:
            log.warning(
                "completed_num=%d exceeds the dataset size %d: resuming at %d (modulo)",
                completed,
                size,
                completed % size,
            )
            completed %= size
        self.epoch = epoch
        self._resume = {epoch: (completed, step0)}
        self._plan()
        log.info(
            "Sampler resumes epoch %d at sample %d of %d: %d samples on each of %d ranks",
            epoch,
            completed,
            size,
            self.num_samples,
            self.num_replicas,
        )


def _count(name: str, value: object, *, least: int) -> int:
    """``value`` as an int; an integral float is accepted (DLRover's tests pass ``i / b``)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    return value
