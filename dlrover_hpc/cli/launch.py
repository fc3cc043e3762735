"""``dlrover-hpc launch``'s flags and environment turned into a :class:`LaunchConfig`.

The arguments after ``--`` are checked with dlrover-run's own parser, the master-options
variable (:data:`dlrover_hpc.settings.MASTER_OPTS`, e.g. ``--heartbeat-timeout=5``) with the
``master`` subcommand's; the launcher (``dlrover_hpc.ssh``) gets the checked values.  Settings
without a flag of their own come from the environment, like every dlrover-hpc flag: each of
:data:`dlrover_hpc.settings.BY_COMMAND`'s launch settings (a blocklist shared by jobs, the
known_hosts file, the OpenSSH client config, the SSH port, seconds to reach a host (default 10),
the Python on the hosts (default: this one, same path) and the master's extra flags).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from dlrover_hpc import settings
from dlrover_hpc.cli import run_args
from dlrover_hpc.cli.commands import master_config, register_master
from dlrover_hpc.config import DrainMode, MasterConfig, NodeRange
from dlrover_hpc.errors import ConfigError, UsageError
from dlrover_hpc.settings import Command, Setting
from dlrover_hpc.ssh.hostfile import load_hostfile
from dlrover_hpc.ssh.plan import RunArgs, drop_launcher_flags

if TYPE_CHECKING:
    # asyncssh and the master's server: half a second of every dlrover-hpc command's start
    from dlrover_hpc.ssh.launcher import LaunchConfig

# Forwarded to the agents (through the helper's stdin, never on a command line).
FORWARD_PREFIXES = (settings.PREFIX, "NCCL_", "GLOO_", "TORCH_", "OMP_", "CUDA_", "PYTHONPATH")
# The launcher's own settings, or set per host by it: not forwarded.
_NOT_FORWARDED = frozenset(
    {
        settings.PREFIX + "TOKEN",
        *(s.env for s in (settings.MASTER, settings.JOB_DIR, settings.NNODES)),
        settings.NPROC_PER_NODE.env,
        *(s.env for s in settings.BY_COMMAND[Command.LAUNCH]),
    }
)


def register_launch(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch",
        help="bare metal: start the master here and one agent per host over SSH",
        description="Start the job master locally and dlrover-run on every host of the "
        "hostfile over SSH; hosts beyond the active count are hot spares.",
    )
    p.add_argument("--hostfile", required=True, help="one host per line, optional slots=N")
    p.add_argument("--spares", type=int, default=0, help="hosts kept as hot spares")
    p.add_argument("--ssh-user", default=None, help="SSH user (default: yours)")
    p.add_argument("--ssh-key", default=None, help="SSH private key file")
    # Flags for the launch settings that have one (their variables are read in launch_config).
    for setting in settings.BY_COMMAND[Command.LAUNCH]:
        if setting.flags:
            p.add_argument(
                *setting.flags,
                dest=setting.key,
                default=None,
                help=setting.help_for(Command.LAUNCH),
            )
    p.add_argument("run_args", nargs=argparse.REMAINDER, help="-- then dlrover-run's arguments")
    p.set_defaults(func=run_launch)


def forwarded_env(env: Mapping[str, str]) -> dict[str, str]:
    return {
        k: v for k, v in env.items() if k.startswith(FORWARD_PREFIXES) and k not in _NOT_FORWARDED
    }


class _OptsParser(argparse.ArgumentParser):
    """Parse errors become ConfigError (exit 2) naming the variable."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(
            f"{settings.MASTER_OPTS.env}: {message}; it takes the flags of "
            "'dlrover-hpc master' (see its --help)"
        )


def master_from_opts(opts: str) -> MasterConfig:
    """The master-options variable through the ``master`` subcommand's own parser."""
    parser = _OptsParser(prog=settings.MASTER_OPTS.env, allow_abbrev=False)
    register_master(parser.add_subparsers(dest="command"))
    try:
        words = shlex.split(opts)
    except ValueError as exc:
        raise ConfigError(f"{settings.MASTER_OPTS.env}={opts}: {exc}") from None
    args = parser.parse_args(["master", *words])
    config = master_config(args)
    if not any(w == "--drain" or w.startswith("--drain=") for w in words):
        # Bare metal has no scontrol: a faulty host is quarantined, then blocklisted.
        config = dataclasses.replace(config, drain=DrainMode.QUARANTINE)
    return config


RUN_EXAMPLE = "-- --nnodes=2:2 --nproc-per-node=2 train.py --steps 100"


def _raise_usage(message: str) -> NoReturn:
    raise UsageError(f"dlrover-run arguments: {message}")


