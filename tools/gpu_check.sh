#!/usr/bin/env bash
# CUDA-IPC checks for a machine with a GPU (under 5 minutes):
#   1. the CUDA tests (pytest -m cuda): a CUDA tensor written by one spawned process and read
#      by another, keep-alive until release, device matched by UUID, and the memory of every
#      ref given back (each IPC share released once); a CUDA allocation refused by the
#      same-host PD engine at registration (it moves host memory only);
#   2. a bandwidth figure: 64 MiB CUDA tensors handed over through a ref field and read on the GPU.
# Usage, from the repository root: bash tools/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    # a CUDA machine brings its own torch build (seen through the system's site-packages),
    # which shmslots._tensors compiles against
    python3 -m venv --system-site-packages .venv
    .venv/bin/python -c 'import torch' || { echo "no torch on this machine" >&2; exit 1; }
    .venv/bin/pip install --quiet 'setuptools>=77' wheel
    .venv/bin/pip install --quiet --no-build-isolation -e '.[test]'
fi
. .venv/bin/activate
nvidia-smi --query-gpu=name,uuid --format=csv,noheader || true
timeout 240 python -m pytest -m cuda -q -p no:cacheprovider tests/test_refs.py tests/test_ipc_accounting.py \
    tests/test_samehost.py
timeout 120 python tools/cuda_bandwidth.py
