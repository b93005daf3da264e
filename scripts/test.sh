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
# the layers: a folder of ckptconv/ imports only folders below it, and no import cycle ([tool.importlinter])
PYTHONPATH=$PWD "$venv/bin/lint-imports"
# the documentation site: a broken link or reference fails (--strict); the CLI reference is generated from the app
NO_MKDOCS_2_WARNING=1 "$venv/bin/mkdocs" build --strict --quiet --site-dir "$(mktemp -d)"
# two workers (CKPTCONV_TEST_WORKERS): each test module runs whole on one of them (`--dist loadfile`), so its
# module- and session-scoped checkpoints are built once. Not `--dist loadgroup`: with pytest 9 xdist's groups
# are silently ignored (it renames `item._nodeid`, which pytest 9 no longer reads), and every test was its own
# unit, megatron-core's checkpoints built on both workers (2 x 110 s in CI).
"$venv/bin/python" -m pytest -p no:cacheprovider --durations=15 -n "${CKPTCONV_TEST_WORKERS:-2}" --dist loadfile "$@"