def parse_run_args(tokens: Sequence[str]) -> RunArgs:
    """Check the arguments with dlrover-run's own parser; raises UsageError (exit 2)."""
    tokens = list(tokens)
    if tokens[:1] == ["--"]:
        tokens = tokens[1:]
    if not tokens:
        raise UsageError(f"launch needs dlrover-run's arguments after '--', e.g. {RUN_EXAMPLE}")
    parser = run_args.build_parser()
    parser.error = _raise_usage  # type: ignore[method-assign]
    args = parser.parse_args(tokens)
    split = len(tokens) - len(args.training_script_args) - 1
    if split < 0 or tokens[split] != args.training_script:
        raise UsageError(f"cannot find the training script in {' '.join(tokens)}")
    given = {t.split("=", 1)[0] for t in tokens[:split] if t.startswith("-")}
    if "--standalone" in given:
        raise UsageError("launch runs the job master itself; drop --standalone")
    if "--master" in given:
        raise UsageError("launch runs the job master itself; drop --master")
    checked = argparse.Namespace(**vars(args))
    if str(args.nproc_per_node) in ("auto", "cpu", "gpu"):
        checked.nproc_per_node = "1"  # resolved on each host, not here
    try:
        run_args.config_from_args(checked)
    except ConfigError as exc:
        raise UsageError(f"dlrover-run arguments: {exc}") from None
    return RunArgs(
        options=drop_launcher_flags(tokens[:split]),
        script=tuple(tokens[split:]),
        nnodes=NodeRange.parse(args.nnodes) if "--nnodes" in given else None,
        nproc_per_node=str(args.nproc_per_node),
        max_restarts=int(args.max_restarts),
        node_unit=int(args.node_unit),
        job_dir=args.job_dir,
        segment=int(args.segment),
    )


def _setting(
    args: argparse.Namespace, setting: Setting[str | None], env: Mapping[str, str]
) -> str | None:
    value = getattr(args, setting.key, None)
    return value if value else env.get(setting.env) or setting.default


def _check_files(key: str | None, known_hosts: str | None, ssh_config: str | None) -> None:
    """Bad SSH files are the user's to fix once, not an error per host."""
    for flag, path in (
        (settings.KNOWN_HOSTS.env, known_hosts),
        (settings.SSH_CONFIG.env, ssh_config),
    ):
        if path and not Path(path).is_file():
            raise ConfigError(f"{flag}={path}: no such file")
    if not key:
        return
    import asyncssh

    try:
        asyncssh.read_private_key(key)
    except OSError as exc:
        raise ConfigError(f"--ssh-key={key}: cannot read it ({exc.strerror or exc})") from None
    except ValueError as exc:  # KeyImportError, KeyEncryptionError
        if "passphrase" in str(exc).lower():
            raise ConfigError(
                f"--ssh-key={key} is protected by a passphrase; add it to ssh-agent (ssh-add) "
                "and drop --ssh-key"
            ) from None
        raise ConfigError(f"--ssh-key={key}: not a private key ({exc})") from None


def launch_config(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> LaunchConfig:
    from dlrover_hpc.ssh.launcher import LaunchConfig
    from dlrover_hpc.ssh.session import SshOptions

    env = os.environ if env is None else env
    run = parse_run_args(args.run_args)
    hosts = load_hostfile(args.hostfile)
    job_id = f"launch-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    job_dir = Path(run.job_dir or Path.cwd() / ".dlrover-hpc" / job_id).absolute()
    timeout, ssh_port = settings.CONNECT_TIMEOUT, settings.SSH_PORT
    try:
        timeout_s = float(env.get(timeout.env, timeout.text or ""))
        port = int(env[ssh_port.env]) if env.get(ssh_port.env) else ssh_port.default
    except ValueError as exc:
        raise ConfigError(f"{timeout.env} / {ssh_port.env}: {exc}") from None
    shared = _setting(args, settings.BLOCKLIST, env)
    known_hosts = _setting(args, settings.KNOWN_HOSTS, env)
    ssh_config = _setting(args, settings.SSH_CONFIG, env)
    _check_files(args.ssh_key, known_hosts, ssh_config)
    return LaunchConfig(
        hostfile=str(args.hostfile),
        hosts=tuple(hosts),
        run=run,
        spares=args.spares,
        job_dir=job_dir,
        job_id=job_id,
        master=master_from_opts(env.get(settings.MASTER_OPTS.env, settings.MASTER_OPTS.default)),
        shared_blocklist=Path(shared).absolute() if shared else None,
        ssh=SshOptions(
            user=args.ssh_user,
            key=args.ssh_key,
            known_hosts=known_hosts,
            config=ssh_config,
            port=port,
            connect_timeout_s=timeout_s,
        ),
        remote_python=env.get(settings.REMOTE_PYTHON.env) or sys.executable,
        cwd=os.getcwd(),
        env=forwarded_env(env),
    )


def run_launch(args: argparse.Namespace) -> int:
    if args.spares < 0:
        raise ConfigError(f"--spares={args.spares}: must be 0 or more")
    config = launch_config(args)
    # asyncssh logs every channel at INFO; its warnings are enough next to ours.
    logging.getLogger("asyncssh").setLevel(max(logging.WARNING, logging.getLogger().level))
    from dlrover_hpc.ssh.launcher import Launcher

    return asyncio.run(Launcher(config).run())
