"""ElasticTrainer: accumulation steps from the world size, one optimizer step per window, the
gradient of a global batch, in one process and on real gloo ranks that change in number."""

from __future__ import annotations

import contextlib
import copy
import faulthandler
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from warm_python import WarmPython

from dlrover_hpc.trainer.elastic import ElasticDataLoader, ElasticDistributedSampler, ElasticTrainer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_world(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WORLD_SIZE", "WORKER_NUM", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def data(n: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 3, generator=g, dtype=torch.float64)
    return x, x @ torch.tensor([[1.0], [-2.0], [0.5]], dtype=torch.float64) + 0.1


def model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)
    ).double()


def mse(m: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, rows: Any) -> torch.Tensor:
    return torch.nn.functional.mse_loss(m(x[rows]), y[rows])


def grads(m: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in m.parameters()]


# --- accumulation steps ----------------------------------------------------------------------


def test_accumulation_steps_keep_the_global_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Global batch 24, micro batch 2: 4 ranks accumulate 3, 3 ranks 4, 2 ranks 6."""
    trainer = ElasticTrainer(model(), global_batch_size=24, micro_batch_size=2)
    assert trainer.gradient_accumulation_steps == 12  # no torch.distributed, no $WORLD_SIZE: 1
    for world, steps in ((4, 3), (3, 4), (2, 6)):
        monkeypatch.setenv("WORLD_SIZE", str(world))
        trainer.reset()
        assert trainer.gradient_accumulation_steps == steps


def test_micro_batch_size_from_the_dataloader(monkeypatch: pytest.MonkeyPatch) -> None:
    """The micro batch is the loader's (its current size when reset() recomputes)."""
    monkeypatch.setenv("WORLD_SIZE", "3")
    loader = ElasticDataLoader(list(range(48)), batch_size=2)
    trainer = ElasticTrainer(model(), loader, global_batch_size=24)
    assert (trainer.micro_batch_size, trainer.gradient_accumulation_steps) == (2, 4)
    loader.update_batch_size(4)
    trainer.reset()  # after a batch size change too
    assert (trainer.micro_batch_size, trainer.gradient_accumulation_steps) == (4, 2)


def test_warning_when_the_global_batch_cannot_be_kept(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "3")
    with caplog.at_level(logging.WARNING):
        trainer = ElasticTrainer(model(), global_batch_size=24, micro_batch_size=5)
        trainer.prepare(torch.optim.SGD(trainer.model.parameters(), lr=0.1))
    assert trainer.gradient_accumulation_steps == 2  # 24 / 15 = 1.6 -> 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [  # once, though computed at construction and in prepare()
        "global_batch_size=24 is not a multiple of micro batch 5 x world size 3 = 15: "
        "accumulating 2 micro-batches per step, so the global batch is 30 samples"
    ]
    monkeypatch.setenv("WORLD_SIZE", "20")  # 2 x 20 = 40 > 24: still one micro-batch
    with caplog.at_level(logging.WARNING):
        trainer = ElasticTrainer(model(), global_batch_size=24, micro_batch_size=2)
    assert trainer.gradient_accumulation_steps == 1 and "global batch is 40 samples" in caplog.text


