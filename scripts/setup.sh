#!/usr/bin/env bash
# Create .venv and install lpcompile with what its demo and tests need.
# On a machine without an NVIDIA GPU this installs torch's CPU build and never
# downloads a CUDA build: the local CPU wheel when the machine has one, else
# PyTorch's CPU package index.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        "${pip[@]}" "torch>=2.13"
    elif ls /opt/wheels/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
        "${pip[@]}" torch==2.13.0
    else
        "${pip[@]}" torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    fi
fi
"${pip[@]}" -e ".[test]"
.venv/bin/python -c "import torch, lpcompile; print('lpcompile ready: torch', torch.__version__)"
