"""Elastic training helpers, as DLRover's ``dlrover.trainer.torch.elastic``.

- `ElasticDistributedSampler` (``.sampler``): shards each epoch's permutation across ranks
  and resumes mid-epoch, exactly, at any world size;
- `ElasticTrainer` (``.trainer``): keeps the global batch fixed by gradient accumulation
  when the world size changes;
- `ElasticDataLoader` (``.dataloader``): a `DataLoader` whose batch size can change during
  training (``update_batch_size``, DLRover's parallelism config file).
"""

from dlrover_hpc.trainer.elastic.dataloader import ElasticDataLoader
from dlrover_hpc.trainer.elastic.sampler import ElasticDistributedSampler
from dlrover_hpc.trainer.elastic.trainer import ElasticTrainer

__all__ = ["ElasticDataLoader", "ElasticDistributedSampler", "ElasticTrainer"]
