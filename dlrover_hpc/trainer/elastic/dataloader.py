"""`ElasticDataLoader`: a `DataLoader` whose batch size can change during training.

DLRover's ``dlrover.trainer.torch.elastic.dataloader`` API.  The batch size changes

- by `ElasticDataLoader.update_batch_size` with a size (a script, or the master through
  it), or
- from DLRover's parallelism config file, a JSON object such as
  ``{"dataloader": {"version": 2, "batch_size": 64}}``: `load_config` (and
  ``update_batch_size()`` without a size, which `ElasticTrainer` calls after every
  optimizer step) applies its ``batch_size`` when its ``version`` is newer than the last one
  applied.  The file is ``config_file=`` or else ``$DLROVER_PARAL_CONFIG_PATH`` (DLRover's
  variable); only a ``config_file=`` given to the constructor is applied at construction.

A change takes effect where torch's `BatchSampler` reads its ``batch_size``: from the next
batch it makes (batches already prefetched by worker processes keep their size), or, with
``drop_last=True``, from the next epoch.  ``loader.batch_size`` and `get_batch_size` report
the current size.  The file may be rewritten while it is read (DLRover's agent writes it in
place): a file that does not parse is skipped with a warning and read again next time.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from torch.utils.data import DataLoader

log = logging.getLogger(__name__)

CONFIG_PATH_ENV = "DLROVER_PARAL_CONFIG_PATH"  # DLRover's ConfigPath.ENV_PARAL_CONFIG


class ElasticDataLoader(DataLoader[Any]):
    """A `torch.utils.data.DataLoader` with a batch size that can change while it runs.

    Takes `DataLoader`'s arguments, plus:
        config_file: DLRover's parallelism config file (JSON, see the module docstring);
            applied now if it exists.  Default: ``$DLROVER_PARAL_CONFIG_PATH``, read only by
            `update_batch_size` / `load_config`.

    Example::

        loader = ElasticDataLoader(dataset, batch_size=32, sampler=sampler)
        loader.update_batch_size(64)  # the next batch has 64 samples
    """

    def __init__(
        self, *args: Any, config_file: str | os.PathLike[str] | None = None, **kwargs: Any
    ) -> None:
        self._initial_batch_size: int | None = None
        super().__init__(*args, **kwargs)
        self._config_version = 0
        if config_file:
            self.config_file: str | None = os.fspath(config_file)
            self.load_config(self.config_file)
        else:
            self.config_file = os.environ.get(CONFIG_PATH_ENV) or None

    # DataLoader stores batch_size once; here it follows the batch sampler's current size.
    @property
    def batch_size(self) -> int | None:
        if self._initial_batch_size is None or self.batch_sampler is None:
            return self._initial_batch_size
        return getattr(self.batch_sampler, "batch_size", self._initial_batch_size)

    @batch_size.setter
    def batch_size(self, value: int | None) -> None:  # DataLoader.__init__ only
        self._initial_batch_size = value

    def get_batch_size(self) -> int | None:
        """The batch size of the next batch (None: the loader does not batch)."""
        return self.batch_size

    def update_batch_size(self, batch_size: int | None = None) -> None:
        """Sets the batch size to ``batch_size``, or applies the config file's when None."""
        if batch_size is None:
            self.load_config(self.config_file)
            return
        self._set_batch_size(batch_size, source="update_batch_size")

    def load_config(self, config_file: str | os.PathLike[str] | None = None) -> None:
        """Applies ``{"dataloader": {"batch_size": n, "version": v}}`` if ``v`` is new.

        A missing or unparsable file, a version not newer than the last one
        applied, or a batch size of 0 changes nothing (DLRover's rules).
        """
        if not config_file:
            return
        path = os.fspath(config_file)
        try:
            with open(path, encoding="utf-8") as f:
                content = f.read()
        except OSError:
            return
        try:
            config = json.loads(content)
        except json.JSONDecodeError:
            log.warning("Cannot parse the dataloader config %s: %r", path, content[:200])
            return
        section = config.get("dataloader") if isinstance(config, dict) else None
        if not isinstance(section, dict):
            return
        version = section.get("version", 0)
        if not isinstance(version, int) or version <= self._config_version:
            return
        self._config_version = version
        batch_size = section.get("batch_size", 0)
        if batch_size:
            try:
                self._set_batch_size(batch_size, source=f"{path} (version {version})")
            except ValueError as exc:
                log.warning("Ignoring the dataloader config %s: %s", path, exc)

    def _set_batch_size(self, batch_size: int, *, source: str) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        sampler: Any = self.batch_sampler
        if self._initial_batch_size is None or not hasattr(sampler, "batch_size"):
            raise ValueError(
                "this ElasticDataLoader has no batch size to change: it was built with "
                "batch_size=None or a custom batch_sampler; build it with batch_size=N"
            )
        if sampler.batch_size != batch_size:
            log.info("Dataloader batch size %d -> %d (%s)", sampler.batch_size, batch_size, source)
            sampler.batch_size = batch_size
