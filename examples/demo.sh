#!/usr/bin/env bash
# The demo on the local 4-node Slurm (`make demo` brings it up first): a 4-node DDP job in
# which one worker is SIGKILLed mid-run; the agents restart the workers, which resume from the
# last checkpoint, and the job completes.  Prints the job's event log at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
export PATH="$repo/.venv/bin:$PATH"

echo "== srun -N4 hostname: four nodes, four host names"
timeout 60 srun -N4 hostname | sort

work=$(mktemp -d /tmp/dlrover-hpc-demo.XXXXXX)
chmod 755 "$work"
mkdir -p "$work/ckpt"
cd "$work"
echo "== sbatch -N4 sbatch/train.sbatch --nnodes=3:4 --nproc-per-node=2 examples/train.py ..."
job=$(sbatch --parsable -N4 -o "$work/slurm-%j.out" "$repo/sbatch/train.sbatch" \
    --nnodes=3:4 --nproc-per-node=2 --max-restarts=3 "$repo/examples/train.py" \
    --steps=60 --step-time=0.1 --ckpt-dir="$work/ckpt" --fail-at-step=25 --fail-rank=5)
echo "job $job: rank 5 will SIGKILL itself at step 25; output in $work/slurm-$job.out"
job_dir="$work/.dlrover-hpc/$job"
shown=0
for _ in $(seq 1 600); do
    state=$(scontrol -o show job "$job" | tr ' ' '\n' | sed -n 's/^JobState=//p')
    if [ "$shown" = 0 ] && grep -q "step 10 loss" "$work/slurm-$job.out" 2>/dev/null; then
        echo "== dlrover-hpc status (while training)"
        # Inside the allocation, where the nodes' names resolve (as on a login node).
        timeout 30 srun --jobid="$job" --overlap -N1 -n1 \
            dlrover-hpc status --job-dir "$job_dir" 2>/dev/null || true
        shown=1
    fi
    case "$state" in COMPLETED|FAILED|CANCELLED|TIMEOUT) break ;; esac
    sleep 0.5
done
echo "== job $job: $state"
grep -E "step (24|25|26|60) loss" "$work/slurm-$job.out" || true
echo "== events.jsonl"
python3 - "$job_dir/events.jsonl" <<'PY'
import json, sys
t0 = None
for line in open(sys.argv[1]):
    e = json.loads(line)
    t0 = t0 or e["time"]
    rest = {k: v for k, v in e.items() if k not in ("time", "event")}
    print(f"{e['time'] - t0:7.2f}s  {e['event']:<20} {json.dumps(rest)[:110]}")
PY
[ "$state" = COMPLETED ]
