#!/usr/bin/env bash
# CUDA-IPC checks for a machine with a GPU (under 10 minutes):
#   1. the CUDA tests (pytest -m cuda): a CUDA tensor written by one spawned process and read
#      by another, keep-alive until release, device matched by UUID, and the memory of every
#      ref given back (each IPC share released once); KV pages written GPU to GPU by the
#      same-host PD engine between two processes, every byte checked, VMM memory refused at
#      registration, and SGLang's own managers moving CUDA KV and Mamba state through it;
#   2. bandwidth: 64 MiB CUDA tensors handed over through a ref field and read on the GPU, and
#      KV pages written GPU to GPU by the same-host PD engine against cudaMemcpy in one process.
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
    # SGLang 0.5.23's own PD code, for the backend test with CUDA KV (skipped without it)
    .venv/bin/pip install --quiet --no-deps -r tests/sglang-0.5.23.txt || true
fi
. .venv/bin/activate
nvidia-smi --query-gpu=name,uuid --format=csv,noheader || true
timeout 360 python -m pytest -m cuda -q -p no:cacheprovider tests/test_refs.py tests/test_ipc_accounting.py \
    tests/test_samehost.py tests/test_samehost_gpu.py tests/test_sglang_backend.py
timeout 120 python tools/cuda_bandwidth.py
