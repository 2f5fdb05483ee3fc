#!/usr/bin/env bash
# The suite on one GPU, sized to finish in under 8 minutes: the GPT-style
# model (6 layers, d=512, seq 512) in every mode, a one-probe batch search,
# and the depth sweep at 4, 8 and 16 layers. Results: bench/results/cuda/.
#
#   bash bench/cuda_check.sh            # or: bash bench/cuda_check.sh --modes compile ckpt
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device: torch.cuda.is_available() is False")'
exec "$PY" -m bench --cuda-quick --out bench/results/cuda "$@"
