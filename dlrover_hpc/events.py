"""The names of the events in a job's ``events.jsonl`` (docs/design/architecture.md, the event log).

docs/reference/events.md lists them with their comments, made from this file by
docs/reference.py: a new member needs its comment.

Every writer and every reader of the log uses these members.  ``EventName`` is a ``StrEnum``:
a member is written to JSON as its plain string, and compares equal to it when read back.
"""

from __future__ import annotations

from enum import StrEnum


class EventName(StrEnum):
    # The job's life (master).
    JOB_STARTED = "job_started"  # a master started (resumed_round: from the journal)
    #: a round formed (round, nodes in rank order; with --segment: segment, each node's block)
    RENDEZVOUS_COMPLETE = "rendezvous_complete"
    WORKERS_STARTED = "workers_started"  # a node started its workers (pids, in_process)
    WORKER_FAILED = "worker_failed"  # a worker died (exit code or signal, classification)
    WORKERS_RESTARTED = "workers_restarted"  # the job restarted its workers (restart count)
    JOB_FINISHED = "job_finished"  # the job ended (exit code, reason, durable step)
    #: --crash-loop-rounds rounds in a row failed without progress: the job stops (exit 3);
    #: rounds, and the repeated failure's rank, node, classification and error line
    CRASH_LOOP = "crash_loop"
    LOG_REPAIRED = "log_repaired"  # a master found a torn last line and sealed it
    TRAINING_PROGRESS = "training_progress"  # the job's step (round, step, at), every few s
    MASTER_RECOVERED = "master_recovered"  # a restarted master adopted the running round
    # Nodes (master).
    NODE_JOINED = "node_joined"  # an agent registered (a new node, or a restarted agent)
    NODE_LOST = "node_lost"  # closed connection, timed-out link or missed heartbeats
    NODE_ADMITTED = "node_admitted"  # a spare, relaunch or replacement joined a round
    NODE_RELAUNCHED = "node_relaunched"  # the master started a new agent on a live node
    NODE_READMITTED = "node_readmitted"  # a lost agent's connection came back
    HANG_DETECTED = "hang_detected"  # no rank progressed for --hang-timeout
    #: a rank still running after its peers finished training and one exited 0, blocked: stopped,
    #: counted as succeeded (rank, node, stack)
    EXIT_HANG = "exit_hang"
    #: no step for the learned bound, but a rank computes (its CPU time grows): not restarted
    PROGRESS_STALLED = "progress_stalled"
    STRAGGLER_DETECTED = "straggler_detected"  # a rank's compute, or a node's link, is slow
    NETCHECK_RESULT = "netcheck_result"  # a network-check round (faulty, stragglers, timings)
    NODE_DRAINED = "node_drained"  # scontrol drained a faulty node
    NODE_QUARANTINED = "node_quarantined"  # a faulty node kept out of this job (no drain)
    #: Slurm set a node of the job DRAIN, FAIL or DOWN while it trained or waited, or lifted
    #: such a drain (node, slurm_state, reason, action: out at the next step every rank holds
    #: in memory, benched while drained, lost, back as a hot spare, or excluded for good)
    NODE_STATE_CHANGED = "node_state_changed"
    #: a node failed a health check before joining (node, check, reason): excluded, drained
    NODE_UNHEALTHY = "node_unhealthy"
    REPLACEMENT_REQUESTED = "replacement_requested"  # a replacement job submitted
    REPLACEMENT_FAILED = "replacement_failed"  # Slurm refused it (reason, next action)
    JOB_REQUEUED = "job_requeued"  # below MIN nodes too long: scontrol requeue
    # Time limits and preemption (master): the step saved at the signal, and the next job.
    JOB_PREEMPTED = "job_preempted"  # SIGTERM: saved at a step (step, stop_step)
    TIME_LIMIT_REACHED = "time_limit_reached"  # USR1 or --stop-lead: saved at a step
    JOB_CONTINUED = "job_continued"  # the next run (job, how: requeue or resubmit)
    #: the node that ran the job script died and Slurm kept the job (--no-kill) without it: the
    #: master ended the allocation at the job's end (node, job, exit_code)
    BATCH_HOST_LOST = "batch_host_lost"
    # Checkpoints (training processes and the agents' savers).
    CHECKPOINT_SAVED = "checkpoint_saved"  # a step in memory (blocking_s, total_s)
    CHECKPOINT_SAVE_FAILED = "checkpoint_save_failed"  # a save skipped (error)
    CHECKPOINT_PERSISTED = "checkpoint_persisted"  # a step committed on storage
    CHECKPOINT_PERSIST_FAILED = "checkpoint_persist_failed"  # storage refused (step, error)
    CHECKPOINT_STORAGE_LOW = "checkpoint_storage_low"  # room for < 2 more checkpoints
    #: the node-local tier (--local-ckpt-dir) refused a step (step, path, error): it went
    #: straight to the shared checkpoint directory
    CHECKPOINT_LOCAL_TIER_FAILED = "checkpoint_local_tier_failed"
    #: a persist in flight made no progress for 5 s (seconds, path, step, node; ongoing: true),
    #: then once more when storage answered or the persist ended (ongoing: false, the seconds
    #: it lasted); training never waits for it
    PERSIST_STALLED = "persist_stalled"
    #: a step waiting for storage whose buffer a newer save took: the newer step (by_step) is
    #: persisted instead (step, by_step, ranks, node)
    CHECKPOINT_SUPERSEDED = "checkpoint_superseded"
    CHECKPOINT_RESTORED = "checkpoint_restored"  # a rank restored (step, source)
    RESTORE_REJECTED = "restore_rejected"  # a restored step failed its check (step, source, why)
    CHECKPOINT_REPLICATED = "checkpoint_replicated"  # a node's part copied to peers' memory
    #: --persist-every chose or changed the interval between persists of a step in memory
    #: (interval_s, mode auto or fixed; auto: persist_s, mtbf_s, mtbf_source observed or site)
    PERSIST_INTERVAL = "persist_interval"
