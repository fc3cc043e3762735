"""The Prometheus test helper against a real server scraping an in-process exporter.

Installs Debian's prometheus package when it is missing (root), like the local Slurm and
the SSH hosts install theirs.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness.ports import free_port
from harness.prometheus import Prometheus, PrometheusError
from prometheus_client import CollectorRegistry, Counter, start_http_server

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 and not shutil.which("prometheus"),
    reason="installing Debian's prometheus needs root",
)


@pytest.fixture
def exporter() -> Iterator[tuple[str, Counter]]:
    """A /metrics endpoint on 127.0.0.1 with its own registry and a counter at 3."""
    registry = CollectorRegistry()
    restarts = Counter("demo_restarts", "Restarts of the demo job.", registry=registry)
    for _ in range(3):
        restarts.inc()
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    yield f"127.0.0.1:{port}", restarts
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def test_scrapes_counter_and_follows_its_increments(
    exporter: tuple[str, Counter], tmp_path: Path
) -> None:
    target, restarts = exporter
    with Prometheus([target], workdir=tmp_path, scrape_interval_s=0.5) as prom:
        pid = prom.pid
        assert prom.wait_for_value("demo_restarts_total", timeout_s=30) == 3.0
        assert prom.targets_up() == {target: True}
        [sample] = prom.query("demo_restarts_total")
        assert sample["metric"]["job"] == "dlrover-hpc"
        assert sample["metric"]["instance"] == target

        restarts.inc()
        assert prom.wait_for_value("demo_restarts_total == 4", timeout_s=30) == 4.0

        with pytest.raises(PrometheusError, match="parse error"):
            prom.query("demo_restarts_total{")
    assert pid is not None and not Path(f"/proc/{pid}").exists()
    assert (tmp_path / "prometheus.log").stat().st_size > 0
