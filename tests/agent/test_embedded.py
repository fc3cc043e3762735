"""Who embeds the job master when a torchrun-style script starts none (issue 14 item 1)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from dlrover_hpc.agent import embedded
from dlrover_hpc.errors import ConfigError

MINE = {"node1", "10.77.0.1", "127.0.0.1"}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("node1", ("node1", 29400)),
        ("node1:29500", ("node1", 29500)),
        ("10.77.0.1:29500", ("10.77.0.1", 29500)),
        ("[fe80::1]:29500", ("fe80::1", 29500)),
        ("[fe80::1]", ("fe80::1", 29400)),
        ("fe80::1", ("fe80::1", 29400)),
    ],
)
def test_split_endpoint(text: str, expected: tuple[str, int]) -> None:
    assert embedded.split_endpoint(text) == expected


@pytest.mark.parametrize("bad", ["node1:port", "node1:0", "node1:70000", ":29500"])
def test_split_endpoint_rejects(bad: str) -> None:
    with pytest.raises(ConfigError, match="expected HOST or HOST:PORT"):
        embedded.split_endpoint(bad)


@pytest.mark.parametrize(
    ("endpoint", "env", "info", "expected"),
    [
        # the tutorial's endpoint names this node's address: host it on that port
        (
            "10.77.0.1:29500",
            {"SLURM_PROCID": "2"},
            None,
            embedded.Plan(True, 29500, ("10.77.0.1", 29500)),
        ),
        # ... another node's: connect there
        (
            "10.77.0.2:29500",
            {"SLURM_PROCID": "0"},
            None,
            embedded.Plan(False, 29500, ("10.77.0.2", 29500)),
        ),
        # no endpoint: SLURM_PROCID 0 hosts and publishes master.json; the others read it
        ("", {"SLURM_PROCID": "0"}, None, embedded.Plan(True, 0, None)),
        ("", {"SLURM_PROCID": "3"}, None, embedded.Plan(False, 0, None)),
        # an embedded master.json from an earlier run of the job is replaced
        ("", {"SLURM_PROCID": "0"}, {"embedded": True}, embedded.Plan(True, 0, None)),
        # a master step (the templates) runs: no embedded master
        ("", {"SLURM_PROCID": "0"}, {"embedded": False}, None),
    ],
)
def test_plan(endpoint: str, env: dict, info: dict | None, expected: embedded.Plan | None) -> None:
    got = embedded.plan(endpoint=endpoint, my_addresses=MINE, env=env, master_info=info)
    assert got == expected


@pytest.mark.parametrize(("procid", "hosts"), [("0", True), ("1", False)])
def test_an_endpoint_on_no_job_node_falls_back_to_procid_0(procid: str, hosts: bool) -> None:
    got = embedded.plan(
        endpoint="login1:29500",
        my_addresses=MINE,
        env={"SLURM_PROCID": procid},
        master_info=None,
        endpoint_on_job_node=False,
    )
    assert got == embedded.Plan(hosts, 29500, None)  # the others read master.json


def test_which_endpoints_name_a_job_node() -> None:
    here = socket.gethostname()
    env = {"SLURM_JOB_NODELIST": here}
    assert embedded.on_job_node(f"{here}:29500", env)
    address = next(a for a in embedded.addresses_of(here) if a != here)
    assert embedded.on_job_node(f"{address}:29500", env)  # the tutorial passes an address
    assert not embedded.on_job_node("no-such-host.invalid:29500", env)
    assert embedded.on_job_node("anything:1", {})  # outside Slurm the endpoint is trusted


def test_my_addresses_include_the_hostname_and_loopback() -> None:
    mine = embedded.my_addresses()
    assert socket.gethostname() in mine and "127.0.0.1" in mine


def test_clients_skip_a_stale_master_json_and_wait_for_the_token(tmp_path: Path) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    try:
        (tmp_path / "master.json").write_text('{"host": "127.0.0.1", "port": 1, "embedded": true}')
        with pytest.raises(ConfigError, match="did not name a live master"):
            embedded.wait_master_json(tmp_path, deadline=0)
        (tmp_path / "master.json").write_text(f'{{"host": "127.0.0.1", "port": {port}}}')
        assert embedded.wait_master_json(tmp_path, deadline=0) == ("127.0.0.1", port)
        with pytest.raises(ConfigError, match="no job token"):
            embedded.wait_token(tmp_path, deadline=0)
        (tmp_path / "token").write_text("abc\n")
        assert embedded.wait_token(tmp_path, deadline=0) == "abc"
    finally:
        listener.close()
