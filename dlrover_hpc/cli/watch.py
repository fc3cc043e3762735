"""``dlrover-hpc status --watch``: the status table, refreshed until the job ends.

It asks the master every ``interval`` seconds, finding it again each time (a restarted or
promoted master writes a new ``master.json``).  While no master answers it says so and keeps
asking; it stops when the master reports the job finished or failed, when the job's event log
says it ended, or on Ctrl-C.  Exit code: 0 when the job finished, 1 when it failed.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from dlrover_hpc.cli import status as st
from dlrover_hpc.errors import DlroverHpcError
from dlrover_hpc.jobdir import events_path
from dlrover_hpc.master.phases import ENDED, Phase
from dlrover_hpc.protocol import messages as m


def table(s: m.StatusReply, *, at: float) -> Group:
    goodput = f"{s.goodput:.1%}" if s.goodput >= 0 else "-"
    ckpt = "-"
    if s.checkpoint_step >= 0:
        ckpt = f"step {s.checkpoint_step}, {s.checkpoint_age_s:.0f} s ago"
    head = Text.assemble(
        (f"job {s.job_id}", "bold"),
        f": {s.state}, round {s.round}, restarts {s.restart_count}/{s.max_restarts}, ",
        f"step {s.step if s.step >= 0 else '-'} ({s.step_rate:.2f}/s), goodput so far ",
        (goodput, "bold"),
        f", last checkpoint {ckpt}\n{st.nodes_line(s)}",
        f"\nstragglers: {', '.join(s.stragglers)}" if s.stragglers else "",
    )
    caption = time.strftime("updated %H:%M:%S", time.localtime(at))
    if s.summary:
        caption += (
            "; the slowest running nodes, the stragglers' and those not running (--nodes: all)"
        )
    t = Table(caption=caption, caption_justify="left")
    for name in ("node", "rank", "state", "round", "step", "procs", "agent"):
        t.add_column(
            name, justify="right" if name in ("rank", "round", "step", "procs") else "left"
        )
    for n in s.nodes:
        style = {"lost": "red", "excluded": "red", "waiting": "yellow"}.get(str(n.state), "")
        t.add_row(
            n.node,
            str(n.rank) if n.rank >= 0 else "-",
            Text(str(n.state), style=style),
            str(n.round),
            str(n.step) if n.step >= 0 else "-",
            str(n.nproc),
            n.agent_id,
            style=None,
        )
    return Group(head, t)


def _ended_in_log(job_dir: Path | None) -> int | None:
    """The exit code of a ``job_finished`` event in the job's log, if there is one."""
    if job_dir is None:
        return None
    try:
        lines = events_path(job_dir).read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if '"job_finished"' in line:
            try:
                return int(json.loads(line).get("exit_code", 0))
            except ValueError:
                return None
    return None


def watch_status(
    *,
    master: str | None,
    job_dir: str | None,
    interval_s: float = 2.0,
    console: Console | None = None,
    nodes: bool = False,
) -> int:
    console = console or Console()
    if job_dir:  # it may not exist yet: a job just submitted makes it when its master starts
        directory: Path | None = Path(job_dir)
    else:
        directory = None if master else st.find_job_dir(None)
    last: m.StatusReply | None = None
    with Live(Text("asking the job master..."), console=console, auto_refresh=False) as live:
        while True:
            problem = ""
            info: st.MasterInfo | None = None
            try:
                if directory is not None and not directory.is_dir():
                    raise DlroverHpcError(
                        f"{directory} does not exist yet: the job's master has not started "
                        "(is the job still pending? see squeue)"
                    )
                info, token = st.find_master(master, job_dir)
                last = asyncio.run(st.fetch_status(info.host, info.port, token, nodes=nodes))
            except DlroverHpcError as exc:  # no master.json yet, or a stale one
                problem = str(exc)
            except (OSError, TimeoutError) as exc:
                problem = str(st.unreachable(info, exc) if info is not None else exc)
            now = time.time()
            if last is not None and Phase(last.state) in ENDED and not problem:
                note = Text(f"the job {last.state}", "bold")
                live.update(Group(table(last, at=now), note), refresh=True)
                return 0 if last.state == Phase.FINISHED else 1
            ended = _ended_in_log(directory)
            if problem and ended is not None:
                how = "finished" if ended == 0 else "failed"
                note = Text(f"the job {how} (exit code {ended}); its master is gone", "bold")
                live.update(Group(table(last, at=now), note) if last else note, refresh=True)
                return 0 if ended == 0 else 1
            view = table(last, at=now) if last is not None else Text("")
            if problem:
                view = Group(view, Text(f"no answer from the master: {problem}", style="yellow"))
            live.update(view, refresh=True)
            time.sleep(interval_s)
