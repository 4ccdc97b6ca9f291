#!/usr/bin/env bash
# Surge against torchrun on one NVIDIA GPU: NCCL, bf16, a GPT-2-small-shaped model
# (bench/jobs/gpt125m.yaml), tokens/s and MFU on one screen, in under 5 minutes.
#
#   bench/gpu.sh [--steps 120] [--warmup 20] [--reps 2] [--peak-tflops T] [--dry-run]
#
# Needs `make setup` with a CUDA build of torch in .venv and nvidia-smi on the PATH;
# --dry-run checks the arguments and the job spec without a GPU. Details: bench/gpu.py.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  echo "error: .venv missing: run make setup first" >&2
  exit 2
fi
exec .venv/bin/python bench/gpu.py "$@"
