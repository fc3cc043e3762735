"""The job timeline as a PNG (``dlrover-hpc report --plot FILE``).

One horizontal lane per node, top to bottom in order of first appearance, coloured by what the
node was doing (:class:`~dlrover_hpc.report.model.LaneState`). Events on a node (a failure, a
lost node, a hang, a drain, a straggler) are markers on its lane; job-wide events sit on a lane
of their own at the top labelled "job": committed checkpoints as light ticks, requeues as strong
ones (with a faint line through every lane), a master change as a star.

The figure is laid out in inches, not by matplotlib's automatic layout, so its size depends only
on the number of lanes: about 0.28 in a lane up to 32 lanes, then lanes get thinner so that 256
nodes still fit in under 20 in. With many lanes only every k-th lane is labelled, so that the
labels never overlap. Drawing uses one collection of bars per state (``broken_barh`` for all
lanes at once) and one scatter per marker kind, so thousands of spans stay fast.

matplotlib is imported only when a plot is drawn (the CLI imports this module on every run), and
only its Agg canvas is used: no pyplot, no global figure state.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import struct
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from dlrover_hpc.errors import ReportError
from dlrover_hpc.report.model import LaneState, Marker, Report, Span

if TYPE_CHECKING:
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["STATE_COLOURS", "PlotSummary", "plot"]

# Okabe-Ito: told apart with every common colour-vision deficiency.
STATE_COLOURS: dict[LaneState, str] = {
    LaneState.TRAINING: "#009E73",  # bluish green
    LaneState.RENDEZVOUS: "#56B4E9",  # sky blue
    LaneState.CHECK: "#F0E442",  # yellow
    LaneState.RESTARTING: "#E69F00",  # orange
    LaneState.SPARE: "#D9D9D9",  # light grey
    LaneState.LOST: "#D55E00",  # vermillion
    LaneState.DRAINED: "#CC79A7",  # reddish purple
}

DPI = 110
WIDTH_IN = 13.0
_LANE_IN = 0.28  # a lane's height up to _FULL_LANES lanes
_FULL_LANES = 32
_EXTRA_LANE_IN = 0.05  # each lane beyond _FULL_LANES adds this much ...
_MAX_LANES_IN = 17.0  # ... up to this much for all node lanes together
_MANY_LANES = 40  # above this: thinner gaps, smaller markers, every k-th label
_JOB_LANE_IN = 0.32
_TOP_IN = 0.8  # title and subtitle
_RIGHT_IN = 0.3
_X_AXIS_IN = 0.55  # tick labels and the axis label below the lanes
_LEGEND_ROW_IN = 0.24
_LABEL_CHARS = 24  # longer node names are shortened in the middle (the lane order stays)
_NICE_STEPS = (1, 2, 4, 5, 8, 10, 16, 20, 25, 32, 50, 64, 100)


@dataclasses.dataclass(frozen=True, slots=True)
class _Style:
    shape: str
    face: str
    edge: str
    grow: float = 1.0  # thin shapes (a star) drawn larger to look as big as the others

    def scatter(
        self, ax: Axes, xs: Sequence[float], ys: Sequence[float], size_pt: float, edge: float
    ) -> None:
        kw: dict[str, Any] = dict(
            marker=self.shape, c=self.face, edgecolors=self.edge, linewidths=edge
        )
        ax.scatter(xs, ys, s=(size_pt * self.grow) ** 2, zorder=3, clip_on=False, **kw)


_NODE_MARKERS: dict[str, _Style] = {
    "failure": _Style("X", "#000000", "#FFFFFF"),
    "lost": _Style("v", "#D55E00", "#000000"),
    "hang": _Style("s", "#0072B2", "#FFFFFF"),
    "drained": _Style("D", "#CC79A7", "#000000"),
    "straggler": _Style("^", "#F0E442", "#000000"),
    "master": _Style("*", "#FFFFFF", "#000000", grow=1.4),
    "storage": _Style("v", "#56B4E9", "#000000"),
}
_DEFAULT_MARKER = _Style("o", "#999999", "#000000")
# Job-wide kinds drawn as ticks on the job lane: colour, line width, opacity.
_JOB_TICKS: dict[str, tuple[str, float, float]] = {
    "checkpoint": ("#0072B2", 0.8, 0.45),
    "requeue": ("#000000", 2.4, 1.0),
}


@dataclasses.dataclass(frozen=True, slots=True)
class PlotSummary:
    """What :func:`plot` drew."""

    lanes: list[str]  # node names, one lane each, top to bottom, in the order drawn
    markers: dict[str, int]  # marker kind -> how many were drawn
    width_px: int
    height_px: int


@dataclasses.dataclass(frozen=True, slots=True)
class _Layout:
    """Sizes in inches and what depends on the number of lanes."""

    lanes: int
    left: float
    lanes_h: float
    bottom: float  # below the lanes: the x axis and the legend rows
    label_every: int
    font: float
    bar: float  # a bar's share of its lane's height
    marker_pt: float

    @property
    def height(self) -> float:
        return _TOP_IN + _JOB_LANE_IN + 0.06 + self.lanes_h + self.bottom

    def rect(self, top: float, height: float) -> tuple[float, float, float, float]:
        """An axes rectangle in figure fractions, ``top`` inches below the figure's top."""
        width, bottom = WIDTH_IN - self.left - _RIGHT_IN, self.height - top - height
        return (self.left / WIDTH_IN, bottom / self.height, width / WIDTH_IN, height / self.height)


