"""A real Prometheus server for tests: it scrapes ``host:port`` targets at ``/metrics``.

For tests that check that a metrics endpoint (the job master's) is scraped and queryable.
Debian's ``prometheus`` package is installed when the binary is missing (needs root; without
its recommended node exporter and without starting its service).  The server listens on a
free port of 127.0.0.1 and keeps its configuration, data and log in the caller's directory::

    with Prometheus(["127.0.0.1:9100"], workdir=tmp) as prom:
        prom.wait_for_value("demo_restarts_total")  # 3.0
        prom.targets_up()  # {"127.0.0.1:9100": True}

The first sample of a new target comes about 5 s after the server is ready, whatever the
scrape interval: Prometheus hands discovered targets to its scrape loops at most every 5 s.
Later samples follow every scrape interval.

The targets are taken as given: one in a network namespace (``10.77.0.x``) works as long as
its address is routable from the root namespace, where the server runs.  HTTP goes through
urllib with proxies disabled, so an ``http_proxy`` in the environment never intercepts it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from dlrover_hpc.errors import DlroverHpcError
from dlrover_hpc.localslurm.commands import apt_install
from dlrover_hpc.localslurm.wait import wait_for
from harness.ports import free_port

log = logging.getLogger(__name__)

PACKAGE = "prometheus"
# Plain urllib, but never through a proxy named in the environment.
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class PrometheusError(DlroverHpcError):
    """The Prometheus server could not be installed, started or queried."""


def _prometheus_pids() -> set[int]:
    found = set()
    for proc in psutil.process_iter(["name"]):
        if proc.info["name"] == "prometheus":
            found.add(proc.pid)
    return found


def ensure_installed(*, timeout_s: float = 600.0) -> str:
    """Path of the ``prometheus`` binary; install Debian's package first when it is missing.

    The package's maintainer scripts may not start its service (``apt_install``); a server
    they start anyway is stopped again, with a warning.
    """
    found = shutil.which("prometheus")
    if found:
        return found
    if os.geteuid() != 0:
        raise PrometheusError("prometheus is not installed; install Debian's prometheus as root")
    before = _prometheus_pids()
    if apt_install(
        [PACKAGE],
        present=("prometheus",),
        error=PrometheusError,
        recommends=False,
        timeout_s=timeout_s,
    ):
        log.info("installed Debian's %s package", PACKAGE)
    _stop_strays(_prometheus_pids() - before)
    found = shutil.which("prometheus")
    if not found:
        raise PrometheusError(f"{PACKAGE} installed, but no prometheus binary on PATH")
    return found


def _stop_strays(pids: set[int]) -> None:
    """Stop servers that the package's maintainer scripts started despite policy-rc.d."""
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))
    if not procs:
        return
    log.warning("installing %s started a server; stopping it: %s", PACKAGE, sorted(pids))
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=10)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=10)


def _duration(seconds: float) -> str:
    """A Prometheus duration: whole milliseconds (it accepts no fractions)."""
    return f"{max(1, round(seconds * 1000))}ms"


