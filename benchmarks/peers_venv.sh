#!/usr/bin/env bash
# Builds (idempotently) the virtual environment of the peers that benchmarks/side_by_side.py
# runs beside dlrover-run: torch 2.13.0 (the CPU wheel on local disk), NVIDIA's
# nvidia-resiliency-ext (ft_launcher) and torchft.  Kept apart from the project's venv so that
# neither can replace the other's torch or dependencies.
#
#     bash benchmarks/peers_venv.sh [VENV]      # default: <repo>/.venv-peers
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${1:-$REPO/.venv-peers}
TORCH=2.13.0
NVRX=0.4.1     # the newest nvidia-resiliency-ext with a wheel for this Python on the index
TORCHFT=0.2.0

if [[ ! -x $VENV/bin/python ]]; then
    python3 -m venv "$VENV"
fi
PY=$VENV/bin/python

have() {  # have DIST VERSION: the venv holds exactly that version
    [[ $("$PY" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null) == "$2"* ]]
}

quiet() { "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
have torch "$TORCH" || quiet "$PY" -m pip install --quiet "torch==$TORCH"
have nvidia-resiliency-ext "$NVRX" || quiet "$PY" -m pip install --quiet "nvidia-resiliency-ext==$NVRX" "torch==$TORCH"
have torchft "$TORCHFT" || quiet "$PY" -m pip install --quiet "torchft==$TORCHFT" "torch==$TORCH"

"$PY" - <<PYEOF
import importlib.metadata as m
import torch
assert torch.__version__.startswith("$TORCH"), torch.__version__
for dist in ("nvidia-resiliency-ext", "torchft"):
    print(dist, m.version(dist))
PYEOF
test -x "$VENV/bin/torchrun" && test -x "$VENV/bin/ft_launcher"
