"""The stop notice through a rank's progress record: the agent writes it, the worker reads it
at every save and marks that it stopped; neither part disturbs the progress fields."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlrover_hpc.worker import progress


def test_notice_round_trip_through_the_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "rank0.progress"
    monkeypatch.setenv(progress.PATH_ENV, str(path))
    assert progress.stop_requested() is None  # no record yet
    progress.step(5)
    assert progress.stop_requested() is None
    progress.request_stop(path, progress.StopNotice(12, 1234.5))
    assert progress.stop_requested() == progress.StopNotice(12, 1234.5)
    record = progress.read(path)
    assert record is not None and record.step == 5  # the worker's fields are intact
    progress.step(6)
    assert progress.stop_requested() == progress.StopNotice(12, 1234.5)
    assert progress.stopped_at(path) is None
    progress.mark_stopped(12)
    assert progress.stopped_at(path) == 12


def test_a_notice_before_any_progress_is_not_a_progress_record(tmp_path: Path) -> None:
    path = tmp_path / "rank1.progress"
    progress.request_stop(path, progress.StopNotice(3, 99.0))
    assert progress.read(path) is None  # the watchdog sees no step yet
    assert progress.stopped_at(path) is None


def test_the_newest_memory_save_is_kept_beside_the_other_fields(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The flash checkpointer marks each step it holds in memory; the agent reports it, and
    the master swaps a straggler's node once every rank saved one after it was found."""
    path = tmp_path / "rank0.progress"
    monkeypatch.setenv(progress.PATH_ENV, str(path))
    progress.step(5)
    assert progress.saved_at(path) is None  # nothing saved yet
    progress.saved(0)
    assert progress.saved_at(path) == 0  # step 0 is a step (the one before training)
    with progress.section("eval"):
        progress.request_stop(path, progress.StopNotice(12, 1234.5))
        progress.saved(10)
        assert progress.read_section(path) is not None
    assert progress.saved_at(path) == 10
    record = progress.read(path)
    assert record is not None and record.step == 5
    assert progress.stop_requested() == progress.StopNotice(12, 1234.5)
