#!/usr/bin/env bash
# Set up, lint, type-check and run the whole test suite (what CI runs).
# CKPTCONV_DEPS=latest runs the same against the newest release of every dependency (in .venv-latest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
venv=.venv
[ "${CKPTCONV_DEPS:-locked}" = latest ] && venv=.venv-latest
"$venv/bin/ruff" check ckptconv tests scripts
"$venv/bin/mypy"
# two workers (CKPTCONV_TEST_WORKERS): each test module runs whole on one of them, the megatron modules on
# the same one (they share megatron-core's checkpoints); tests/conftest.py groups them
"$venv/bin/python" -m pytest -p no:cacheprovider --durations=15 -n "${CKPTCONV_TEST_WORKERS:-2}" --dist loadgroup "$@"
