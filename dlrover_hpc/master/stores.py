"""The key-value stores the master hands each round's workers (torch's TCPStore)."""

from __future__ import annotations

import threading
from typing import Any


class TorchStores:
    """A fresh torch TCPStore per round, so restarted workers never meet a previous round's keys
    or ports (torchrun's gloo restarts fail exactly there)."""

    def __init__(self, keep: int = 2) -> None:
        # Import torch now, not when the first round completes (it takes seconds on a loaded
        # node), but in the background: a master restarted mid-round must answer its agents'
        # re-registrations at once, and an adopted round needs no new store.
        self._tcp_store: Any = None
        self._import_error: BaseException | None = None
        self._imported = threading.Thread(target=self._import, name="torch-import", daemon=True)
        self._imported.start()
        self._stores: list[Any] = []
        self._keep = keep

    def _import(self) -> None:
        try:
            from torch.distributed import TCPStore

            self._tcp_store = TCPStore
        except BaseException as e:  # raised again by the first new_store
            self._import_error = e

    def ready(self) -> bool:
        """torch is imported: :meth:`new_store` will not block (the master's event loop)."""
        return not self._imported.is_alive()

    def new_store(self, round: int) -> int:
        from datetime import timedelta

        self._imported.join()
        if self._import_error is not None:
            raise self._import_error
        store = self._tcp_store(
            "0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300)
        )
        self._stores.append(store)
        del self._stores[: -self._keep]
        return int(store.port)
