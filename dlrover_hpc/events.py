"""The names of the events in a job's ``events.jsonl`` (docs/ARCHITECTURE.md, the event log).

Every writer and every reader of the log uses these members.  ``EventName`` is a ``StrEnum``:
a member is written to JSON as its plain string, and compares equal to it when read back.
"""

from __future__ import annotations

from enum import StrEnum


class EventName(StrEnum):
    # The job's life (master).
    JOB_STARTED = "job_started"
    RENDEZVOUS_COMPLETE = "rendezvous_complete"
    WORKERS_STARTED = "workers_started"
    WORKER_FAILED = "worker_failed"
    WORKERS_RESTARTED = "workers_restarted"
    JOB_FINISHED = "job_finished"
    LOG_REPAIRED = "log_repaired"  # a master found a torn last line and sealed it
    TRAINING_PROGRESS = "training_progress"  # the job's step (round, step, at), every few s
    MASTER_RECOVERED = "master_recovered"  # a restarted master adopted the running round
    # Nodes (master).
    NODE_JOINED = "node_joined"  # an agent registered (a new node, or a restarted agent)
    NODE_LOST = "node_lost"
    NODE_ADMITTED = "node_admitted"
    NODE_RELAUNCHED = "node_relaunched"
    NODE_READMITTED = "node_readmitted"
    HANG_DETECTED = "hang_detected"  # no rank progressed for --hang-timeout
    #: a rank still running after its peers finished training and one exited 0, blocked: stopped,
    #: counted as succeeded (rank, node, stack)
    EXIT_HANG = "exit_hang"
    #: no step for the learned bound, but a rank computes (its CPU time grows): not restarted
    PROGRESS_STALLED = "progress_stalled"
    STRAGGLER_DETECTED = "straggler_detected"  # a rank's forward is slow for a while
    NETCHECK_RESULT = "netcheck_result"
    NODE_DRAINED = "node_drained"
    NODE_QUARANTINED = "node_quarantined"
    REPLACEMENT_REQUESTED = "replacement_requested"
    REPLACEMENT_FAILED = "replacement_failed"
    JOB_REQUEUED = "job_requeued"
    # Time limits and preemption (master): the step saved at the signal, and the next job.
    JOB_PREEMPTED = "job_preempted"
    TIME_LIMIT_REACHED = "time_limit_reached"
    JOB_CONTINUED = "job_continued"
    # Checkpoints (training processes and the agents' savers).
    CHECKPOINT_SAVED = "checkpoint_saved"
    CHECKPOINT_SAVE_FAILED = "checkpoint_save_failed"
    CHECKPOINT_PERSISTED = "checkpoint_persisted"
    CHECKPOINT_PERSIST_FAILED = "checkpoint_persist_failed"
    CHECKPOINT_STORAGE_LOW = "checkpoint_storage_low"
    CHECKPOINT_RESTORED = "checkpoint_restored"
    CHECKPOINT_REPLICATED = "checkpoint_replicated"  # a node's part copied to peers' memory
