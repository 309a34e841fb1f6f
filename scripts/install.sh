#!/usr/bin/env bash
# Create .venv and install epd with its test tools. On a machine without a GPU,
# torch comes from the CPU wheel; on GPU hosts install a CUDA build of torch into
# .venv first (see README "GPU hosts") and this script keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install -q "torch==2.13.0" || .venv/bin/pip install -q "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
fi
.venv/bin/pip install -q -e ".[dev]"
