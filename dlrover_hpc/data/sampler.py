"""A torch ``Sampler`` over the shards the job master hands out (see :mod:`.client`)."""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import Sampler

from dlrover_hpc.data.client import ShardingClient


class ShardingSampler(Sampler[int]):
    """Sample indices of this rank's shards, until the master has none left.

    Use it with ``num_workers=0`` or a small prefetch: the master counts a rank's samples as
    drawn in order, ``batch_size`` per step.  It has no length: the number of samples a rank
    gets depends on how fast it trains and on the other ranks."""

    def __init__(self, client: ShardingClient) -> None:
        self.client = client

    def __iter__(self) -> Iterator[int]:
        return self.client.indices()