def plot(report: Report, path: str | os.PathLike[str]) -> PlotSummary:
    """Draw ``report``'s timeline to ``path`` (a PNG) and say what was drawn.

    Raises :class:`~dlrover_hpc.errors.ReportError` when ``path`` cannot be written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    lanes = _lane_order(report)
    row = {node: i for i, node in enumerate(lanes)}
    times = [report.wall_s, *(m.time for m in report.markers)]
    times += [t for s in report.spans for t in (s.start, s.end)]
    start, end = min(0.0, *times), max(times)
    scale, unit = _time_unit(end)
    kinds = collections.Counter(m.kind for m in report.markers)
    legend_rows = 1 + math.ceil(len(kinds) / 8)
    layout = _layout(lanes, legend_rows)

    fig = Figure(figsize=(WIDTH_IN, layout.height), dpi=DPI)
    FigureCanvasAgg(fig)
    job_ax = fig.add_axes(layout.rect(_TOP_IN, _JOB_LANE_IN))
    ax = fig.add_axes(layout.rect(_TOP_IN + _JOB_LANE_IN + 0.06, layout.lanes_h), sharex=job_ax)

    _dress_axes(ax, job_ax, lanes, layout, (start / scale, end / scale), unit)
    states = _draw_spans(ax, report.spans, row, scale, layout)
    _draw_markers(ax, job_ax, report.markers, row, scale, layout)
    _add_legends(fig, layout, states, kinds)
    _add_titles(fig, report, layout)
    _save(fig, path)
    width, height = _png_size(path)
    return PlotSummary(lanes=lanes, markers=dict(kinds), width_px=width, height_px=height)


def _lane_order(report: Report) -> list[str]:
    """``report.nodes`` in order, then nodes seen only in spans, then only in markers."""
    order = dict.fromkeys(n.node for n in report.nodes)
    order.update(dict.fromkeys(s.node for s in report.spans))
    order.update(dict.fromkeys(m.node for m in report.markers if m.node is not None))
    return list(order)


def _time_unit(end_s: float) -> tuple[float, str]:
    """Seconds per x unit and its name: hours past 2 h, minutes past 5 min."""
    if end_s > 2 * 3600:
        return 3600.0, "h"
    if end_s > 5 * 60:
        return 60.0, "min"
    return 1.0, "s"


def _layout(lanes: list[str], legend_rows: int) -> _Layout:
    n = max(len(lanes), 1)
    if n <= _FULL_LANES:
        lanes_h = max(n, 2) * _LANE_IN
    else:
        lanes_h = min(_FULL_LANES * _LANE_IN + (n - _FULL_LANES) * _EXTRA_LANE_IN, _MAX_LANES_IN)
    many = n > _MANY_LANES
    font = 7.0 if many else 8.5
    lane_pt = lanes_h * 72 / n
    # A label needs about 1.4 font sizes of height; label every k-th lane so that they fit.
    need = math.ceil(font * 1.4 / lane_pt) if many else 1
    every = next((k for k in _NICE_STEPS if k >= need), need)
    longest = max((len(_short(name)) for name in lanes), default=3)
    left = min(max(0.35 + longest * font * 0.62 / 72, 0.8), 2.6)
    return _Layout(
        lanes=n,
        left=left,
        lanes_h=lanes_h,
        bottom=_X_AXIS_IN + legend_rows * _LEGEND_ROW_IN + 0.15,
        label_every=every,
        font=font,
        bar=0.8 if many else 0.72,
        marker_pt=min(max(lane_pt * 0.6, 5.5), 8.0),
    )


def _short(name: str) -> str:
    if len(name) <= _LABEL_CHARS:
        return name
    half = (_LABEL_CHARS - 1) // 2
    return f"{name[:half]}…{name[-half:]}"


def _draw_spans(
    ax: Axes, spans: Iterable[Span], row: dict[str, int], scale: float, layout: _Layout
) -> set[LaneState]:
    """One collection of rectangles per state, all lanes together; returns the states drawn.

    What ``broken_barh`` does for one lane, for every lane at once: 256 nodes in 7 states are
    7 artists, not 1,800 (each costs a couple of ms to add and draw: seconds in all).
    """
    from matplotlib.collections import PolyCollection

    half = layout.bar / 2
    boxes: dict[LaneState, list[list[tuple[float, float]]]] = collections.defaultdict(list)
    for span in spans:
        if span.end > span.start:
            x0, x1, y = span.start / scale, span.end / scale, row[span.node]
            boxes[span.state].append(
                [(x0, y - half), (x0, y + half), (x1, y + half), (x1, y - half)]
            )
    for state, verts in boxes.items():
        colour = STATE_COLOURS.get(state, "#FFFFFF")
        ax.add_collection(PolyCollection(verts, facecolors=colour, linewidths=0), autolim=False)
    return set(boxes)


def _draw_markers(
    ax: Axes,
    job_ax: Axes,
    markers: Iterable[Marker],
    row: dict[str, int],
    scale: float,
    layout: _Layout,
) -> None:
    """One scatter (or one set of ticks) per kind and lane kind."""
    on_nodes: dict[str, tuple[list[float], list[int]]] = collections.defaultdict(lambda: ([], []))
    on_job: dict[str, list[float]] = collections.defaultdict(list)
    for m in markers:
        if m.node is None:
            on_job[m.kind].append(m.time / scale)
        else:
            xs, ys = on_nodes[m.kind]
            xs.append(m.time / scale)
            ys.append(row[m.node])
    edge = 0.35 if layout.lanes > _MANY_LANES else 0.6
    for kind, (xs, ys) in on_nodes.items():
        _NODE_MARKERS.get(kind, _DEFAULT_MARKER).scatter(ax, xs, ys, layout.marker_pt, edge)
    for kind, xs in on_job.items():
        if kind not in _JOB_TICKS:
            _NODE_MARKERS.get(kind, _DEFAULT_MARKER).scatter(job_ax, xs, [0.5] * len(xs), 8, 0.6)
            continue
        colour, width, alpha = _JOB_TICKS[kind]
        job_ax.vlines(xs, 0.12, 0.88, colors=colour, linewidth=width, alpha=alpha, zorder=2)
        if kind == "requeue":  # a faint line through every lane, too
            dashed: dict[str, Any] = dict(
                colors=colour, linewidth=0.8, linestyles="dashed", alpha=0.35
            )
            ax.vlines(xs, -0.5, layout.lanes - 0.5, zorder=2, **dashed)


def _dress_axes(
    ax: Axes, job_ax: Axes, lanes: list[str], layout: _Layout, span: tuple[float, float], unit: str
) -> None:
    job_ax.set_ylim(0, 1)
    job_ax.set_yticks([0.5], ["job"], fontsize=layout.font, fontweight="bold")
    job_ax.set_facecolor("#F4F4F4")
    job_ax.tick_params(axis="x", labelbottom=False, length=0)
    # Fixed limits: no autoscaling after each of the (many) collections drawn next.
    start, end = span
    ax.set_xlim(start, end + 0.01 * (end - start) if end > start else start + 1.0)
    ax.set_ylim(layout.lanes - 0.5, -0.5)  # the first node on top
    for a in (ax, job_ax):
        a.set_autoscale_on(False)
    shown = range(0, len(lanes), layout.label_every)
    ax.set_yticks(list(shown), [_short(lanes[i]) for i in shown], fontsize=layout.font)
    ax.tick_params(axis="x", labelsize=8.5)
    unit_name = {"s": "seconds", "min": "minutes", "h": "hours"}[unit]
    ax.set_xlabel(f"time since the job started ({unit_name})", fontsize=9)
    for a in (ax, job_ax):
        a.grid(axis="x", color="#000000", alpha=0.12, linewidth=0.6)
        a.set_axisbelow(True)
        for side in ("top", "right"):
            a.spines[side].set_visible(False)


def _add_legends(
    fig: Figure, layout: _Layout, states: set[LaneState], kinds: collections.Counter[str]
) -> None:
    """Below the x axis: the states drawn, then the marker kinds with their counts."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    x = layout.left / WIDTH_IN
    y = (layout.bottom - _X_AXIS_IN) / layout.height
    options: dict[str, Any] = {
        "loc": "upper left",
        "frameon": False,
        "fontsize": 8.5,
        "handlelength": 1.6,
        "columnspacing": 1.6,
        "borderaxespad": 0.0,
        "borderpad": 0.0,
    }
    patches: list[Artist] = [
        Patch(facecolor=STATE_COLOURS[s], edgecolor="#666666", linewidth=0.4, label=str(s))
        for s in LaneState
        if s in states
    ]
    if patches:
        fig.legend(handles=patches, ncols=len(patches), bbox_to_anchor=(x, y), **options)
    order = [*_NODE_MARKERS, *_JOB_TICKS]
    handles: list[Artist] = []
    for kind in sorted(kinds, key=lambda k: (order.index(k) if k in order else len(order), k)):
        label = f"{kind} ({kinds[kind]})"
        if kind in _JOB_TICKS:
            colour, width, alpha = _JOB_TICKS[kind]
            look: dict[str, Any] = dict(
                color=colour, marker="|", markersize=11, markeredgewidth=max(width, 1.2)
            )
            look["alpha"] = max(alpha, 0.7)
        else:
            style = _NODE_MARKERS.get(kind, _DEFAULT_MARKER)
            look = dict(marker=style.shape, markersize=7 * style.grow, markerfacecolor=style.face)
            look.update(markeredgecolor=style.edge, markeredgewidth=0.6)
        handles.append(Line2D([], [], linestyle="none", label=label, **look))
    if handles:
        below = y - (_LEGEND_ROW_IN * 1.1 if patches else 0.0) / layout.height
        fig.legend(
            handles=handles, ncols=min(len(handles), 8), bbox_to_anchor=(x, below), **options
        )


