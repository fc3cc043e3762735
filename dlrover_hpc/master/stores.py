"""The key-value stores the master hands each round's workers (torch's TCPStore)."""

from __future__ import annotations

from typing import Any


class TorchStores:
    """A fresh torch TCPStore per round, so restarted workers never meet a previous round's keys
    or ports (torchrun's gloo restarts fail exactly there)."""

    def __init__(self, keep: int = 2) -> None:
        # Import torch now, not when the first round completes (it takes a second or two).
        from torch.distributed import TCPStore

        self._tcp_store = TCPStore
        self._stores: list[Any] = []
        self._keep = keep

    def new_store(self, round: int) -> int:
        from datetime import timedelta

        store = self._tcp_store(
            "0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300)
        )
        self._stores.append(store)
        del self._stores[: -self._keep]
        return int(store.port)
