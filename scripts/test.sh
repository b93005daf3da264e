#!/usr/bin/env bash
# Set up, lint, type-check and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check ckptconv tests scripts
.venv/bin/mypy
.venv/bin/python -m pytest -p no:cacheprovider "$@"
