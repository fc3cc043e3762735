"""Stacks parsed from captured py-spy and faulthandler output, merged, and the suspect found."""

from __future__ import annotations

import json
from pathlib import Path

from dlrover_hpc.diagnosis import stacks as st

DATA = Path(__file__).resolve().parent.parent / "data" / "stacks"


def _py_spy() -> st.Stack:
    return st.from_py_spy(json.loads((DATA / "py_spy_two_threads.json").read_text()))


def test_py_spy_json_is_parsed_with_the_main_thread_marked() -> None:
    stack = _py_spy()
    assert [t.name for t in stack.threads] == ["loader", "MainThread"]
    assert [f.function for f in stack.signature()] == ["all_reduce_wait", "train_step", "<module>"]
    assert stack.signature()[0] == st.Frame("all_reduce_wait", "/tmp/stack_demo.py", 8)
    assert st.where(stack) == "all_reduce_wait <- train_step <- <module>"
    assert 'Thread "MainThread" (main):\n    all_reduce_wait (stack_demo.py:8)' in stack.text()


def test_faulthandler_text_gives_the_same_main_stack() -> None:
    stack = st.from_faulthandler((DATA / "faulthandler_two_threads.txt").read_text())
    assert len(stack.threads) == 2 and stack.threads[1].main
    assert stack.signature() == _py_spy().signature()
    assert st.from_json(st.to_json(stack)) == stack
    assert st.from_faulthandler("no dump here").threads == ()


def _rank(
    rank: int, frames: list[str], *, status: str = "sleeping", step: int = 10
) -> st.RankStack:
    stack = st.Stack(
        (st.Thread("MainThread", tuple(st.Frame(f, "t.py", 1) for f in frames), True),)
    )
    return st.RankStack(rank, f"n{rank // 2}", 100 + rank, status, stack, step=step)


def test_ranks_are_grouped_and_the_odd_one_out_is_suspected() -> None:
    ranks = [_rank(r, ["all_reduce", "step", "train"]) for r in (0, 1, 2, 3, 4, 6)]
    ranks.append(_rank(5, ["sleep", "loader", "train"]))
    groups = st.merge(ranks)
    assert [g.ranks for g in groups] == [(0, 1, 2, 3, 4, 6), (5,)]
    assert groups[0].where == "all_reduce <- step <- train"
    assert st.suspect(ranks) == (
        5,
        "the only rank in sleep <- loader <- train; the others are in all_reduce <- step <- train",
    )
    view = st.render(ranks, title="hang")
    lines = view.splitlines()
    assert lines[:4] == [
        "hang",
        "suspect: rank 5 (the only rank in sleep <- loader <- train; the others are in "
        "all_reduce <- step <- train)",
        "",
        "rank 5 on n2: sleep <- loader <- train",  # the odd group first
    ]
    assert lines.index("ranks 0-4,6 on n0,n1,n2,n3: all_reduce <- step <- train") > 4


def test_a_stopped_process_is_the_suspect_before_anything_else() -> None:
    ranks = [_rank(0, ["all_reduce"]), _rank(1, ["all_reduce"], status="stopped")]
    assert st.suspect(ranks) == (1, "its process is stopped")


def test_the_oldest_step_is_the_last_resort_and_ties_suspect_nobody() -> None:
    ranks = [_rank(0, ["wait"], step=10), _rank(1, ["wait"], step=7), _rank(2, ["wait"], step=10)]
    assert st.suspect(ranks) == (1, "the oldest step (7)")
    assert st.suspect([_rank(0, ["wait"]), _rank(1, ["wait"])]) is None
    unreadable = st.RankStack(3, "n1", 9, "sleeping", None, error="py-spy: denied")
    assert st.merge([unreadable])[0].where == "(stack unreadable)"
    assert "(stack unreadable: py-spy: denied)" in st.rank_text(unreadable)


def test_the_frames_that_only_launched_the_script_are_left_out() -> None:
    launched = [
        {"name": "main", "filename": "/w/train.py", "line": 82},
        {"name": "<module>", "filename": "/w/train.py", "line": 122},
        {"name": "_run_code", "filename": "<frozen runpy>", "line": 88},
        {"name": "_run_main", "filename": "/v/dlrover_hpc/agent/zygote.py", "line": 273},
    ]
    stack = st.from_py_spy([{"thread_name": "MainThread", "frames": launched}])
    assert [f.function for f in stack.signature()] == ["main", "<module>"]


def test_rank_ranges() -> None:
    assert st.ranges([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert st.ranges([]) == ""
