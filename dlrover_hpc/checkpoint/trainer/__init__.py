"""The trainer side of flash checkpoints: everything that runs inside the training process.

May import torch.  The checkpointers (`torchfile_checkpointer`, `fsdp_checkpointer`) share
`checkpointer.CheckpointerBase`; `engine` owns the segments, the saver connection and events;
`restore_agreement` makes every rank restore the same step from the same source.
"""
