#!/usr/bin/env bash
# One-command GPU qualification of Surge on every GPU of this machine: DDP, FSDP2, TP and
# FSDP2 x TP at bf16 on a ~1 B-parameter Llama-shaped model (bench/jobs/llama1b.yaml),
# torch.compile off and on, tokens/s and MFU, a SIGKILL with rebuild in place over NCCL,
# a save and a restore; a table and bench/results/gpu.json, in under 8 minutes.
#
#   bench/gpu.sh [--gpus N (default: every GPU)] [--compile both|off|on] [--peak-tflops T] [--budget-s 480] [--dry-run]
#
# --dry-run (no GPU; what CI runs) builds and validates every configuration's job spec and
# prints the plan. Details and every flag: bench/gpu.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
if [ ! -x "$PY" ]; then
  echo "error: .venv missing: run make setup first" >&2
  exit 2
fi
dry=0  # --dry-run and --help need no GPU
for arg in "$@"; do case "$arg" in --dry-run | --help | -h) dry=1 ;; esac; done
if [ "$dry" = 0 ]; then
  # `make setup` installs the CPU wheel; on a GPU machine a CUDA torch may live system-wide
  # instead. Say which in one line rather than fail later inside a rank.
  if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    venv_torch=$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo "none")
    hint="install a CUDA build into .venv (.venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128)"
    if command -v python3 >/dev/null && python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
      hint="python3 on the PATH has a CUDA torch ($(python3 -c 'import torch; print(torch.__version__)')): recreate .venv with python3 -m venv --system-site-packages, or $hint"
    fi
    echo "error: the venv's torch ($venv_torch) cannot use a GPU (no CUDA build, or no GPU visible): $hint" >&2
    exit 2
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" bench/gpu.py "$@"
