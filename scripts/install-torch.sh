#!/usr/bin/env bash
# Install torch into the given interpreter's environment, unless one is already importable.
# Where no NVIDIA GPU is present a CPU build is chosen: torch==$TORCH_CPU_VERSION, which these
# machines serve from a local CPU wheel. Set TORCH_INDEX_URL to a CPU wheel index elsewhere, or
# TORCH_SPEC to install something else entirely.
set -euo pipefail
py="$1"
if "$py" -c "import torch" 2>/dev/null; then
    echo "torch $("$py" -c 'import torch; print(torch.__version__)') already installed; keeping it"
    exit 0
fi
if [ -n "${TORCH_SPEC:-}" ]; then
    spec="$TORCH_SPEC"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    spec="torch>=2.4"
else
    spec="torch==${TORCH_CPU_VERSION:-2.13.0}"
fi
echo "installing $spec"
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    "$py" -m pip install --index-url "$TORCH_INDEX_URL" "$spec"
else
    "$py" -m pip install "$spec"
fi
