"""DLRover's flash-checkpoint API (``dlrover.trainer.torch.flash_checkpoint``) on our engine.

A DLRover training script runs here with its imports changed, one substitution each:

    dlrover.trainer.torch.flash_checkpoint.X  ->  dlrover_hpc.trainer.flash_checkpoint.X
    dlrover.trainer.torch.elastic.Y           ->  dlrover_hpc.trainer.elastic.Y
    dlrover.python.common.storage             ->  dlrover_hpc.trainer.storage

Every DLRover argument and method, and what happens to it.  ACCEPTED: same meaning,
implemented; MAPPED: same meaning through our own mechanism; REFUSED: raises
`UnsupportedArgument` (a ValueError) whose message says why and what to pass instead.

checkpointer.StorageType (MEMORY, DISK)
    ACCEPTED: `dlrover_hpc.checkpoint.StorageType` (string values, not DLRover's auto ints).
checkpointer.Checkpointer
    ACCEPTED: the abstract base (save_checkpoint, load_checkpoint) of the classes below.

ddp.DdpCheckpointer(checkpoint_dir, local_shard_num=1, global_shard_num=1, comm_backend="",
                    deletion_strategy=None, save_timeout=600, replica_count=0)
  checkpoint_dir     ACCEPTED (also any fsspec URL).
  local_shard_num,   ACCEPTED 1, 1: replicated state; node-local rank 0 keeps it in memory,
  global_shard_num     global rank 0's copy is persisted.  MAPPED ranks-per-node, world size
                       (every rank a shard): per-rank files through our RankCheckpointer.
                       REFUSED otherwise (shards on some ranks only): every rank must save.
                       global < local is raised to local first, as DLRover does.
  comm_backend       MAPPED to the default process group: our saves need no collective and
                       the restore agreement and peer transfers run on the default group;
                       only checked to be a string.
  deletion_strategy  MAPPED: KeepLatestStepStrategy(N, dir) -> keep_last=N,
                       KeepStepIntervalStrategy(K, dir) -> keep_interval=K (keep the multiples
                       of K and the newest); the agent's saver applies it at every commit,
                       deleting the step's files and its emptied `<dir>/<step>` directory.
                       REFUSED: a custom CheckpointDeletionStrategy (the saver cannot run the
                       script's class), a strategy whose checkpoint_dir is another directory,
                       or one given together with keep_last/keep_interval.
  save_timeout       MAPPED to nothing to wait for: checked > 0.  A step is committed once
                       every part is durable and an incomplete step never is, so the previous
                       checkpoint stays the newest without a timeout.
  replica_count      ACCEPTED with shards: the agent copies each node's parts of every save
                       to that many peer nodes' memory in the background; a replacement node
                       receives them from a peer (README: memory use).  MAPPED for replicated
                       state: every node already holds a full copy (the count is ignored).
  storage=           (keyword; DLRover before May 2024) MAPPED: PosixDiskStorage -> default,
                       PosixStorageWithDeletion(tracker, strategy) -> its strategy as above.
                       REFUSED: other CheckpointStorage classes (the saver writes through
                       fsspec: give an fsspec URL as checkpoint_dir).
  **options          ours, passed on: env, events, tag, keep_last, keep_interval, verify,
                       weights_only, device_snapshot, copy_threads, io_threads,
                       check_finite (default True), validate (a function of the state).
  save_checkpoint(step, state_dict, path="", storage_type=StorageType.DISK)
                     ACCEPTED.  path: the file rank 0's state goes to, default
                       `<checkpoint_dir>/<step>/rank_<rank>.pt`; for a MEMORY save, where it
                       goes if the process fails first (the agent persists the newest memory
                       step then).  With shards: `<step dir>/rank_<rank>.pt` (other names are
                       REFUSED).  Another storage_type: ValueError, as DLRover.  Returns True
                       (DLRover: None), False with a warning when the step was not kept.
  load_checkpoint(resume_path="")
                     ACCEPTED.  The newest step in any node's memory (all ranks agree on it);
                       else the torch.save file `resume_path` ({} when missing); else the
                       newest committed step (found by its commit record, so a step saved to
                       a custom path loads too); {} when none.  A step that fails to load on
                       any rank makes every rank step back to an older one together.
  load_checkpoint(resume_path="", *, validate=None)
                     Ours, beyond DLRover: the loaded state is checked (a NaN or an infinity
                       in a floating tensor, unless check_finite=False; `validate(state)`, this
                       call's or the constructor's); a step rejected on any rank is replaced
                       by the next older one on every rank (`restore_rejected` events);
                       RestoreRejectedError when none is left.  FsdpShardCheckpointer's and
                       FsdpFullCheckpointer's load_checkpoint take validate= too.
  wait_latest_checkpoint(timeout=1800)
                     ACCEPTED; returns True once the newest DISK save is committed, False on
                       timeout (DLRover returns None).

fsdp.FsdpShardCheckpointer(checkpoint_dir, comm_backend="", deletion_strategy=None,
                           save_timeout=600, replica_count=0), keyword storage=
  arguments          as for DdpCheckpointer.
  save_checkpoint(step, model, optimizer, extra_sd={}, path="", storage_type=DISK)
                     ACCEPTED: {"model", "optim"} of FSDP's SHARDED_STATE_DICT plus extra_sd,
                       saved with torch.distributed.checkpoint; path: the DCP directory,
                       default `<checkpoint_dir>/<step>`.  The older form
                       (step, state_dict, path, storage_type) saves state_dict as it is.
  load_checkpoint(model, optimizer, resume_path="")
                     ACCEPTED: loads the model, then the optimizer
                       (load_sharded_optimizer_state_dict), in place; source order as for
                       DdpCheckpointer, resume_path a DCP directory; returns {"step": step}.
  get_storage_reader()  ACCEPTED (older DLRover): a DCP StorageReader of the newest step.
  wait_latest_checkpoint(timeout=1800)  ACCEPTED, as for DdpCheckpointer.

fsdp.FsdpFullCheckpointer(checkpoint_dir, comm_backend="", deletion_strategy=None,
                          save_timeout=600), keyword storage=
  arguments          as for DdpCheckpointer (replicated state).
  save_checkpoint(step, model, optimizer, extra_sd={}, path="", storage_type=DISK)
                     ACCEPTED: {"model", "optimizer"} of FULL_STATE_DICT (rank0_only=False)
                       plus extra_sd, as DdpCheckpointer saves.  MAPPED: DLRover's rank 0
                       removes dirname(path) before a DISK save; here the saver replaces the
                       file atomically instead (no directory of a custom path is removed).
  load_checkpoint(model, optimizer, resume_path="")
                     ACCEPTED: loads both in place, returns the rest (extra_sd).
  wait_latest_checkpoint(timeout=1800)  ACCEPTED.

dlrover.python.common.storage -> dlrover_hpc.trainer.storage
  KeepLatestStepStrategy(max_to_keep, checkpoint_dir),
  KeepStepIntervalStrategy(keep_interval, checkpoint_dir)
                     ACCEPTED (clean_up(step, delete_func) as DLRover's) and MAPPED when
                       given to a checkpointer (above).  KeepLatestStepStrategy keeps the
                       newest max_to_keep committed steps of the directory, also those of an
                       earlier run (DLRover forgets the steps of earlier processes).
  CheckpointDeletionStrategy, CheckpointStorage, PosixDiskStorage,
  PosixStorageWithDeletion, get_checkpoint_storage, ClassMeta
                     ACCEPTED (same methods); as `storage=`, see above.

hf_trainer.FlashCkptTrainer(...)  ACCEPTED: a drop-in for HF's Trainer; get_last_checkpoint(),
                       wait_latest_checkpoint(timeout) as DLRover's.  Ours also saves to memory
                       every step (memory_save_steps=1).
deepspeed.DeepSpeedCheckpointer(engine, checkpoint_dir, comm_backend="",
                                deletion_strategy=None, save_timeout=600)
                     ACCEPTED; save_checkpoint(save_dir, tag=None, client_state={},
                       save_latest=True, storage_type=DISK) and load_checkpoint(load_dir, tag,
                       ...) as DeepSpeed's engine methods.  MAPPED: DeepSpeed's `latest` file is
                       not written (load_checkpoint() finds the newest step).
Ours, beyond DLRover: lightning_ckpt.FlashCheckpoint (a Lightning callback) and
capture.DirectoryCheckpointer (any framework's directory save: accelerate, Megatron-Core's
dist_checkpointing).

Not provided (importing them fails): megatron and megatron_dist_ckpt (Megatron-LM's
save/load_checkpoint; Megatron-LM's training package is not on the package index), and
DLRover's engines (engine, full_ckpt_engine, fsdp_engine, replica).

Without dlrover-run (plain torchrun, one process) DLRover starts a saver process; ours
persists from a thread in the training process and says so in one warning line.
"""
