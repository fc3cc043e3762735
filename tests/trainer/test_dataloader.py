"""ElasticDataLoader: batch size changes by call and by DLRover's parallelism config file."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from dlrover_hpc.trainer.elastic import ElasticDataLoader, ElasticTrainer
from dlrover_hpc.trainer.elastic.dataloader import CONFIG_PATH_ENV

DATA = list(range(40))


def sizes(batches: list[torch.Tensor]) -> list[int]:
    return [len(b) for b in batches]


def write(path: Path, version: int, batch_size: int) -> None:
    path.write_text(json.dumps({"dataloader": {"version": version, "batch_size": batch_size}}))


def test_update_batch_size_applies_from_the_next_batch() -> None:
    loader = ElasticDataLoader(DATA, batch_size=4)
    assert loader.batch_size == loader.get_batch_size() == 4 and len(loader) == 10
    it = iter(loader)
    first = next(it)
    loader.update_batch_size(8)
    rest = list(it)
    assert first.tolist() == [0, 1, 2, 3] and sizes(rest) == [8, 8, 8, 8, 4]
    assert torch.cat([first, *rest]).tolist() == DATA  # nothing skipped or repeated
    assert loader.batch_size == 8 and len(loader) == 5


def test_with_drop_last_the_change_applies_from_the_next_epoch() -> None:
    """torch's BatchSampler reads the batch size once per epoch when it drops the last."""
    loader = ElasticDataLoader(DATA, batch_size=6, drop_last=True)
    it = iter(loader)
    next(it)
    loader.update_batch_size(10)
    assert sizes(list(it)) == [6] * 5
    assert sizes(list(loader)) == [10] * 4


def test_config_file_argument_is_applied_at_construction_and_on_update(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = tmp_path / "paral.json"
    write(config, version=1, batch_size=5)
    loader = ElasticDataLoader(DATA, batch_size=4, config_file=config)
    assert loader.batch_size == 5 and loader.config_file == str(config)
    write(config, version=2, batch_size=10)
    loader.update_batch_size()
    assert loader.batch_size == 10
    write(config, version=2, batch_size=3)  # not a newer version: ignored (DLRover's rule)
    loader.update_batch_size()
    assert loader.batch_size == 10
    config.write_text('{"dataloader": {"vers')  # caught mid-write
    with caplog.at_level(logging.WARNING):
        loader.update_batch_size()
    assert loader.batch_size == 10 and "Cannot parse" in caplog.text
    write(config, version=3, batch_size=0)  # 0: keep the batch size
    loader.update_batch_size()
    write(config, version=4, batch_size=-2)
    with caplog.at_level(logging.WARNING):
        loader.update_batch_size()
    assert loader.batch_size == 10 and "batch_size must be an integer >= 1" in caplog.text
    config.unlink()
    loader.update_batch_size()
    assert loader.batch_size == 10


def test_config_path_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``$DLROVER_PARAL_CONFIG_PATH``: read by update_batch_size(), not at construction."""
    config = tmp_path / "paral.json"
    write(config, version=1, batch_size=5)
    monkeypatch.setenv(CONFIG_PATH_ENV, str(config))
    loader = ElasticDataLoader(DATA, batch_size=4)
    assert loader.config_file == str(config) and loader.batch_size == 4
    loader.update_batch_size()
    assert loader.batch_size == 5
    loader.load_config(None)  # no file: nothing happens
    assert loader.batch_size == 5


def test_no_config_anywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CONFIG_PATH_ENV, raising=False)
    loader = ElasticDataLoader(DATA, batch_size=4)
    loader.update_batch_size()
    assert loader.config_file is None and loader.batch_size == 4


def test_bad_batch_sizes() -> None:
    loader = ElasticDataLoader(DATA, batch_size=4)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
            loader.update_batch_size(bad)  # type: ignore[arg-type]
    unbatched = ElasticDataLoader(DATA, batch_size=None)
    assert unbatched.batch_size is None
    with pytest.raises(ValueError, match="no batch size to change"):
        unbatched.update_batch_size(2)


def test_batch_size_cannot_be_assigned_after_construction() -> None:
    """As with DataLoader: the size changes through update_batch_size only."""
    loader = ElasticDataLoader(DATA, batch_size=4)
    with pytest.raises(ValueError, match="should not be set"):
        loader.batch_size = 8


def test_the_trainer_reloads_the_config_after_each_optimizer_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DLRover's ElasticTrainer calls update_batch_size() after each optimizer step."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # one rank: 2 micro-steps of 2 per step
    config = tmp_path / "paral.json"
    loader = ElasticDataLoader(list(range(16)), batch_size=2, config_file=config)
    m = torch.nn.Linear(1, 1)
    trainer = ElasticTrainer(m, loader, global_batch_size=4)
    optimizer = trainer.prepare(torch.optim.SGD(m.parameters(), lr=0.1))
    config.write_text(json.dumps({"dataloader": {"version": 1, "batch_size": 4}}))
    sizes = []
    for batch in loader:
        sizes.append(len(batch))
        with trainer.step():
            optimizer.step()
    assert sizes == [2, 2, 4, 4, 4]  # read after the first window's optimizer step
