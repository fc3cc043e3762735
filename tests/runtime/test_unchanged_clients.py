"""The unchanged-client matrix (issue 45, item 5): public training scripts, vendored under
``tests/clients/`` with their licence and provenance, run under ``torchrun`` and ``dlrover-run``
side by side.  Changed only where a CUDA line must become a CPU one (each patch checked and
listed).

(a) Healthy: the same exit code and the same final loss (bitwise where the script is
deterministic on the CPU); the launcher exits within 5 s of the last step's line, so every
rank did; no hang, straggler, exit hang or restart event.

(b) One worker SIGKILLed mid-run: dlrover-run completes, resumed from the script's own
checkpoint; torchrun's outcome (it restarts nothing by default) is recorded, not judged.

The DDP tutorial runs its healthy case three times in a row under dlrover-run: PyTorch 2.13's
gloo teardown deadlocked (3 runs in 5) when the pre-warmed interpreter imported torch._dynamo
before the script built its DDP model.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from runtime_helpers import BIN, events, named, sbatch, wait_job
from vendored import Run, launch, materialize, nanogpt_data, workers

from dlrover_hpc.localslurm import LocalSlurm, wait_for

pytestmark = pytest.mark.timeout(600)
TORCHRUN, DLROVER_RUN = str(BIN / "torchrun"), str(BIN / "dlrover-run")
#: events a healthy run must not have
ALARMS = ("hang_detected", "straggler_detected", "exit_hang", "workers_restarted", "worker_failed")
EXIT_WITHIN_S = 5.0


def _launchers(work: Path, nproc: int, tag: str) -> dict[str, list[str]]:
    std = ["--standalone", f"--nproc-per-node={nproc}"]
    return {
        "torchrun": [TORCHRUN, *std],
        "dlrover-run": [DLROVER_RUN, *std, f"--job-dir={work / ('job-' + tag)}"],
    }


def _ranks_exited_after(run: Run, pattern: str, job_dir: Path) -> float:
    """Seconds from the last step's line to the job's end, when the agent had seen every rank
    exit (``job_finished``: its own teardown after that is not the ranks'); torchrun, whose
    own exit under load took up to 14 s after its ranks', is only recorded (``run.exit_after``)."""
    found = run.last(pattern)
    assert found is not None, f"no line matches {pattern!r}:\n{run.text[-3000:]}"
    [finished] = named(events(job_dir), "job_finished")
    return finished["time"] - found[0]


def _no_alarms(job_dir: Path) -> None:
    evs = events(job_dir)
    assert named(evs, "job_finished")[-1]["exit_code"] == 0, evs[-3:]
    for name in ALARMS:
        assert not named(evs, name), (name, named(evs, name))


# ------------------------------------------------------------------ the DDP tutorial
TUTORIAL_EPOCHS = ["40", "10"]  # total epochs, snapshot every 10 (a kill at epoch 15)
LAST_EPOCH = r"Epoch 39 \|"
HEALTHY_EPOCHS, HEALTHY_LAST = ["20", "10"], r"Epoch 19 \|"  # the exit is what is tested


def test_ddp_tutorial_healthy_exits_as_under_torchrun(tmp_path: Path) -> None:
    applied = materialize("ddp_tutorial", tmp_path)
    print("patches:", *(p.line() for p in applied if p.file == "multinode.py"), sep="\n  ")
    runs = []
    for i, name in enumerate(["torchrun", "dlrover-run", "dlrover-run", "dlrover-run"]):
        (tmp_path / "snapshot.pt").unlink(missing_ok=True)
        argv = [*_launchers(tmp_path, 4, f"healthy{i}")[name], "multinode.py", *HEALTHY_EPOCHS]
        run = launch(argv, cwd=tmp_path, timeout_s=90)
        assert run.rc == 0, (name, i, run.rc, run.text[-3000:])
        assert len(re.findall(HEALTHY_LAST, run.text)) == 4, run.text[-2000:]  # every rank
        runs.append((name, run.wall_s, run.exit_after(HEALTHY_LAST)))
        if name == "dlrover-run":
            job_dir = tmp_path / f"job-healthy{i}"
            exited = _ranks_exited_after(run, HEALTHY_LAST, job_dir)
            assert exited <= EXIT_WITHIN_S, (name, i, exited, runs)
            _no_alarms(job_dir)
    print(json.dumps({"ddp_tutorial_healthy": runs}))


def test_ddp_tutorial_killed_worker_resumes_from_its_snapshot(tmp_path: Path) -> None:
    materialize("ddp_tutorial", tmp_path)
    outcome = {}
    for name in ("dlrover-run", "torchrun"):
        (tmp_path / "snapshot.pt").unlink(missing_ok=True)
        argv = [*_launchers(tmp_path, 2, "kill")[name], "multinode.py", *TUTORIAL_EPOCHS]
        run = launch(
            argv,
            cwd=tmp_path,
            timeout_s=120,
            kill_when=lambda line: "Epoch 15 |" in line,
            script="multinode.py",
        )
        assert run.killed_pid, run.text[-2000:]
        resumed = run.last(r"Resuming training from snapshot at Epoch (\d+)")
        outcome[name] = {"rc": run.rc, "resumed": resumed[1] if resumed else None}
        if name == "dlrover-run":
            assert run.rc == 0, run.text[-3000:]
            assert resumed is not None and resumed[1].endswith("Epoch 10"), run.text[-3000:]
            assert len(re.findall(LAST_EPOCH, run.text)) == 2, run.text[-2000:]
            assert _ranks_exited_after(run, LAST_EPOCH, tmp_path / "job-kill") <= EXIT_WITHIN_S
            evs = events(tmp_path / "job-kill")
            [failed] = [e for e in named(evs, "worker_failed") if e["classification"] != "peer"]
            assert failed["signal"] == "SIGKILL", failed
            assert not named(evs, "hang_detected") and not named(evs, "exit_hang"), evs
    print(json.dumps({"ddp_tutorial_kill": outcome}))


def _tutorial_job(work: Path, job: str, world: int) -> str:
    """Kill one worker once epoch 15 shows; the job's output, once it ended COMPLETED."""
    out = work / f"slurm-{job}.out"
    wait_for(
        lambda: out.exists() and "Epoch 15 |" in out.read_text() and workers(work, "multinode.py"),
        timeout_s=180,
        what="the tutorial to reach epoch 15",
        interval_s=0.2,
    )
    victim = sorted(workers(work, "multinode.py"), key=lambda p: p.pid)[-1]
    victim.kill()
    fields = wait_job(job, timeout_s=300)
    text = out.read_text()
    assert fields["JobState"] == "COMPLETED", text[-4000:]
    assert "Resuming training from snapshot at Epoch" in text, text[-4000:]
    assert len(re.findall(LAST_EPOCH, text)) >= world, text[-3000:]
    assert not workers(work, "multinode.py")  # every rank exited
    evs = events(work / ".dlrover-hpc" / job)
    assert named(evs, "job_finished")[-1]["exit_code"] == 0
    assert [e["signal"] for e in named(evs, "worker_failed") if e["classification"] != "peer"] == [
        "SIGKILL"
    ]
    assert not named(evs, "exit_hang") and not named(evs, "hang_detected")
    return text


@pytest.mark.slurm
def test_ddp_tutorial_through_its_own_sbatch_with_one_word_changed(
    local_slurm: LocalSlurm, shared_tmp: Path
) -> None:
    applied = materialize("ddp_tutorial", shared_tmp)
    assert any(p.new == "srun dlrover-run" for p in applied)
    # as the tutorial's README says (`sbatch sbatch_run.sh`): its own 4 nodes
    template = str(shared_tmp / "slurm" / "sbatch_run.sh")
    job = sbatch(shared_tmp, 4, template=template, env={"EPOCHS": "40", "SAVE_EVERY": "10"})
    _tutorial_job(shared_tmp, job, world=4)


@pytest.mark.slurm
def test_ddp_tutorial_through_train_sbatch(local_slurm: LocalSlurm, shared_tmp: Path) -> None:
    materialize("ddp_tutorial", shared_tmp)
    job = sbatch(
        shared_tmp, 2, "--nnodes=2", "--nproc-per-node=2", "multinode.py", *TUTORIAL_EPOCHS
    )
    _tutorial_job(shared_tmp, job, world=4)


# ------------------------------------------------------------------ nanoGPT
ITER = re.compile(r"iter (\d+): loss ([\d.]+)")
EVAL = re.compile(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)")


def _nanogpt(work: Path) -> None:
    applied = materialize("nanogpt", work)
    print("patches:", *(p.line() for p in applied), sep="\n  ")
    nanogpt_data(work)


def _losses(text: str) -> tuple[tuple[str, str] | None, list[tuple[str, ...]]]:
    iters = ITER.findall(text)
    return (iters[-1] if iters else None), EVAL.findall(text)


def test_nanogpt_healthy_same_loss_bitwise(tmp_path: Path) -> None:
    _nanogpt(tmp_path)
    results = {}
    for name, argv in _launchers(tmp_path, 2, "healthy").items():
        for old in (tmp_path / "out-tiny").glob("*"):
            old.unlink()
        run = launch([*argv, "train.py", "config/dlrover_tiny.py"], cwd=tmp_path, timeout_s=180)
        assert run.rc == 0, (name, run.text[-3000:])
        if name == "dlrover-run":
            exited = _ranks_exited_after(run, r"iter 60: loss", tmp_path / "job-healthy")
            assert exited <= EXIT_WITHIN_S, exited
        results[name] = _losses(run.text)
    print(json.dumps({"nanogpt_healthy": results}))
    assert results["torchrun"][0] is not None and results["torchrun"][0][0] == "60", results
    assert results["dlrover-run"] == results["torchrun"]  # deterministic on the CPU: bitwise
    _no_alarms(tmp_path / "job-healthy")


def test_nanogpt_killed_worker_resumes_from_its_ckpt(tmp_path: Path) -> None:
    _nanogpt(tmp_path)
    outcome = {}
    for name, argv in _launchers(tmp_path, 2, "kill").items():
        for old in (tmp_path / "out-tiny").glob("*"):
            old.unlink()
        run = launch(
            [*argv, "train.py", "config/dlrover_tiny.py"],
            cwd=tmp_path,
            timeout_s=180,
            kill_when=lambda line: re.search(r"iter 30: loss", line) is not None,
            script="train.py",
        )
        assert run.killed_pid, run.text[-2000:]
        outcome[name] = {"rc": run.rc, "resumed": "Resuming training from out-tiny" in run.text}
        if name == "dlrover-run":
            assert run.rc == 0, run.text[-3000:]
            assert outcome[name]["resumed"], run.text[-3000:]
            last, evals = _losses(run.text)
            assert last is not None and last[0] == "60", run.text[-2000:]
            assert evals[-1][:1] == ("60",), evals
            exited = _ranks_exited_after(run, r"iter 60: loss", tmp_path / "job-kill")
            assert exited <= EXIT_WITHIN_S, exited
    print(json.dumps({"nanogpt_kill": outcome}))


# ------------------------------------------------------- Lightning, accelerate, HF Trainer
def _hf_inputs(work: Path) -> list[str]:
    import subprocess
    import sys

    inputs = work / "inputs"
    subprocess.run(
        [sys.executable, str(work / "make_offline_inputs.py"), str(inputs)], check=True, timeout=60
    )
    return [
        "run_clm.py",
        "--model_type=gpt2",
        "--config_overrides=n_embd=32,n_layer=2,n_head=2,n_positions=64,vocab_size=64",
        f"--tokenizer_name={inputs / 'tokenizer'}",
        f"--train_file={inputs / 'train.txt'}",
        "--validation_split_percentage=10",
        "--block_size=32",
        "--do_train",
        f"--output_dir={work / 'out'}",
        "--per_device_train_batch_size=4",
        "--max_steps=10",
        "--logging_steps=1",
        "--save_steps=5",
        "--seed=42",
        "--report_to=none",
        f"--cache_dir={work / 'cache'}",
        "--use_cpu",
        "--ddp_backend=gloo",
        "--learning_rate=1e-3",
    ]


def _pass_lines(text: str) -> list[str]:
    """accelerate's test script: its section headers and pass lines, each once."""
    found = re.findall(
        r"(\*\*[A-Za-z ]+\*\*|Training yielded [^.]+\.|[BF]{1,2}16 training check\.)", text
    )
    return sorted(set(found))


#: name -> (script, the environment that makes it distributed on the CPU (its own switches) and
#: the framework dlrover-run's pre-warmed interpreter imports once per node (DESIGN: a preload
#: is proven safe by this matrix; torchrun ignores it), the last line it prints, the line that
#: cues the kill, what is compared between launchers)
FRAMEWORKS = {
    "lightning": (
        "bug_report_model.py",
        {
            "PL_TRAINER_ACCELERATOR": "cpu",
            "PL_TRAINER_DEVICES": "2",
            "PL_TRAINER_STRATEGY": "ddp",
            "DLROVER_HPC_PRELOAD": "lightning.pytorch",  # imported first by the script anyway
        },
        r"test_loss",
        "All distributed processes registered",
        lambda text: "test_loss" in text,  # unseeded data and model: not deterministic
    ),
    "accelerate": (
        "test_script.py",
        {"ACCELERATE_USE_CPU": "1", "DLROVER_HPC_PRELOAD": "accelerate"},
        r"\*\*Test reinstantiated state\*\*",
        "**Training integration test**",
        _pass_lines,  # seeded, and checked against one process by the script itself
    ),
    "hf_trainer": (
        "run_clm.py",
        {
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "DLROVER_HPC_PRELOAD": "datasets,transformers",
        },
        r"train_loss\s+=",
        "'loss': ",
        lambda text: re.findall(r"'loss': '([\d.]+)'|train_loss\s+=\s+([\d.]+)", text),
    ),
}


@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_framework_client_healthy_like_torchrun_and_completes_after_a_kill(
    tmp_path: Path, name: str
) -> None:
    script, env, last, cue, compare = FRAMEWORKS[name]
    materialize(name, tmp_path)
    env = {**env, "HF_HOME": str(tmp_path / "hf")}
    args = _hf_inputs(tmp_path) if name == "hf_trainer" else [script]
    seen: dict[str, object] = {}
    outcome: dict[str, object] = {}
    for case in ("healthy", "kill"):
        for launcher, argv in _launchers(tmp_path, 2, f"{case}").items():
            shutil.rmtree(tmp_path / "out", ignore_errors=True)  # the HF Trainer's output
            kill = (lambda line: cue in line) if case == "kill" else None
            run = launch(
                [*argv, *args], cwd=tmp_path, env=env, timeout_s=180, kill_when=kill, script=script
            )
            if case == "healthy":
                assert run.rc == 0, (launcher, run.text[-3000:])
                seen[launcher] = compare(run.text)
                if launcher == "dlrover-run":
                    exited = _ranks_exited_after(run, last, tmp_path / "job-healthy")
                    assert exited <= EXIT_WITHIN_S, exited
                    _no_alarms(tmp_path / "job-healthy")
                continue
            assert run.killed_pid, (launcher, run.text[-2000:])
            outcome[launcher] = run.rc
            if launcher == "dlrover-run":
                assert run.rc == 0, run.text[-3000:]
                evs = events(tmp_path / "job-kill")
                assert named(evs, "workers_restarted"), evs[-5:]
                assert not named(evs, "hang_detected") and not named(evs, "exit_hang")
    print(json.dumps({name: {"healthy": seen, "kill_rc": outcome}}, default=str))
    assert seen["dlrover-run"] == seen["torchrun"] and seen["torchrun"], seen
