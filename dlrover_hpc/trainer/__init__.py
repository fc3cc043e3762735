"""The training processes' API under DLRover's module paths (``dlrover.trainer.torch``).

`dlrover_hpc.trainer.elastic` is ``dlrover.trainer.torch.elastic``: the elastic sampler,
trainer and dataloader, so that a DLRover training script runs here with its imports changed.
"""
