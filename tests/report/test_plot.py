"""The timeline PNG: lanes, markers, size bounds and errors, on hand-made reports."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from dlrover_hpc.errors import ReportError
from dlrover_hpc.report.model import (
    Cause,
    LaneState,
    Marker,
    NodeSummary,
    Report,
    Span,
    Stats,
)
from dlrover_hpc.report.plot import STATE_COLOURS, PlotSummary, plot

pytestmark = pytest.mark.timeout(60)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def make_report(
    nodes: list[str], spans: list[Span], markers: list[Marker], wall_s: float = 600.0
) -> Report:
    """A report with these nodes, spans and markers; the other fields plausible filler."""
    summaries = [
        NodeSummary(node=n, ranks={0: i}, failures={}, lost=0, removed="", admitted=0, state=None)
        for i, n in enumerate(nodes)
    ]
    steps = int(wall_s)
    return Report(
        job_id="4242",
        finished=True,
        exit_code=0,
        wall_s=wall_s,
        goodput=0.873,
        steps=steps,
        redone_steps=12,
        ideal_step_s=0.8,
        training_s=wall_s * 0.9,
        lost_s={Cause.START_UP: 20.0, Cause.RESTARTS: 15.0},
        rounds=2,
        restarts=1,
        membership_changes=1,
        failures={"crash": 1},
        checkpoint_save=Stats.of([0.2, 0.3]),
        checkpoint_persist=Stats.of([1.5, 2.0]),
        checkpoint_restore=Stats.of([3.0]),
        restores={"memory": 3},
        last_checkpoint_step=steps - 10,
        nodes=summaries,
        spans=spans,
        markers=markers,
    )


def four_node_report() -> Report:
    s = LaneState
    spans = [
        Span("n0", 0, 20, s.RENDEZVOUS),
        Span("n0", 20, 35, s.CHECK),
        Span("n0", 35, 200, s.TRAINING),
        Span("n0", 200, 230, s.RESTARTING),
        Span("n0", 230, 600, s.TRAINING),
        Span("n1", 0, 20, s.RENDEZVOUS),
        Span("n1", 20, 35, s.CHECK),
        Span("n1", 35, 200, s.TRAINING),
        Span("n1", 200, 600, s.LOST),
        Span("n2", 0, 20, s.RENDEZVOUS),
        Span("n2", 20, 35, s.CHECK),
        Span("n2", 35, 200, s.TRAINING),
        Span("n2", 200, 230, s.RESTARTING),
        Span("n2", 230, 450, s.TRAINING),
        Span("n2", 450, 600, s.DRAINED),
        Span("n3", 5, 200, s.SPARE),
        Span("n3", 200, 230, s.RESTARTING),
        Span("n3", 230, 600, s.TRAINING),
    ]
    markers = [
        Marker(198, "n1", "failure", "crash"),
        Marker(200, "n1", "lost", "heartbeat lost"),
        Marker(450, "n2", "drained", "quarantined"),
        Marker(320, "n3", "straggler", "2.4x median"),
        *(Marker(t, None, "checkpoint", f"step {t}") for t in range(100, 600, 100)),
    ]
    return make_report(["n0", "n1", "n2", "n3"], spans, markers)


def many_node_report(count: int, checkpoints: int = 200, wall_s: float = 4 * 3600) -> Report:
    rng = random.Random(count)
    nodes = [f"node-{i:04d}" for i in range(count)]
    spans: list[Span] = []
    markers: list[Marker] = []
    failed = set(rng.sample(nodes, max(count // 32, 1)))
    fail_at = wall_s * 0.4
    for node in nodes:
        spans += [
            Span(node, 0, 60, LaneState.RENDEZVOUS),
            Span(node, 60, 90, LaneState.CHECK),
        ]
        if node in failed:
            spans.append(Span(node, 90, fail_at, LaneState.TRAINING))
            spans.append(Span(node, fail_at, wall_s, LaneState.LOST))
            markers.append(Marker(fail_at - 5, node, "failure", "crash"))
            markers.append(Marker(fail_at, node, "lost", "lost"))
        else:
            spans.append(Span(node, 90, fail_at, LaneState.TRAINING))
            spans.append(Span(node, fail_at, fail_at + 120, LaneState.RESTARTING))
            spans.append(Span(node, fail_at + 120, wall_s, LaneState.TRAINING))
    step = wall_s / (checkpoints + 1)
    markers += [Marker(step * (i + 1), None, "checkpoint", "") for i in range(checkpoints)]
    markers.append(Marker(fail_at + 10, None, "requeue", "requeued"))
    return make_report(nodes, spans, markers, wall_s=wall_s)


def counts(report: Report) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in report.markers:
        out[m.kind] = out.get(m.kind, 0) + 1
    return out


def check_png(path: Path, summary: PlotSummary) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE

    pixels = imread(path)
    assert pixels.shape[:2] == (summary.height_px, summary.width_px)


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> tuple[Report, PlotSummary, Path]:
    report = many_node_report(256)
    path = tmp_path_factory.mktemp("plot") / "256.png"
    return report, plot(report, path), path


def test_four_nodes_draws_every_lane_and_marker(tmp_path: Path) -> None:
    report = four_node_report()
    path = tmp_path / "four.png"
    summary = plot(report, path)
    check_png(path, summary)
    assert summary.lanes == ["n0", "n1", "n2", "n3"]
    want = {"failure": 1, "lost": 1, "drained": 1, "straggler": 1, "checkpoint": 5}
    assert summary.markers == want


def test_four_nodes_image_is_not_blank(tmp_path: Path) -> None:

    path = tmp_path / "four.png"
    plot(four_node_report(), path)
    rgb = (imread(path)[:, :, :3] * 255).round().astype(int)
    packed = rgb[:, :, 0] << 16 | rgb[:, :, 1] << 8 | rgb[:, :, 2]
    assert len(np.unique(packed)) > 20  # bars, markers, text, anti-aliasing
    for state in (LaneState.TRAINING, LaneState.LOST, LaneState.CHECK):
        hex_colour = STATE_COLOURS[state].lstrip("#")
        want = tuple(int(hex_colour[i : i + 2], 16) for i in (0, 2, 4))
        hits = (abs(rgb - want).max(axis=2) <= 2).sum()
        assert hits > 500, f"{state} colour {STATE_COLOURS[state]} barely drawn ({hits} px)"


def test_256_nodes(many: tuple[Report, PlotSummary, Path]) -> None:
    report, summary, path = many
    check_png(path, summary)
    assert summary.lanes == [n.node for n in report.nodes]
    assert summary.markers == counts(report)
    assert summary.markers["checkpoint"] == 200


def test_height_grows_with_nodes_and_is_bounded(
    tmp_path: Path, many: tuple[Report, PlotSummary, Path]
) -> None:
    heights = [plot(many_node_report(n, 20), tmp_path / f"{n}.png").height_px for n in (4, 32)]
    heights.append(many[1].height_px)
    heights.append(plot(many_node_report(512, 20), tmp_path / "512.png").height_px)
    assert heights[0] < heights[1] < heights[2]
    assert heights[3] == heights[2]  # capped: more lanes just get thinner
    assert heights[3] <= 21 * 110
    assert 12 * 100 <= many[1].width_px <= 14 * 120


def test_nodes_only_in_spans_or_markers_get_lanes_after_the_known_ones(tmp_path: Path) -> None:
    report = make_report(
        ["a", "b"],
        [Span("b", 0, 10, LaneState.TRAINING), Span("z", 0, 10, LaneState.SPARE)],
        [Marker(5, "y", "hang", "hang"), Marker(6, "a", "weird", "?")],
        wall_s=10.0,
    )
    summary = plot(report, tmp_path / "extra.png")
    assert summary.lanes == ["a", "b", "z", "y"]
    assert summary.markers == {"hang": 1, "weird": 1}


def test_empty_report_still_draws(tmp_path: Path) -> None:
    summary = plot(make_report([], [], [], wall_s=0.0), tmp_path / "empty.png")
    assert summary.lanes == []
    assert summary.markers == {}
    check_png(tmp_path / "empty.png", summary)


@pytest.mark.parametrize("where", ["missing-dir/plot.png", "."])
def test_unwritable_path_names_the_path_and_the_error(tmp_path: Path, where: str) -> None:
    path = tmp_path / where
    with pytest.raises(ReportError) as err:
        plot(four_node_report(), path)
    message = str(err.value)
    assert message.startswith(f"cannot write the plot to {path}: [Errno ")
    assert "--plot" in message
