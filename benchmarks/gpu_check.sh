#!/usr/bin/env bash
# Runs the kernel tests compiled for a real GPU instead of under the Triton interpreter.
# TRITON_INTERPRET is set to 0 rather than unset: tests/conftest.py defaults it to 1.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device visible to torch" >&2
    exit 1
fi
export TRITON_INTERPRET=0
python -m pytest -q tests/test_kernels.py "$@"
