#!/usr/bin/env bash
# CUDA-IPC checks for a machine with a GPU (under 10 minutes):
#   1. the CUDA tests (pytest -m cuda): a CUDA tensor written by one spawned process and read
#      by another, keep-alive until release, device matched by UUID, and the memory of every
#      ref given back (each IPC share released once); KV pages written GPU to GPU by the
#      same-host PD engine between two processes (one batch call, and a call per block),
#      every byte checked; VMM memory refused where a peer would write it, and sent from
#      where it is only a source (a prefill's); a decode SIGKILLed under the writes; and
#      SGLang's own managers moving CUDA KV and Mamba state through it (the prefill's on
#      cudaMalloc memory, then on VMM memory);
#   2. bandwidth: 64 MiB CUDA tensors handed over through a ref field and read on the GPU, and
#      KV pages written GPU to GPU by the same-host PD engine against cudaMemcpy in one process.
# Usage, from the repository root: bash tools/gpu_check.sh
# It runs in .venv where one exists; else it installs shmslots (editable) into the Python that
# holds the machine's CUDA torch (PYTHON, or python3), which is often itself a virtual
# environment: a venv made from that one would not see its torch.  Where that Python is the
# system's and refuses installs (PEP 668, "externally managed"), make .venv yourself with
# --system-site-packages first.  With no package index (PIP_NO_INDEX=1), shmslots' own
# dependencies, setuptools>=77 among them, must already be importable.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
else
    PY=${PYTHON:-python3}
    "$PY" -c 'import torch' || { echo "no torch for $PY on this machine" >&2; exit 1; }
    # shmslots._tensors compiles against that torch
    "$PY" -m pip install --quiet 'setuptools>=77' wheel  # pyproject's license string
    "$PY" -m pip install --quiet --no-build-isolation -e . pytest pytest-timeout
    # SGLang 0.5.23's own PD code, for the backend test with CUDA KV (skipped without it)
    "$PY" -m pip install --quiet --no-deps -r tests/sglang-0.5.23.txt ||
        echo "SGLang 0.5.23 not installed: its CUDA backend test will skip" >&2
fi
nvidia-smi --query-gpu=name,uuid,driver_version --format=csv,noheader || true
"$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)'
status=0
timeout 360 "$PY" -m pytest -m cuda -q -rA -p no:cacheprovider tests/test_refs.py \
    tests/test_ipc_accounting.py tests/test_samehost.py tests/test_samehost_gpu.py \
    tests/test_sglang_backend.py || status=$?
timeout 180 "$PY" tools/cuda_bandwidth.py || status=$?
exit $status
