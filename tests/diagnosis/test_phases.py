"""Long phases recognised from a stalled rank's stack (issue 25): a checkpoint written with
torch.save or an evaluation loop in a framework, with no hook to mark them."""

from __future__ import annotations

from dlrover_hpc.diagnosis import stacks as st


def _stack(*frames: tuple[str, str]) -> st.Stack:
    main = st.Thread("MainThread", tuple(st.Frame(f, file, 1) for f, file in frames), True)
    other = st.Thread("pin_memory", (st.Frame("save", "/x/torch/serialization.py", 1),), False)
    return st.Stack((other, main))


def test_checkpoint_and_evaluation_frames_name_their_phase() -> None:
    saving = _stack(
        ("_save", "/venv/lib/python3.11/site-packages/torch/serialization.py"),
        ("save", "/venv/lib/python3.11/site-packages/torch/serialization.py"),
        ("main", "train.py"),
    )
    assert st.phase_of(saving) == "checkpoint"
    hf = _stack(("forward", "model.py"), ("evaluation_loop", "transformers/trainer.py"))
    assert st.phase_of(hf) == "eval"
    pl = _stack(
        ("run", "/venv/lib/python3.11/site-packages/lightning/pytorch/loops/evaluation_loop.py")
    )
    assert st.phase_of(pl) == "eval"
    assert st.phase_of(_stack(("_save_checkpoint", "transformers/trainer.py"))) == "checkpoint"


def test_a_rank_blocked_in_a_collective_or_a_data_loader_is_in_no_phase() -> None:
    # only the main thread counts: another thread writing a file does not make it a phase
    waiting = _stack(("all_reduce", "torch/distributed/distributed_c10d.py"), ("main", "t.py"))
    assert st.phase_of(waiting) == ""
    loader = _stack(("_next_data", "torch/utils/data/dataloader.py"), ("main", "t.py"))
    assert st.phase_of(loader) == ""
    assert st.phase_of(None) == ""
    assert st.phase_of(st.Stack(())) == ""