def _add_titles(fig: Figure, report: Report, layout: _Layout) -> None:
    x = layout.left / WIDTH_IN
    fig.text(
        x,
        1 - 0.16 / layout.height,
        f"job {report.job_id}: goodput {report.goodput:.1%}",
        fontsize=13,
        fontweight="bold",
        va="top",
    )
    parts = [
        f"wall {_duration(report.wall_s)}",
        f"{report.steps:,} steps",
        f"{report.restarts} restart" + ("" if report.restarts == 1 else "s"),
    ]
    if not report.finished:
        parts.append("not finished")
    elif report.exit_code:
        parts.append(f"exit code {report.exit_code}")
    fig.text(
        x, 1 - 0.46 / layout.height, "  ·  ".join(parts), fontsize=9.5, va="top", color="#333333"
    )


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    total = round(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes:02d} min"
    return f"{minutes} min {secs:02d} s"


def _save(fig: Figure, path: str | os.PathLike[str]) -> None:
    try:
        fig.savefig(path, format="png", dpi=DPI)
    except OSError as exc:
        reason = f"[Errno {exc.errno}] {exc.strerror}" if exc.errno else str(exc)
        raise ReportError(
            f"cannot write the plot to {os.fspath(path)}: {reason}; "
            "pick a writable path with --plot"
        ) from exc
    finally:
        fig.clear()


def _png_size(path: str | os.PathLike[str]) -> tuple[int, int]:
    """Width and height from the PNG's header (its IHDR chunk comes first)."""
    with open(path, "rb") as f:
        head = f.read(24)
    width, height = struct.unpack(">II", head[16:24])
    return int(width), int(height)
