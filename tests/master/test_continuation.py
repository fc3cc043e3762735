"""The pure parts of a graceful end: the stop step, the kind of a signal, the next job's sbatch
line from verbatim ``scontrol -o show job`` output, and ``squeue %L``."""

from __future__ import annotations

from dlrover_hpc.master.continuation import StopKind, resubmit_argv, stop_kind, stop_step
from dlrover_hpc.master.stopping import KILL_MARGIN_S, MAX_STOP_WAIT_S, stop_deadline
from dlrover_hpc.slurm.parse import parse_oneliner, parse_time_left

# `scontrol -o show job 1` of `sbatch -N1 --time=1:30 --signal=B:USR1@30 -o /tmp/sig/out-%j.txt`
SHOW_JOB = (
    "JobId=1 JobName=t.sbatch UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901759 "
    "Nice=0 Account=(null) QOS=(null) JobState=RUNNING Reason=None Dependency=(null) Requeue=1 "
    "Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:06 TimeLimit=00:02:00 "
    "TimeMin=N/A SubmitTime=2026-11-23T22:44:16 EligibleTime=2026-11-23T22:44:16 "
    "AccrueTime=2026-11-23T22:44:16 StartTime=2026-11-23T22:44:17 EndTime=2026-11-23T22:46:17 "
    "Deadline=N/A SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-11-23T22:44:17 "
    "Scheduler=Backfill Partition=debug AllocNode:Sid=localhost:11271 ReqNodeList=(null) "
    "ExcNodeList=(null) NodeList=node1 BatchHost=node1 NumNodes=1 NumCPUs=1 NumTasks=1 "
    "CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=1,node=1,billing=1 Socks/Node=* "
    "NtasksPerN:B:S:C=0:0:*:* CoreSpec=* MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0 "
    "Features=(null) DelayBoot=00:00:00 OverSubscribe=OK Contiguous=0 Licenses=(null) "
    "Network=(null) Command=/tmp/sig/t.sbatch WorkDir=/tmp/sig StdErr=/tmp/sig/out-1.txt "
    "StdIn=/dev/null StdOut=/tmp/sig/out-1.txt Power= "
)


def test_stop_step_leaves_room_for_the_notice_to_arrive() -> None:
    assert stop_step(100, 0.0, 5.0) == 102  # rate unknown: at least two steps ahead
    assert stop_step(100, 10.0, 5.0) == 150  # 10 steps/s for 5 s
    assert stop_step(-1, 1.0, 5.0) == 5  # nothing reported yet
    assert stop_step(7, 0.1, 5.0) == 9  # slow steps: still two ahead


def test_a_signal_near_the_limit_is_the_time_limit_else_a_preemption() -> None:
    assert stop_kind(100.0, 90.0) is StopKind.TIME_LIMIT
    assert stop_kind(3 * 3600.0, 90.0) is StopKind.PREEMPTED
    assert stop_kind(None, 90.0) is StopKind.PREEMPTED  # no limit at all


def test_squeue_time_left_formats() -> None:
    assert parse_time_left("1:54\n") == 114
    assert parse_time_left("1:02:03") == 3723
    assert parse_time_left("2-01:02:03") == 2 * 86400 + 3723
    for text in ("UNLIMITED", "NOT_SET", "INVALID", "", "1:x"):
        assert parse_time_left(text) is None


def test_resubmission_keeps_the_jobs_shape_and_drops_its_identity() -> None:
    job = parse_oneliner(SHOW_JOB)
    environ = {
        "SLURM_JOB_ID": "1",
        "SLURM_NODELIST": "node1",
        "SLURM_CONF": "/site/slurm.conf",  # the user's choice of cluster: kept
        "SBATCH_SIGNAL": "x",
        "DLROVER_HPC_JOB_DIR": "/w/.dlrover-hpc/1",
        "DLROVER_HPC_TOKEN": "t",
        "DLROVER_HPC_MASTER_OPTS": "--drain=off",
        "PATH": "/bin",
    }
    argv = resubmit_argv(
        job,
        job_id="1",
        script="/repo/sbatch/train.sbatch",
        args=["--nnodes=2", "train.py", "--steps=9"],
        count=2,
        environ=environ,
        extra=["--signal=B:USR1@30"],
    )
    sbatch = argv.index("sbatch")
    unset = {argv[i + 1] for i in range(sbatch) if argv[i] == "-u"}
    assert argv[0] == "env" and unset == {
        "SLURM_JOB_ID",
        "SLURM_NODELIST",
        "SBATCH_SIGNAL",
        "DLROVER_HPC_JOB_DIR",
        "DLROVER_HPC_TOKEN",
    }
    options = argv[sbatch + 1 : argv.index("/repo/sbatch/train.sbatch")]
    assert options == [
        "--parsable",
        "--dependency=afterany:1",
        "--export=ALL,DLROVER_HPC_CONTINUATION=2",
        "--nodes=1",
        "--time=00:02:00",
        "--partition=debug",
        "--job-name=t.sbatch",
        "--chdir=/tmp/sig",
        "--output=/tmp/sig/out-%j.txt",
        "--error=/tmp/sig/out-%j.txt",
        "--signal=B:USR1@30",
    ]
    assert argv[-3:] == ["--nnodes=2", "train.py", "--steps=9"]


def test_resubmission_maps_memory_exclusive_gres_and_no_requeue() -> None:
    job = parse_oneliner(SHOW_JOB)
    job.update(
        MinMemoryNode="64G",
        OverSubscribe="NO",
        Requeue="0",
        TresPerNode="gres:gpu:8",
        StdOut="/runs/job11/slurm-11.out",
        TimeLimit="UNLIMITED",
    )
    argv = resubmit_argv(job, job_id="11", script="s", args=[], count=1, environ={})
    assert "--mem=64G" in argv and "--exclusive" in argv and "--no-requeue" in argv
    assert "--gres=gpu:8" in argv
    assert "--output=/runs/job11/slurm-%j.out" in argv  # only the file name is renamed
    assert not any(a.startswith("--time") for a in argv)


def test_a_stop_long_before_the_time_limit_waits_for_a_save_an_hour_at_most() -> None:
    """A job stopped by hand (or a signal) days before its limit: the ranks get an hour to
    reach a save, not the days left (a worker's wait for the commit once failed on that)."""
    assert stop_deadline(1000.0, 6 * 86400.0, None) == 1000.0 + MAX_STOP_WAIT_S
    # Slurm's USR1 two minutes before the limit: up to the limit, less the kill margin
    assert stop_deadline(1000.0, 120.0, None) == 1000.0 + 120.0 - KILL_MARGIN_S
    assert stop_deadline(1000.0, None, None) == 1060.0  # no limit known
    assert stop_deadline(1000.0, 6 * 86400.0, 20.0) == 1020.0  # SIGTERM: KillWait's grace
    assert stop_deadline(1000.0, 3.0, None) == 1005.0  # past the margin: 5 s at least
