"""One line, never a traceback (issue 46): a table of bad inputs fed to every command.

Every case is something a user types or feeds in: a wrong flag, a bad value, a bad TOML file, a
bad environment variable, a bad line of events.jsonl, a bad topology file.  Each must end with
the command's documented exit status (2 for bad input), exactly one line on stderr and no
traceback.  The cases run in-process (the entry points' ``main`` with argv), so the table takes
seconds; a few run as real processes to prove the installed entry points.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from dlrover_hpc import environ, settings
from dlrover_hpc.cli import main as hpc_main
from dlrover_hpc.cli import run as run_main
from dlrover_hpc.cli import run_args
from dlrover_hpc.cli.parser import DefaultsShown
from dlrover_hpc.settings import Command, Kind

BIN = Path(sys.executable).parent
MAINS: Mapping[str, Callable[[Sequence[str]], int]] = {
    "dlrover-hpc": hpc_main.main,
    "dlrover-run": run_main.main,
}


@dataclasses.dataclass(frozen=True)
class Case:
    program: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    files: Mapping[str, str] = dataclasses.field(default_factory=dict)  # name -> text
    code: int = 2
    says: str = ""  # a part of the error line
    prefixed: bool = True  # PROGRAM ...: error: (not a checker's FILE:LINE: report)

    def __str__(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        files = ",".join(self.files)
        return f"{env} {self.program} {' '.join(self.argv)} [{files}]".strip()


@dataclasses.dataclass(frozen=True)
class Outcome:
    code: int
    out: str
    err: str


@contextlib.contextmanager
def _isolated(work: Path, env: Mapping[str, str]) -> Iterator[None]:
    """No job, no settings, no user or site file; ``env`` on top; cwd ``work``."""
    saved, cwd = dict(os.environ), os.getcwd()
    for key in list(os.environ):
        if key.startswith(("SLURM_", settings.PREFIX)):
            del os.environ[key]
    os.environ.update(
        {
            "HOME": str(work),
            "XDG_CONFIG_HOME": str(work / "xdg"),
            settings.SITE_CONFIG.env: "",
            **env,
        }
    )
    os.chdir(work)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        yield
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(saved)
        root.handlers[:], root.level = handlers, level


def feed(case: Case, work: Path) -> Outcome:
    for name, text in case.files.items():
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text(text)
    out, err = io.StringIO(), io.StringIO()
    with (
        _isolated(work, case.env),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        try:
            code = MAINS[case.program](list(case.argv))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return Outcome(code, out.getvalue(), err.getvalue())


def check(case: Case, outcome: Outcome) -> None:
    err = outcome.err
    assert "Traceback" not in err, f"{case}\n{err}"
    assert outcome.code == case.code, f"{case}: exit {outcome.code}\n{err}"
    assert err.count("\n") == 1 and err.endswith("\n"), f"{case}: not one line\n{err}"
    assert case.says in err, f"{case}: {case.says!r} not in\n{err}"
    if not case.prefixed:
        return
    prefix = err.split(": error: ", 1)[0]
    assert prefix.startswith(case.program) and ": error: " in err, f"{case}: prefix\n{err}"


# ------------------------------------------------------------------ the table
HPC, RUN = "dlrover-hpc", "dlrover-run"
SUBCOMMANDS: list[tuple[str, ...]] = [
    ("master",),
    ("topology", "show", "t.conf"),
    ("topology", "validate", "t.conf"),
    ("topology", "order", "t.conf"),
    ("topology", "convert", "t.conf", "--to", "slurm"),
    ("drain", "node1", "--reason", "x"),
    ("status",),
    ("stacks",),
    ("report",),
    ("batch-size", "4"),
    ("stop",),
    ("launch", "--hostfile", "hosts"),
    ("config", "show"),
    ("local-slurm", "up"),
    ("local-slurm", "down"),
    ("local-slurm", "status"),
]
TOPOLOGY = "SwitchName=leaf1 Nodes=node[1-2]\nSwitchName=spine Switches=leaf1\n"


def _numeric(command: Command) -> list[settings.Setting[object]]:
    return [
        s
        for s in settings.BY_COMMAND[command]
        if s.flags and s.kind in (Kind.INT, Kind.FLOAT) and not s.choices
    ]


def _switches(command: Command) -> list[settings.Setting[object]]:
    return [
        s for s in settings.BY_COMMAND[command] if s.flags and s.kind in (Kind.SWITCH, Kind.ON_OFF)
    ]


def _program(command: Command) -> tuple[str, tuple[str, ...]]:
    return (RUN, ("train.py",)) if command is Command.RUN else (HPC, ("master",))


def _flag_cases() -> list[Case]:
    cases = [
        Case(HPC, (*sub, "--bogus-flag"), says="unrecognized arguments") for sub in SUBCOMMANDS
    ]
    cases += [
        Case(HPC, ("master", "--hartbeat-timeout=3"), says="did you mean --heartbeat-timeout?"),
        Case(HPC, ("master", "--max-restart=3"), says="see 'dlrover-hpc master --help'"),
        Case(HPC, ("status", "--jsn"), says="did you mean --json?"),
        Case(HPC, ("report", "--jobdir=x"), says="did you mean --job-dir?"),
        Case(HPC, ("topology", "order", "t.conf", "--nodez=a"), says="dlrover-hpc topology order"),
        Case(HPC, ("config", "show", "--confg=x"), says="did you mean --config?"),
        Case(HPC, ("mastr",), says="did you mean 'master'?"),
        Case(HPC, ("topology", "validat", "t.conf"), says="did you mean 'validate'?"),
        Case(HPC, ("config", "shw"), says="did you mean 'show'?"),
        Case(HPC, ("local-slurm", "upp"), says="did you mean 'up'?"),
        Case(HPC, (), says="required"),
        Case(HPC, ("topology",), says="required"),
        Case(HPC, ("config",), says="required"),
        Case(HPC, ("local-slurm",), says="required"),
        Case(RUN, ("--bogus-flag", "train.py"), says="unrecognized arguments"),
        Case(RUN, ("--nproc-per-nod=2", "train.py"), says="did you mean --nproc-per-node?"),
        Case(RUN, (), says="training_script"),
        Case(RUN, ("missing.py",), says="no such file"),
    ]
    return cases


def _value_cases() -> list[Case]:
    cases = []
    for command in (Command.MASTER, Command.RUN):
        program, tail = _program(command)
        head = () if command is Command.RUN else ("master",)
        for s in _numeric(command):
            for bad in ("abc", "1.5.2", ""):
                if bad == "1.5.2" and s.kind is Kind.FLOAT:
                    bad = "1e"
                cases.append(Case(program, (*head, f"{s.flag}={bad}", *tail[:1]), says=s.flag))
            cases.append(Case(program, (*head, *tail[:0], s.flag), says=s.flag))  # no value
        for s in settings.BY_COMMAND[command]:
            if s.flags and s.choices:
                cases.append(
                    Case(program, (*head, f"{s.flag}=bogus", *tail), says="invalid choice")
                )
    cases += [
        Case(HPC, ("master", "--heartbeat-timeout", "-1"), says="--heartbeat-timeout"),
        Case(HPC, ("master", "--heartbeat-timeout=-1"), says="--heartbeat-timeout=-1"),
        Case(HPC, ("master", "--max-restarts=-3"), says="--max-restarts=-3"),
        Case(HPC, ("master", "--crash-loop-rounds=-1"), says="--crash-loop-rounds=-1: must be 0"),
        Case(HPC, ("master", "--nnodes=4:2"), says="--nnodes=4:2"),
        Case(HPC, ("master", "--nnodes=x"), says="--nnodes"),
        Case(HPC, ("master", "--node-unit=0"), says="--node-unit"),
        Case(HPC, ("master", "--port=70000"), says="--port"),
        Case(HPC, ("master", "--hang-timeout=sometimes"), says="--hang-timeout"),
        Case(HPC, ("master", "--persist-every=soon"), says="--persist-every=soon: must be auto"),
        Case(HPC, ("master", "--node-mtbf=0"), says="--node-mtbf=0: must be a positive"),
        Case(RUN, ("--persist-every=-5", "train.py"), says="--persist-every=-5: must be auto"),
        Case(RUN, ("--node-mtbf=week", "train.py"), says="--node-mtbf=week: must be a positive"),
        Case(RUN, ("--max-restarts=-3", "train.py"), says="--max-restarts=-3"),
        Case(RUN, ("--nnodes=4:2", "train.py"), says="--nnodes=4:2"),
        Case(RUN, ("--hang-timeout=sometimes", "train.py"), says="--hang-timeout"),
        Case(RUN, ("--standalone", "--rdzv-endpoint=h:1", "train.py"), says="--standalone"),
        Case(RUN, ("--nproc-per-node=zero", "train.py"), says="--nproc-per-node"),
        # --health-check: a program that cannot run is a usage error, not a node fault
        *(
            Case(RUN, argv, env=env, files={"train.py": "", **files}, says=says)
            for argv, env, files, says in (
                (("--health-check=/no/such/nhc", "train.py"), {}, {}, "no such program"),
                (("--health-check=no-such-nhc-xyz", "train.py"), {}, {}, "no such program"),
                (("train.py",), {"DLROVER_HPC_HEALTH_CHECK": "/no/such"}, {}, "no such program"),
                (("--health-check=./nhc.sh", "train.py"), {}, {"nhc.sh": "exit 0\n"}, "chmod +x"),
                (("--health-check='/bin/true", "train.py"), {}, {}, "quote the program"),
            )
        ),
        Case(RUN, ("--health-check-timeout=0", "train.py"), says="--health-check-timeout=0"),
        Case(RUN, ("--local-ckpt-dir=scratch", "train.py"), says="expected an absolute path"),
        Case(HPC, ("status", "--watch", "0"), says="--watch"),
        Case(HPC, ("status", "--watch", "x"), says="--watch"),
        Case(HPC, ("status", "--watch", "1", "--json"), says="drop --json"),
        Case(HPC, ("status", "--job-dir", "nope"), says="does not exist"),
        Case(HPC, ("stacks", "--job-dir", "nope"), says="does not exist"),
        Case(HPC, ("batch-size", "abc"), says="invalid int value"),
        Case(HPC, ("batch-size",), says="batch_size"),
        Case(HPC, ("stop", "--kind", "bogus"), says="invalid choice"),
        Case(HPC, ("drain", "node1"), says="--reason"),
        Case(HPC, ("launch",), says="--hostfile"),
        Case(HPC, ("launch", "--hostfile", "h", "--spares", "x"), says="--spares"),
        Case(HPC, ("local-slurm", "up", "--nodes", "many"), says="--nodes"),
        Case(HPC, ("local-slurm", "up", "--cluster", "x"), says="--cluster"),
        Case(HPC, ("topology", "convert", "t.conf"), says="--to"),
        Case(HPC, ("topology", "convert", "t.conf", "--to", "xml"), says="invalid choice"),
        Case(HPC, ("topology", "show", "missing.conf"), says="missing.conf"),
        Case(HPC, ("config", "get"), says="SECTION.KEY"),
        Case(HPC, ("config", "get", "max_restarts"), says="expected SECTION.KEY"),
        Case(HPC, ("config", "get", "run.max_restart"), says="did you mean run.max_restarts?"),
        Case(HPC, ("config", "get", "run.nnodes", "--", "--nnodes=4:2", "t.py"), says="4:2"),
        Case(HPC, ("config", "show", "bogus"), says="invalid choice"),
        Case(HPC, ("config", "show", "--config", "missing.toml"), says="missing.toml"),
        Case(HPC, ("--log-level", "LOUD", "config", "show"), says="log level"),
        Case(HPC, ("config", "show", "--log-level", "LOUD"), says="log level"),
    ]
    return cases


def _env_cases() -> list[Case]:
    cases = []
    for command in (Command.MASTER, Command.RUN):
        program, tail = _program(command)
        argv = tail if command is Command.RUN else ("master",)
        for s in _numeric(command):
            cases.append(Case(program, argv, env={s.env: "lots"}, says=s.env))
        for s in _switches(command):
            cases.append(Case(program, argv, env={s.env: "maybe"}, says=f"{s.env}=maybe"))
    cases += [
        Case(HPC, ("config", "show"), env={settings.NETWORK_CHECK.env: "maybe"}, says="maybe"),
        Case(HPC, ("config", "show"), env={settings.MAX_RESTARTS.env: "-3"}, says="MAX_RESTARTS"),
        Case(HPC, ("config", "show"), env={settings.CONFIG.env: "gone.toml"}, says="gone.toml"),
        Case(HPC, ("config", "show"), env={settings.SITE_CONFIG.env: "no.toml"}, says="no.toml"),
        Case(HPC, ("config", "show"), env={environ.LOG_LEVEL: "LOUD"}, says="log level"),
    ]
    return cases


BAD_TOML = {
    "[run]\nmax_restarts = 7\nnnodes 4\n": "c.toml:3",
    '[run]\njob_dir = "/scratch\n': "c.toml:2",
    "[run]\nmax_restart = 7\n": "did you mean max_restarts?",
    "[master]\nheartbeat-timeout = 5\n": "underscores",
    "[runn]\nnnodes = 2\n": "did you mean [run]?",
    "max_restarts = 7\n[run]\n": "outside a section",
    "[run]\nmax_restarts = 'many'\n": "max_restarts",
    "[run]\nmax_restarts = 1.5\n": "max_restarts",
    "[run]\nmax_restarts = true\n": "max_restarts",
    "[run]\nnetwork_check = 'yes'\n": "true or false",
    "[run]\nmax_restarts = [1]\n": "a list",
    "[master]\ndrain = 'sometimes'\n": "invalid choice",
    "[run]\nconfig = 'x.toml'\n": "cannot name another",
    "[run]\nmax_restarts = -3\n": "--max-restarts=-3",
    '[run]\nnnodes = "4:2"\n': "--nnodes=4:2",
    '[run]\nhang_timeout = "sometimes"\n': "--hang-timeout",
    "[master]\nmax_restarts = -3\n": "--max-restarts=-3",
    '[master]\nnnodes = "4:2"\n': "--nnodes=4:2",
    '[master]\nhang_timeout = "sometimes"\n': "--hang-timeout",
    "[master]\nheartbeat_timeout = -1\n": "--heartbeat-timeout",
    "[master]\ncrash_loop_rounds = -2\n": "--crash-loop-rounds=-2",
    '[run]\npersist_every = "often"\n': "--persist-every=often",
    '[master]\nnode_mtbf = "-1d"\n': "--node-mtbf=-1d",
    "run = 3\n": "is a section",
    "[run]\nmax_restarts = 7\nmax_restarts = 8\n": "not valid TOML",
}


def _toml_cases() -> list[Case]:
    cases = []
    for text, says in BAD_TOML.items():
        files = {"c.toml": text}
        section = "master" if text.startswith("[master]") else "run"
        cases.append(Case(HPC, ("config", "show", "--config", "c.toml"), files=files, says=says))
        cases.append(
            Case(
                HPC,
                ("config", "get", "--config", "c.toml", f"{section}.nnodes"),
                files=files,
                says=says,
            )
        )
        if section == "run":
            cases.append(Case(RUN, ("--config", "c.toml", "t.py"), files=files, says=says))
        else:
            cases.append(Case(HPC, ("master", "--config", "c.toml"), files=files, says=says))
    cases.append(Case(HPC, ("config", "show"), files={"xdg/dlrover-hpc/config.toml": "[x"}))
    return cases


START = '{"time": 0, "event": "job_started"}'
END = '{"time": 99, "event": "job_finished"}'
BAD_EVENTS = {
    '{"time": "yesterday", "event": "job_started"}': "field time: expected a number",
    '{"time": 1, "event": "training_progress", "round": 1, "step": "thirty"}': "field step",
    '{"time": 1, "event": "rendezvous_complete", "round": "one", "nodes": []}': "field round",
    '{"time": 1, "event": "job_finished", "exit_code": "zero"}': "field exit_code",
    '{"time": 1, "event": "rendezvous_complete", "round": 1, "nodes": null}': "field nodes",
    '{"time": 1, "event": "rendezvous_complete", "round": 1, "nodes": [1, 2]}': "field nodes",
    '{"time": 1, "event": "rendezvous_complete", "nodes": ["a"]}': "field round: missing",
    '{"time": 1, "event": 5}': "field event: expected a string",
    '{"time": true, "event": "job_started"}': "field time",
    '{"time": null, "event": "job_started"}': "field time",
    '{"event": "job_started"}': "not an event",
    "[1, 2, 3]": "not an event",
    "{oops": "not an event",
    '{"time": 1, "event": "checkpoint_saved", "step": "x"}': "field step",
    '{"time": 1, "event": "checkpoint_saved", "step": 1, "blocking_s": "fast"}': "field blocking_s",
    '{"time": 1, "event": "checkpoint_persisted", "step": 1, "persist_s": []}': "field persist_s",
    '{"time": 1, "event": "checkpoint_restored", "step": 1, "restore_s": "x"}': "field restore_s",
    '{"time": 1, "event": "netcheck_result", "seconds": "many"}': "field seconds",
    '{"time": 1, "event": "node_lost", "node": ["a"]}': "field node",
    '{"time": 1, "event": "hang_detected", "suspected_node": 3}': "field suspected_node",
    '{"time": 1, "event": "training_progress", "round": 1, "step": 2, "at": "now"}': "field at",
    '{"time": 1, "event": "job_finished", "restart_count": "two"}': "field restart_count",
}


def _event_cases() -> list[Case]:
    cases = []
    for line, says in BAD_EVENTS.items():
        files = {"job/events.jsonl": f"{START}\n{line}\n{END}\n"}
        for where in ("job", "job/events.jsonl"):
            argv = ("report", "--job-dir", where)
            cases.append(Case(HPC, argv, files=files, says=f"events.jsonl:2: {says}"))
    cases += [
        Case(HPC, ("report", "--job-dir", "job"), files={"job/x": ""}, says="does not exist"),
        Case(HPC, ("report", "--job-dir", "nope"), says="does not exist"),
        Case(
            HPC, ("report", "--job-dir", "job"), files={"job/events.jsonl": ""}, says="job_started"
        ),
    ]
    return cases


BAD_TOPOLOGY = [
    "hello world\n",
    "SwitchName=leaf1 Nodes=node[1-\n",
    "SwitchName=leaf1 Nodes=node1\nSwitchName=leaf1 Nodes=node2\n",
    "SwitchName=spine Switches=nosuch\n",
]


def _topology_cases() -> list[Case]:
    cases = []
    for text in BAD_TOPOLOGY:
        for verb in ("show", "validate", "order"):
            # validate reports problems as a checker does: FILE:LINE: what, one a line
            prefixed = verb != "validate"
            argv = ("topology", verb, "t.conf")
            cases.append(Case(HPC, argv, files={"t.conf": text}, prefixed=prefixed))
        cases.append(Case(HPC, ("master", "--topology", "t.conf"), files={"t.conf": text}))
    return cases


CASES = _flag_cases() + _value_cases() + _env_cases() + _toml_cases() + _event_cases()
CASES += _topology_cases()


def test_the_table_is_large() -> None:
    assert len(CASES) >= 150, len(CASES)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_bad_input_is_one_line(case: Case, tmp_path: Path) -> None:
    files = {"t.conf": TOPOLOGY, "hosts": "node1\n", **case.files}
    check(case, feed(dataclasses.replace(case, files=files), tmp_path))


# ------------------------------------------------------------------ random bad values
def _not_a(kind: Kind) -> Callable[[str], bool]:
    def bad(text: str) -> bool:
        try:
            (int if kind is Kind.INT else float)(text)
        except ValueError:
            return True
        return False

    return bad


NUMERIC = [(c, s) for c in (Command.MASTER, Command.RUN) for s in _numeric(c)]
_TEXT = st.text(st.characters(min_codepoint=32, max_codepoint=0x2FF, exclude_characters="\x7f"))


@hsettings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    which=st.sampled_from(NUMERIC), data=st.data(), where=st.sampled_from(["flag", "env", "toml"])
)
def test_random_bad_numbers(
    which: tuple[Command, settings.Setting[object]],
    data: st.DataObject,
    where: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    command, s = which
    value = data.draw(_TEXT.filter(_not_a(s.kind)), label="value")
    program, tail = _program(command)
    head = () if command is Command.RUN else ("master",)
    if where == "flag":
        script = tail if command is Command.RUN else ()
        case = Case(program, (*head, f"{s.flag}={value}", *script))
    elif where == "env":
        if not value.strip():
            return  # an empty variable counts as unset
        case = Case(program, tail if command is Command.RUN else head, env={s.env: value})
    else:
        quoted = value.replace("\\", "\\\\").replace('"', '\\"')
        files = {"c.toml": f'[{command.value}]\n{s.key} = "{quoted}"\n'}
        case = Case(HPC, ("config", "show", "--config", "c.toml"), files=files)
    check(case, feed(case, tmp_path_factory.mktemp("case")))


# ------------------------------------------------------------------ --help, and real processes
def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                yield from _parsers(sub)


def test_every_flag_with_a_default_shows_it_in_help() -> None:
    parsers = [*_parsers(hpc_main.build_parser()), run_args.build_parser()]
    missing = []
    for parser in parsers:
        formatter = parser._get_formatter()
        assert isinstance(formatter, DefaultsShown), parser.prog
        for action in parser._actions:
            if not action.option_strings or action.help == argparse.SUPPRESS:
                continue
            if action.default in (None, False, "", argparse.SUPPRESS) or action.nargs == 0:
                continue
            if "default" not in formatter._expand_help(action):
                missing.append(f"{parser.prog} {action.option_strings[0]}")
    assert not missing
    help_text = (
        hpc_main.build_parser()._subparsers._group_actions[0].choices["master"].format_help()
    )  # type: ignore[union-attr]
    for flag in ("--heartbeat-timeout", "--nnodes", "--node-unit"):
        assert flag in help_text
    assert "(default: 15)" in help_text


def test_log_level_before_or_after_the_subcommand(tmp_path: Path) -> None:
    for argv in (
        ("--log-level", "DEBUG", "config", "show"),
        ("config", "show", "--log-level", "DEBUG"),
    ):
        outcome = feed(Case(HPC, argv), tmp_path)
        assert outcome.code == 0, outcome.err


def _proc(argv: Sequence[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", settings.PREFIX))}
    clean |= {"HOME": str(cwd), "XDG_CONFIG_HOME": str(cwd), settings.SITE_CONFIG.env: "", **env}
    argv = [str(BIN / argv[0]), *argv[1:]]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=cwd, env=clean)


@pytest.mark.parametrize(
    ("argv", "env", "says"),
    [
        (
            ["dlrover-hpc", "master", "--hartbeat-timeout=3"],
            {},
            "did you mean --heartbeat-timeout?",
        ),
        (
            ["dlrover-run", "train.py"],
            {settings.NETWORK_CHECK.env: "maybe"},
            "NETWORK_CHECK=maybe",
        ),
        (["dlrover-hpc", "report", "--job-dir", "events.jsonl"], {}, "events.jsonl:2: field step"),
        (["dlrover-hpc", "config", "show", "--config", "c.toml"], {}, "--max-restarts=-3"),
    ],
)
def test_real_processes(argv: list[str], env: dict[str, str], says: str, tmp_path: Path) -> None:
    (tmp_path / "events.jsonl").write_text(
        f'{START}\n{{"time": 1, "event": "training_progress", "round": 1, "step": "x"}}\n'
    )
    (tmp_path / "c.toml").write_text("[run]\nmax_restarts = -3\n")
    proc = _proc(argv, tmp_path, **env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and says in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["dlrover-hpc", "config", "show"],
        ["dlrover-run", "--help"],
        ["dlrover-hpc", "master", "--help"],
        ["dlrover-hpc", "topology", "order", "t.conf"],
    ],
)
def test_a_closed_pipe_ends_quietly(argv: list[str], tmp_path: Path) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", settings.PREFIX))}
    clean |= {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path), settings.SITE_CONFIG.env: ""}
    (tmp_path / "t.conf").write_text(TOPOLOGY)
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command writes
    try:
        proc = subprocess.run(
            [str(BIN / argv[0]), *argv[1:]],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            cwd=tmp_path,
            env=clean,
        )
    finally:
        os.close(write)
    assert proc.stderr == "", proc.stderr
    assert proc.returncode == 141
