#!/usr/bin/env bash
# The demo job on the local Slurm (brought up by `make demo`).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== srun -N4 hostname: four nodes, four host names"
timeout 60 srun -N4 hostname | sort
