"""``dlrover-hpc report`` in the terminal: rich tables of a :class:`~.model.Report`."""

from __future__ import annotations

from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from dlrover_hpc.report.model import Report, Stats

#: rounds shown per node in the node table (the newest ones)
RANK_HISTORY = 6


def duration(seconds: float) -> str:
    seconds = float(seconds)
    sign, seconds = ("-" if seconds < 0 else ""), abs(seconds)
    if seconds < 120:
        return f"{sign}{seconds:.1f} s"
    if seconds < 7200:
        return f"{sign}{seconds / 60:.1f} min"
    return f"{sign}{seconds / 3600:.2f} h"


def headline(r: Report) -> Text:
    state = "running" if not r.finished else f"finished, exit code {r.exit_code}"
    text = Text()
    text.append(f"job {r.job_id}", style="bold")
    text.append(f" ({state}): goodput ")
    text.append(f"{r.goodput:.1%}", style="bold green" if r.goodput >= 0.9 else "bold yellow")
    text.append(
        f" — {r.steps} steps x {r.ideal_step_s * 1000:.1f} ms median step = "
        f"{duration(r.useful_s)} useful of {duration(r.wall_s)} wall"
    )
    return text


def time_table(r: Report) -> Table:
    t = Table(title="Where the wall time went", box=box.SIMPLE_HEAD, title_justify="left")
    t.add_column("")
    t.add_column("time", justify="right")
    t.add_column("of wall", justify="right")
    rows = [("useful training", r.useful_s), *[(str(c), v) for c, v in r.lost_s.items() if v]]
    for name, seconds in rows:
        share = seconds / r.wall_s if r.wall_s else 0.0
        t.add_row(name, duration(seconds), f"{share:.1%}")
    t.add_row(Text("wall", style="bold"), duration(r.wall_s), "100.0%")
    return t


def counts_table(r: Report) -> Table:
    t = Table(title="Events", box=box.SIMPLE_HEAD, title_justify="left", show_header=False)
    t.add_column("")
    t.add_column("", justify="right")
    failures = ", ".join(f"{n} {kind}" for kind, n in sorted(r.failures.items())) or "none"
    t.add_row("rendezvous rounds", str(r.rounds))
    t.add_row("restarts charged", str(r.restarts))
    t.add_row("membership changes", str(r.membership_changes))
    t.add_row("worker failures", failures)
    t.add_row("steps trained again", str(r.redone_steps))
    return t


def checkpoint_table(r: Report) -> Table:
    t = Table(title="Checkpoints (seconds)", box=box.SIMPLE_HEAD, title_justify="left")
    for name in ("", "count", "median", "p95", "max"):
        t.add_column(name, justify="right" if name else "left")

    def row(name: str, s: Stats) -> None:
        t.add_row(name, str(s.count), f"{s.median:.3f}", f"{s.p95:.3f}", f"{s.max:.3f}")

    row("save (blocking)", r.checkpoint_save)
    row("persist", r.checkpoint_persist)
    row("restore", r.checkpoint_restore)
    sources = ", ".join(f"{n} from {src}" for src, n in sorted(r.restores.items()))
    newest = "-" if r.last_checkpoint_step is None else str(r.last_checkpoint_step)
    t.caption = f"newest committed step: {newest}" + (f"; restores: {sources}" if sources else "")
    if r.storage_stalls:
        longest = max(r.storage_stalls, key=lambda s: s.seconds)
        t.caption += (
            f"; storage stalls: {len(r.storage_stalls)}, longest {longest.seconds:.0f} s "
            f"on {longest.node} at +{longest.start:.0f} s"
            + (" (still stalled)" if any(s.ongoing for s in r.storage_stalls) else "")
        )
    t.caption_justify = "left"
    return t


def node_table(r: Report) -> Table:
    t = Table(title="Nodes", box=box.SIMPLE_HEAD, title_justify="left")
    for name in ("node", "rank by round", "failures", "lost", "admitted", "removed", "now"):
        t.add_column(name)
    for n in r.nodes:
        history = [f"r{rnd}:{rank}" for rnd, rank in sorted(n.ranks.items())]
        if len(history) > RANK_HISTORY:
            history = ["…", *history[-RANK_HISTORY:]]
        failures = ", ".join(f"{k} {kind}" for kind, k in sorted(n.failures.items()))
        t.add_row(
            n.node,
            " ".join(history) or "-",
            failures or "-",
            str(n.lost or "-"),
            str(n.admitted or "-"),
            n.removed or "-",
            str(n.state) if n.state is not None else "-",
        )
    return t


def render(r: Report) -> Group:
    loop = (
        [Text(f"crash loop: {r.repeated_failure}", style="bold red")] if r.repeated_failure else []
    )
    tables = (time_table(r), counts_table(r), checkpoint_table(r), node_table(r))
    return Group(headline(r), *loop, *tables)


def print_report(r: Report, console: Console | None = None) -> None:
    (console or Console()).print(render(r))
