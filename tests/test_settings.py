"""Each setting is declared once (dlrover_hpc.settings, issue 47): both parsers' flags, the TOML
keys, every environment variable read and the config dataclasses' defaults come from the
declarations, and nothing is declared that no command takes."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from dlrover_hpc import config, injections, settings
from dlrover_hpc.cli import launch, run_args, site_config
from dlrover_hpc.cli.commands import master_parser
from dlrover_hpc.config import MasterConfig, RequeueBy, RunConfig, embedded_master_config
from dlrover_hpc.master.assembly import build_master
from dlrover_hpc.master.cluster import SlurmCluster
from dlrover_hpc.settings import Command, Setting

PARSERS = {Command.RUN: run_args.build_parser, Command.MASTER: master_parser}


class Recording(Mapping[str, str]):
    """An empty environment that remembers every name read from it."""

    def __init__(self) -> None:
        self.read: set[str] = set()

    def __getitem__(self, name: str) -> str:
        self.read.add(name)
        raise KeyError(name)

    def get(self, name: str, default: Any = None) -> Any:
        self.read.add(name)
        return default

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


def _parser(command: Command, env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    return PARSERS[command](
        site_config.Defaults(command.value, env=Recording() if env is None else env)
    )


@pytest.mark.parametrize("command", list(PARSERS))
def test_every_option_string_is_one_declaration(command: Command) -> None:
    declared = settings.BY_COMMAND[command]
    owners: dict[str, list[str]] = {}
    for setting in declared:
        for flag in setting.option_strings(command):
            owners.setdefault(flag, []).append(setting.key)
    parser = _parser(command)
    used: set[str] = set()
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "version"):
            continue
        for flag in action.option_strings:
            assert owners.get(flag) == [action.dest], f"{command.value} {flag}: {owners.get(flag)}"
        used.add(action.dest)
    assert used == {s.key for s in declared if s.flags}, "declared for the parser but not in it"


@pytest.mark.parametrize("command", list(PARSERS))
def test_toml_keys_are_the_declared_ones(command: Command) -> None:
    keys = set(site_config.settings_of(_parser(command)))
    assert keys == {s.key for s in settings.BY_COMMAND[command] if s.flags and s.in_file}


@pytest.mark.parametrize("command", list(PARSERS))
def test_parser_defaults_are_the_declared_ones(command: Command) -> None:
    parser = _parser(command)
    for setting in settings.BY_COMMAND[command]:
        if setting.flags and setting.in_file:
            assert parser.get_default(setting.key) == setting.text, setting.key


def _launch_reads(tmp_path: Path) -> set[str]:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1\n")
    args = argparse.Namespace(
        run_args=["--", "--nnodes=1:1", "train.py"],
        hostfile=str(hostfile),
        spares=0,
        ssh_user=None,
        ssh_key=None,
        blocklist=None,
        known_hosts=None,
        ssh_config=None,
    )
    env = Recording()
    launch.launch_config(args, env)
    return env.read


def test_every_variable_read_is_one_declaration(tmp_path: Path) -> None:
    """Each name the readers consult belongs to exactly one declaration, and each declaration's
    variable is consulted by some reader."""
    env = Recording()
    for command in PARSERS:
        _parser(command, env)
    site_config.places(None, env)
    for setting in (settings.MASTER, settings.JOB_DIR):  # status, stacks, report, control
        config.env_default(setting, env)
    for injection in injections.ALL:
        injections.enabled(injection, env)
    read = {name for name in env.read | _launch_reads(tmp_path) if name.startswith(settings.PREFIX)}
    by_env: dict[str, list[str]] = {}
    for setting in settings.ALL:
        by_env.setdefault(setting.env, []).append(setting.key)
    assert {name: keys for name, keys in by_env.items() if len(keys) > 1} == {}
    assert read - set(by_env) == set(), "read but not declared"
    assert set(by_env) - read == set(), "declared but never read"


def test_every_declaration_is_taken_by_a_command() -> None:
    for setting in settings.ALL:
        assert settings.commands_of(setting), setting.key
        if setting.flags:
            assert setting.flags[-1].startswith("--"), setting.key


def _declared_fields(command: Command) -> Iterator[tuple[str, Setting[Any]]]:
    for setting in settings.BY_COMMAND[command]:
        if setting.config_field is not None and setting is not settings.JOB_DIR:
            yield setting.config_field, setting  # a job dir of None is found when parsed


@pytest.mark.parametrize(
    ("command", "cls"), [(Command.RUN, RunConfig), (Command.MASTER, MasterConfig)]
)
def test_config_defaults_are_the_declared_ones(command: Command, cls: type) -> None:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    checked = 0
    for name, setting in _declared_fields(command):
        assert name in fields, f"{setting.key} sets {cls.__name__}.{name}, which is no field"
        if fields[name].default is not dataclasses.MISSING:
            assert fields[name].default == setting.default, name
            checked += 1
    assert checked


def _agent(*flags: str) -> RunConfig:
    return run_args.config_from_args(run_args.build_parser().parse_args([*flags, "train.py"]))


def test_embedded_master_takes_every_shared_setting() -> None:
    """The double requeue: an embedded master without the agents' --requeue-by continued the
    job under Slurm while the framework requeued it too."""
    run = _agent(
        "--requeue-by=framework", "--nnodes=2:4", "--node-unit=2", "--max-restarts=7",
        "--link-timeout=2.5",
    )  # fmt: skip
    master = embedded_master_config(run, host="0.0.0.0", port=0, job_dir="/j", job_id="7")
    assert master.requeue_by is RequeueBy.FRAMEWORK
    assert (master.nnodes.min, master.nnodes.max, master.node_unit) == (2, 4, 2)
    assert (master.max_restarts, master.link_timeout_s) == (7, 2.5)
    default = embedded_master_config(
        _agent("--nnodes=2"), host="0.0.0.0", port=0, job_dir="/j", job_id="7"
    )
    assert default.requeue_by is RequeueBy.DLROVER_HPC


def _continuer_armed(tmp_path: Path, *flags: str) -> bool:
    """Assemble the embedded master of ``dlrover-run FLAGS`` in Slurm job 7, as the agent
    does, and say whether it would continue the job at the time limit."""
    job_dir = tmp_path / "-".join(flags or ("default",))
    job_dir.mkdir(mode=0o700)
    config = embedded_master_config(
        _agent("--nnodes=2", *flags), host="127.0.0.1", port=0, job_dir=str(job_dir), job_id="7"
    )
    master = build_master(config, SlurmCluster(job_id="7"), job_dir=job_dir)
    try:
        master.listening(port=29400)
        return master.stopper.continuer is not None
    finally:
        master.stop_metrics()


def test_requeue_by_framework_with_an_embedded_master_under_slurm_arms_no_continuation(
    tmp_path: Path,
) -> None:
    assert not _continuer_armed(tmp_path, "--requeue-by=framework")
    assert _continuer_armed(tmp_path)  # the default: the master continues the job


def test_agent_makes_its_masters_through_one_function() -> None:
    source = (Path(config.__file__).parent / "agent" / "launch.py").read_text()
    assert "MasterConfig(" not in source
    assert source.count("embedded_master_config(") == 2


SPELLED_ONCE = (
    "config.py", "cli/run_args.py", "cli/commands.py", "cli/site_config.py", "cli/parser.py",
    "cli/config_command.py", "cli/launch.py", "injections.py",
)  # fmt: skip


@pytest.mark.parametrize("module", SPELLED_ONCE)
def test_prefix_is_spelled_only_in_settings(module: str) -> None:
    assert settings.PREFIX not in (Path(config.__file__).parent / module).read_text()
