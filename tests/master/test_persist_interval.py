"""Young/Daly's persist interval (``--persist-every auto``): the pure functions."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dlrover_hpc.errors import ConfigError
from dlrover_hpc.master.persist_interval import (
    MIN_INTERVAL_S,
    Mtbf,
    MtbfSource,
    changed,
    daly_interval,
    job_mtbf,
)
from dlrover_hpc.values import PERSIST_AUTO, parse_duration, parse_persist_every

DAY = 86400.0


@pytest.mark.parametrize(
    ("persist_s", "mtbf_s", "interval_s"),
    [
        (1.0, 50.0, math.sqrt(100) - 1),  # 9 s
        (60.0, 7 * DAY / 100, math.sqrt(2 * 60 * 6048) - 60),  # 100 nodes, a week each
        (0.05, 60.0, math.sqrt(6.0) - 0.05),  # the runtime test's: about 2.4 s
        (10.0, 20.0, 10.0),  # C = M / 2: the form's peak, M / 2
        (30.0, 20.0, 10.0),  # C > M / 2: stays M / 2 (the form would fall)
        (100.0, 20.0, 10.0),  # C >= 2 M: still M / 2
        (0.0, 100.0, MIN_INTERVAL_S),  # no persist time: the floor
        (0.001, 10.0, MIN_INTERVAL_S),  # sqrt(0.02) - 0.001 is under the floor
    ],
)
def test_daly_interval(persist_s: float, mtbf_s: float, interval_s: float) -> None:
    assert daly_interval(persist_s, mtbf_s) == pytest.approx(interval_s)


@pytest.mark.parametrize("mtbf_s", [0.0, -1.0, math.inf, math.nan])
def test_daly_interval_refuses_a_bad_mtbf(mtbf_s: float) -> None:
    with pytest.raises(ValueError, match="mtbf_s"):
        daly_interval(1.0, mtbf_s)


seconds = st.floats(min_value=0.0, max_value=1e7, allow_nan=False)
positive = st.floats(min_value=1e-3, max_value=1e8, allow_nan=False)


@given(c1=seconds, c2=seconds, m=positive)
def test_monotone_in_the_persist_time(c1: float, c2: float, m: float) -> None:
    lo, hi = sorted((c1, c2))
    assert daly_interval(lo, m) <= daly_interval(hi, m) + 1e-9 * max(1.0, m)


@given(c=seconds, m1=positive, m2=positive)
def test_monotone_in_the_mtbf(c: float, m1: float, m2: float) -> None:
    lo, hi = sorted((m1, m2))
    assert daly_interval(c, lo) <= daly_interval(c, hi) + 1e-9 * max(1.0, hi)


@given(c=seconds, m=positive)
def test_never_under_the_floor_nor_over_half_the_mtbf(c: float, m: float) -> None:
    interval = daly_interval(c, m)
    assert interval >= MIN_INTERVAL_S
    assert interval <= max(MIN_INTERVAL_S, m / 2) * (1 + 1e-12)


@pytest.mark.parametrize(
    ("failures", "node_seconds", "nodes", "site", "expected"),
    [
        (0, 0.0, 4, 7 * DAY, Mtbf(seconds=7 * DAY / 4, source=MtbfSource.SITE)),
        (0, 1e6, 4, 7 * DAY, Mtbf(seconds=7 * DAY / 4, source=MtbfSource.SITE)),
        # 2 failures in 40 node-hours of a 4-node job: 20 node-hours each, 5 h for the job
        (2, 40 * 3600.0, 4, 7 * DAY, Mtbf(seconds=5 * 3600.0, source=MtbfSource.OBSERVED)),
        (1, 3600.0, 1, 7 * DAY, Mtbf(seconds=3600.0, source=MtbfSource.OBSERVED)),
        (3, 0.0, 2, 100.0, Mtbf(seconds=50.0, source=MtbfSource.SITE)),  # no time seen yet
        (0, 0.0, 0, 100.0, Mtbf(seconds=100.0, source=MtbfSource.SITE)),  # no nodes: one
    ],
)
def test_job_mtbf(
    failures: int, node_seconds: float, nodes: int, site: float, expected: Mtbf
) -> None:
    got = job_mtbf(failures=failures, node_seconds=node_seconds, nodes=nodes, site_node_mtbf_s=site)
    assert got.source is expected.source
    assert got.seconds == pytest.approx(expected.seconds)


@pytest.mark.parametrize(
    ("old", "new", "said"),
    [(None, 5.0, True), (10.0, 10.5, False), (10.0, 11.5, True), (10.0, 8.0, True)],
)
def test_changed(old: float | None, new: float, said: bool) -> None:
    assert changed(old, new) is said


@pytest.mark.parametrize(
    ("text", "value"),
    [("auto", PERSIST_AUTO), ("AUTO", PERSIST_AUTO), ("off", 0.0), ("0", 0.0), ("", 0.0),
     ("600", 600.0), ("90s", 90.0), ("10m", 600.0), ("1.5h", 5400.0), ("2d", 2 * DAY)],
)  # fmt: skip
def test_parse_persist_every(text: str, value: float) -> None:
    assert parse_persist_every(text) == value


@pytest.mark.parametrize("text", ["soon", "-5", "10x", "inf", "nan", "m"])
def test_parse_persist_every_refuses(text: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_persist_every(text)
    assert str(err.value) == (
        f"--persist-every={text}: must be auto, off or a duration, e.g. --persist-every=auto "
        "or --persist-every=10m"
    )


@pytest.mark.parametrize("text", ["0", "-1d", "week", ""])
def test_parse_duration_refuses(text: str) -> None:
    with pytest.raises(ConfigError, match=r"--node-mtbf=.*: must be a positive duration"):
        parse_duration(text, "--node-mtbf")