def test_dlrover_rule_without_a_global_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """No global_batch_size: WORKER_NUM x LOCAL_WORLD_SIZE micro-batches per step, and only
    ``step(fix_total_batch_size=True)`` accumulates (DLRover's default is not to)."""
    monkeypatch.setenv("WORKER_NUM", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    m = model()
    trainer = ElasticTrainer(m)
    optimizer = trainer.prepare(torch.optim.SGD(m.parameters(), lr=0.1))
    assert trainer.gradient_accumulation_steps == 2
    for fix, expected in ((False, 4), (True, 6)):
        for _ in range(4):
            with trainer.step(fix):
                m(torch.ones(1, 3, dtype=torch.float64)).sum().backward()
                optimizer.step()
        assert trainer.num_steps == expected


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"global_batch_size": 0, "micro_batch_size": 2}, "global_batch_size must be >= 1"),
        ({"global_batch_size": 24.0, "micro_batch_size": 2}, "size must be an integer"),
        ({"global_batch_size": 24, "micro_batch_size": -1}, "micro_batch_size must be >= 1"),
        ({"global_batch_size": 24}, "global_batch_size needs the micro batch size"),
    ],
)
def test_bad_arguments(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ElasticTrainer(model(), **kwargs)


def test_bad_world_size_and_optimizer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(ValueError, match=r"\$WORLD_SIZE must be an integer, got 'four'"):
        ElasticTrainer(model(), global_batch_size=8, micro_batch_size=2)
    monkeypatch.setenv("WORLD_SIZE", "0")
    with pytest.raises(ValueError, match=r"\$WORLD_SIZE must be >= 1, got 0"):
        ElasticTrainer(model(), global_batch_size=8, micro_batch_size=2)
    monkeypatch.setenv("WORLD_SIZE", "1")
    trainer = ElasticTrainer(model(), global_batch_size=8, micro_batch_size=2)
    with pytest.raises(ValueError, match=r"optimizer must be a torch\.optim\.Optimizer"):
        trainer.prepare(object())  # type: ignore[call-overload]


# --- one optimizer step per window; the global batch's gradient ---------------------------


class NoSyncModel(torch.nn.Module):
    """A model with DDP's ``no_sync()``, recording the micro-steps it was entered in."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = model()
        self.no_sync_calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)  # type: ignore[no-any-return]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.no_sync_calls += 1
        yield


@pytest.mark.parametrize("zero_first", [True, False])
def test_one_optimizer_step_per_window_with_the_large_batch_gradient(zero_first: bool) -> None:
    """Micro batch 2, global batch 8, one rank: 4 micro-steps per optimizer step.  The
    gradient at the step is the 8-sample batch's, and the parameters after each step are those
    of plain SGD with momentum on 8-sample batches; the scheduler steps with the optimizer;
    ``no_sync`` covers the first 3 micro-steps of each window.  ``zero_grad()`` before the
    backward (``zero_first``) or after the step: both keep the window's gradients."""
    x, y = data(48)
    m = NoSyncModel()
    reference = copy.deepcopy(m.inner)
    trainer = ElasticTrainer(m, global_batch_size=8, micro_batch_size=2)
    inner = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    schedule = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
    optimizer, scheduler = trainer.prepare(inner, schedule)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    ref_schedule = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    real_steps: list[int] = []
    inner.register_step_post_hook(
        lambda *_: real_steps.append(trainer.gradient_state.num_backward_steps)
    )
    accumulate = trainer.gradient_accumulation_steps
    assert accumulate == 4
    for micro in range(24):
        before = [p.detach().clone() for p in m.parameters()]
        with trainer.step():
            if zero_first:
                optimizer.zero_grad()
            lo = micro * 2
            (mse(m, x, y, slice(lo, lo + 2)) / accumulate).backward()
            if trainer.gradient_state.sync_gradients:
                reference.zero_grad()
                mse(reference, x, y, slice(lo - 6, lo + 2)).backward()
                for got, want in zip(grads(m), grads(reference), strict=True):
                    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
                ref_opt.step()
                ref_schedule.step()
            optimizer.step()
            scheduler.step()
            if not zero_first:
                optimizer.zero_grad()
        if (micro + 1) % accumulate:
            assert all(torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=True))
        for got, want in zip(m.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert real_steps == [4, 8, 12, 16, 20, 24] and trainer.num_steps == 6
    assert m.no_sync_calls == 18 and trainer.gradient_state.num_backward_steps == 24
    assert scheduler.get_last_lr() == [0.1 * 0.5**6]
    trainer.reset()
    assert trainer.num_steps == 0
    optimizer.step()  # outside a step(): the optimizer's own step
    assert len(real_steps) == 7


def test_zero_grad_outside_a_step_and_an_error_inside_one() -> None:
    """Outside step() the wrapper is the optimizer; an error leaves no micro-step open."""
    m = model()
    trainer = ElasticTrainer(m, global_batch_size=4, micro_batch_size=2)
    optimizer = trainer.prepare(torch.optim.SGD(m.parameters(), lr=0.1))
    m(torch.ones(1, 3, dtype=torch.float64)).sum().backward()
    optimizer.zero_grad()
    assert all(p.grad is None for p in m.parameters())
    with pytest.raises(RuntimeError, match="boom"), trainer.step():
        raise RuntimeError("boom")
    assert not trainer.gradient_state.in_step and trainer.gradient_state.micro_in_window == 0
    assert optimizer.param_groups is optimizer.optimizer.param_groups
    assert optimizer.state_dict() == optimizer.optimizer.state_dict()


def test_a_window_goes_on_across_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    """An epoch ends inside a window and the script calls reset(): the window keeps its
    gradients and ends at the accumulation steps reset() computed (here 2 ranks: 2)."""
    x, y = data(8)
    m = model()
    reference = copy.deepcopy(m)
    trainer = ElasticTrainer(m, global_batch_size=8, micro_batch_size=2)
    inner = torch.optim.SGD(m.parameters(), lr=0.1)
    stepped_with: list[list[torch.Tensor]] = []
    inner.register_step_pre_hook(lambda *_: stepped_with.append(grads(m)))
    optimizer = trainer.prepare(inner)
    for i in range(3):
        with trainer.step():
            optimizer.zero_grad()
            mse(m, x, y, slice(2 * i, 2 * i + 2)).backward()
            optimizer.step()
        if i == 0:
            monkeypatch.setenv("WORLD_SIZE", "2")
            trainer.reset()
    assert trainer.gradient_accumulation_steps == 2 and trainer.num_steps == 1
    assert trainer.gradient_state.micro_in_window == 1  # the third micro-step opened a window
    mse(reference, x, y, slice(0, 4)).backward()  # micro-steps 0 and 1, across the reset
    for p in reference.parameters():  # two micro-batch means summed: twice the 4-sample mean
        p.grad *= 2  # type: ignore[operator]
    assert len(stepped_with) == 1
    for got, want in zip(stepped_with[0], grads(reference), strict=True):
        torch.testing.assert_close(got, want)


# --- real ranks: 4 then 3 gloo processes, a checkpoint between them ------------------------


def rank_main(rank: int, world: int, phase: str, root: str) -> None:
    """One DDP rank, started by `run_ranks`."""
    faulthandler.dump_traceback_later(150, exit=True)  # a hung rank shows where, and exits
    # A TCP store, rank 0's (the port is in the environment): torch's FileStore counts its
    # users to delete the file, and a rank whose store outlived that count hung at exit,
    # retrying to open the deleted file (twice in clean-clone runs)
    port = os.environ["DLROVER_HPC_TEST_STORE_PORT"]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    net = model()
    x, y = data(96)
    dataset = torch.utils.data.TensorDataset(x, y)
    sampler = ElasticDistributedSampler(dataset, seed=11)
    loader = ElasticDataLoader(dataset, batch_size=2, sampler=sampler)
    ddp = DistributedDataParallel(net)
    trainer = ElasticTrainer(ddp, loader, global_batch_size=24)
    optimizer = trainer.prepare(torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9))
    step = 0
    if phase == "after":
        ckpt = torch.load(f"{root}/ckpt.pt")
        net.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        sampler.load_state_dict(ckpt["sampler"])
        step = ckpt["step"]
    out: dict[str, Any] = {"accumulate": trainer.gradient_accumulation_steps, "grads": []}
    for xb, yb in loader:
        with trainer.step():
            loss = torch.nn.functional.mse_loss(ddp(xb), yb) / trainer.gradient_accumulation_steps
            loss.backward()
            if trainer.gradient_state.sync_gradients:
                out["grads"].append([p.grad.tolist() for p in net.parameters()])  # type: ignore[union-attr]
            optimizer.step()
            optimizer.zero_grad()
        step += 1
        if phase == "before" and trainer.num_steps == 2:
            break
    out["sampler"] = sampler.state_dict(step, loader.batch_size or 0)
    if rank == 0:
        model_state, optimizer_state = net.state_dict(), optimizer.state_dict()
        state = {"model": model_state, "optimizer": optimizer_state, "step": step}
        torch.save({**state, "sampler": out["sampler"]}, f"{root}/ckpt.pt")
    Path(f"{root}/{phase}-{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
    # Everything this rank checks is written. Its teardown (the DDP model, the loader, gloo's
    # threads freed as this frame ends) hung now and then in native code, one rank of three
    # or four at module level with an idle native thread, its work and barrier done (three
    # full runs in eight): that is torch's teardown, not what this test is about.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(root: str, world: int, phase: str) -> None:
    """Starts ``world`` ranks, each a fork of the tests' pre-warmed interpreter (single-threaded,
    it never ran torch code: nothing of a parent's threads or locks is inherited), and waits
    for them."""
    env = os.environ | {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    env["GLOO_SOCKET_IFNAME"] = "lo"
    with socket.socket() as probe:  # a free port for rank 0's store
        probe.bind(("127.0.0.1", 0))
        env["DLROVER_HPC_TEST_STORE_PORT"] = str(probe.getsockname()[1])
    procs = [
        subprocess.Popen(
            _warm(
                Path(root), f"{phase}-rank{r}", f"t.rank_main({r}, {world}, {phase!r}, {root!r})"
            ),
            env=env,
        )
        for r in range(world)
    ]
    deadline = time.monotonic() + 180
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:  # show where it hangs (py-spy is a dependency), then kill it
                # p is the zygote's client; the rank itself is a child of the zygote
                script = f"{phase}-rank{procs.index(p)}.py"
                for pid in [p.pid, *_running(script, but=p.pid)]:
                    spy = [str(Path(sys.executable).with_name("py-spy")), "dump", "--pid", str(pid)]
                    dump = subprocess.run(spy, capture_output=True, text=True, timeout=30)
                    print(f"{phase}: {pid} hangs:", dump.stdout, dump.stderr, file=sys.stderr)
                p.kill()
                p.wait()
    if [p.returncode for p in procs] != [0] * world:
        raise SystemExit(f"{phase}: rank exit codes {[p.returncode for p in procs]}")


def _running(script: str, *, but: int) -> list[int]:
    """The processes whose command line names ``script``, but ``but``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != but:
            try:
                if script in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue  # ended meanwhile
    return found


#: The socket of the pre-warmed interpreter, for the driver process that starts the ranks.
WARM_SOCKET = "DLROVER_HPC_TEST_WARM_SOCKET"


def _load(call: str) -> str:
    """Python code that imports this file as a module ``t`` and runs ``call``."""
    return (
        f"import importlib.util, sys; sys.path[:0] = [{str(REPO)!r}, {str(REPO / 'tests')!r}]; "
        f"spec = importlib.util.spec_from_file_location('ranks', {__file__!r}); "
        "t = importlib.util.module_from_spec(spec); spec.loader.exec_module(t); "
        f"{call}"
    )


def _warm(root: Path, name: str, call: str, socket: str | None = None) -> list[str]:
    """The command line of a process forked from the pre-warmed interpreter at ``socket``
    (by default the one ``WARM_SOCKET`` names), that runs ``call`` (see :func:`_load`)."""
    script = root / f"{name}.py"
    script.write_text(_load(call))
    return WarmPython.of(socket or os.environ[WARM_SOCKET])([str(script)])


def drive(root: str) -> None:
    """The two phases: 4 ranks, a checkpoint, then 3 ranks."""
    run_ranks(root, 4, "before")
    run_ranks(root, 3, "after")


@pytest.mark.timeout(300)
@pytest.mark.runtime  # seven real ranks: not in make test-fast
def test_gloo_ranks_4_then_3_train_as_one_large_batch(
    tmp_path: Path, warm_python: WarmPython
) -> None:
    """4 DDP ranks (3 micro-steps of 2 per step) take 2 steps of the global batch 24 and
    checkpoint; 3 ranks (4 micro-steps) resume and finish the epoch of 96.  Each step's
    gradient is the 24-sample batch's, and the model ends as one process training on
    24-sample batches of the same permutation ends."""
    proc = subprocess.Popen(
        _warm(tmp_path, "drive", f"t.drive({str(tmp_path)!r})", warm_python.socket_path),
        env=os.environ | {WARM_SOCKET: warm_python.socket_path},
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=270)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-4000:]
    before, after = (
        [json.loads((tmp_path / f"{phase}-{r}.json").read_text()) for r in range(world)]
        for phase, world in (("before", 4), ("after", 3))
    )
    assert [o["accumulate"] for o in before + after] == [3] * 4 + [4] * 3
    assert all(o["sampler"] == {"completed_num": 48, "epoch": 0, "iter_step": 6} for o in before)
    assert all(o["sampler"] == {"completed_num": 96, "epoch": 0, "iter_step": 14} for o in after)

    net = model()
    net.load_state_dict(torch.load(tmp_path / "ckpt.pt")["model"])  # where the 3 ranks ended
    x, y = data(96)
    order = ElasticDistributedSampler(torch.utils.data.TensorDataset(x), seed=11).permutation()
    reference = model()  # one process, 4 steps of 24 samples in the sampler's order
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for outs in (before, after):
        assert all(o["grads"] == outs[0]["grads"] for o in outs)  # DDP: the same on all ranks
    got_grads = before[0]["grads"] + after[0]["grads"]
    assert len(got_grads) == 4
    for k, got in enumerate(got_grads):
        opt.zero_grad()
        mse(reference, x, y, order[k * 24 : (k + 1) * 24]).backward()
        for a, p in zip(got, reference.parameters(), strict=True):
            torch.testing.assert_close(torch.tensor(a, dtype=torch.float64), p.grad)
        opt.step()
    for a, b in zip(net.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b)  # float64: within 1e-7 relative
