#!/usr/bin/env bash
# Create .venv (if missing) and install ckptconv with its test tools. torch is pinned to the CPU build tested.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q "torch==2.13.0" -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, ckptconv; print('ckptconv', ckptconv.__version__, 'torch', torch.__version__)"
