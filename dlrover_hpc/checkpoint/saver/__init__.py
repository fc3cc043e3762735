"""The saver side of flash checkpoints: what runs in the agent (or a saver thread).

Nothing under this package imports torch (tests/checkpoint/test_saver.py checks it): the
agent imports `host.SaverHost` without paying for torch.  It owns the shared-memory segment
format (`segments`), persisting parts (`part_files`, `storage`), the persist queue
(`persist_queue`), commits (`commits`: counting; `commit_records`: records, tracker,
retention) and the worker <-> saver socket protocol (`worker_protocol`).
"""
