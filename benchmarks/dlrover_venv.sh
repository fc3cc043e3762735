#!/usr/bin/env bash
# Builds (idempotently) the virtual environment that runs DLRover 0.6.1 for
# benchmarks/checkpoint.py: torch 2.13.0 (the CPU wheel on local disk) + dlrover 0.6.1 + the
# local master's dependencies (grpcio, tornado, kubernetes, protobuf), as in
# shared/research/baselines-measured.md section 1.  DLRover is installed with --no-deps so
# that its requirements can never replace torch; its runtime deps are listed by hand.
#
#     bash benchmarks/dlrover_venv.sh [VENV]      # default: <repo>/.venv-dlrover
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${1:-$REPO/.venv-dlrover}
TORCH=2.13.0
DLROVER=0.6.1
DEPS=(grpcio tornado kubernetes protobuf psutil packaging requests deprecated pynvml numpy)

if [[ ! -x $VENV/bin/python ]]; then
    python3 -m venv "$VENV"
fi
PY=$VENV/bin/python

have() {  # have DIST VERSION: the venv holds exactly that version
    [[ $("$PY" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null) == "$2"* ]]
}

have torch "$TORCH" || "$PY" -m pip install --quiet "torch==$TORCH"
have dlrover "$DLROVER" || "$PY" -m pip install --quiet --no-deps "dlrover==$DLROVER"
"$PY" -m pip install --quiet "${DEPS[@]}" 2> >(grep -v "is ignored: it is neither" >&2)

# Fail here, not in the benchmark, when something is missing.
"$PY" - <<EOF
import importlib.metadata as m
import torch, dlrover.trainer.torch.flash_checkpoint.ddp  # noqa: F401
import dlrover.python.master.main  # noqa: F401  (needs grpc, kubernetes, protobuf, tornado)
assert torch.__version__.startswith("$TORCH"), torch.__version__
assert m.version("dlrover") == "$DLROVER", m.version("dlrover")
print("ok: $VENV torch", torch.__version__, "dlrover", m.version("dlrover"))
EOF
test -x "$VENV/bin/dlrover-run"