class Prometheus:
    """A Prometheus server scraping ``targets``; a context manager that starts and stops it."""

    def __init__(
        self,
        targets: Sequence[str],
        *,
        workdir: Path,
        scrape_interval_s: float = 1.0,
        job: str = "dlrover-hpc",
    ) -> None:
        if not targets:
            raise PrometheusError("Prometheus needs at least one target")
        if isinstance(targets, str):
            raise PrometheusError(f"targets={targets!r}: expected a sequence of host:port")
        if scrape_interval_s <= 0:
            raise PrometheusError(f"scrape_interval_s={scrape_interval_s}: expected > 0")
        self.targets = list(targets)
        self.workdir = workdir
        self.scrape_interval_s = scrape_interval_s
        self.job = job
        self.config_path = workdir / "prometheus.yml"
        self.log_path = workdir / "prometheus.log"
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Prometheus:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """The server's base URL (``http://127.0.0.1:PORT``); set by :meth:`start`."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    # ------------------------------------------------------------- up, down
    def start(self, timeout_s: float = 30.0) -> None:
        """Write the configuration, start the server, wait until it says it is ready."""
        if self._proc is not None:
            raise PrometheusError(f"already running (pid {self._proc.pid})")
        binary = ensure_installed()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(self._config())
        self.port = free_port()
        argv = [
            binary,
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ]
        with open(self.log_path, "ab") as logf:
            self._proc = subprocess.Popen(
                argv,
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        try:
            wait_for(self._ready, timeout_s=timeout_s, what=f"{self.url}/-/ready")
        except TimeoutError as exc:
            self.stop()
            raise PrometheusError(f"{exc}; server log:\n{self.log_tail()}") from None
        except BaseException:
            self.stop()
            raise

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the server, SIGKILL it after ``grace_s``, and reap it."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _config(self) -> str:
        interval = _duration(self.scrape_interval_s)
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "scrape_configs": [
                {
                    "job_name": self.job,
                    "scrape_interval": interval,
                    "scrape_timeout": interval,
                    "metrics_path": "/metrics",
                    "static_configs": [{"targets": self.targets}],
                }
            ],
        }
        # JSON is YAML: no quoting rules of our own to get wrong.
        return "# written by harness.prometheus\n" + json.dumps(config, indent=2)

    def _ready(self) -> bool:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            code = proc.returncode if proc else None
            raise PrometheusError(f"prometheus exited ({code}); server log:\n{self.log_tail()}")
        try:
            with _HTTP.open(f"{self.url}/-/ready", timeout=2) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    # --------------------------------------------------------------- the API
    def _get(self, path: str, params: dict[str, str] | None = None) -> Any:
        """``data`` of an HTTP API answer; :class:`PrometheusError` with its error text."""
        if self._proc is None:
            raise PrometheusError("the Prometheus server is not running")
        url = f"{self.url}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with _HTTP.open(url, timeout=10) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as exc:  # 400/422/503 carry a JSON error
            text = exc.read().decode(errors="replace")
            with contextlib.suppress(ValueError):
                err = json.loads(text)
                text = f"{err.get('errorType', '')}: {err.get('error', text)}"
            raise PrometheusError(f"GET {url}: HTTP {exc.code}: {text}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise PrometheusError(f"GET {url}: {exc}") from None
        if body.get("status") != "success":
            raise PrometheusError(f"GET {url}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        """``data.result`` of an instant query; a scalar or string comes as one element
        ``{"metric": {}, "value": [time, "text"]}``."""
        data = self._get("/api/v1/query", {"query": promql})
        result = data["result"]
        if data.get("resultType") in ("scalar", "string"):
            return [{"metric": {}, "value": result}]
        return list(result)

    def wait_for_value(self, promql: str, *, timeout_s: float = 60) -> float:
        """Poll ``promql`` until it returns a sample; that sample's value.

        Filter in PromQL to wait for a given value: ``wait_for_value("x_total == 4")``.
        """
        try:
            samples = wait_for(
                lambda: self.query(promql),
                timeout_s=timeout_s,
                what=f"a sample of {promql!r} from {self.url}",
                interval_s=min(0.25, self.scrape_interval_s / 2),
            )
        except TimeoutError as exc:
            raise PrometheusError(f"{exc}; targets up: {self._targets_or_error()}") from None
        sample = samples[0]
        value = sample["value"] if "value" in sample else sample["values"][-1]
        return float(value[1])

    def targets_up(self) -> dict[str, bool]:
        """``{instance: up}`` for every active target (``instance`` is ``host:port``)."""
        data = self._get("/api/v1/targets", {"state": "active"})
        return {
            t["labels"].get("instance", t.get("scrapeUrl", "?")): t.get("health") == "up"
            for t in data["activeTargets"]
        }

    def _targets_or_error(self) -> str:
        try:
            return str(self.targets_up())
        except PrometheusError as exc:
            return str(exc)
