#!/usr/bin/env bash
# Create the venv (if missing) and install ckptconv with its test tools.
#   CKPTCONV_DEPS=locked (default): .venv, every package at the version in constraints.txt.
#   CKPTCONV_DEPS=latest: .venv-latest, the newest release of every dependency that pyproject.toml admits.
# torch is the CPU build 2.13.0 in both: a newer or unpinned torch is a multi-GB CUDA download.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
case "${CKPTCONV_DEPS:-locked}" in
  locked) venv=.venv; pins=(-c constraints.txt) ;;
  latest) venv=.venv-latest; pins=(--upgrade --upgrade-strategy eager) ;;
  *) echo "setup.sh: CKPTCONV_DEPS must be 'locked' or 'latest'" >&2; exit 2 ;;
esac
if [ ! -x "$venv/bin/python" ]; then
  "$PYTHON" -m venv "$venv"
fi
quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }  # pip's own status still fails the script
# pip and the build backend first, from the same pins: the editable install is built with them
quiet "$venv/bin/python" -m pip install -q "${pins[@]}" pip setuptools
PYTHONWARNINGS=ignore quiet "$venv/bin/python" -m pip install -q "${pins[@]}" --no-build-isolation "torch==2.13.0" -e ".[test,docs]"
"$venv/bin/python" -m pip check >/dev/null || { "$venv/bin/python" -m pip check >&2; exit 1; }
"$venv/bin/python" -c "import torch, typer, ckptconv; print('ckptconv', ckptconv.__version__, 'torch', torch.__version__, 'typer', typer.__version__)"
