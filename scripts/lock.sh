#!/usr/bin/env bash
# Re-resolve the lock: install ckptconv with its test tools into a fresh venv from the newest releases
# (torch pinned to the CPU build tested), then write every installed version to constraints.txt.
# scripts/setup.sh installs from that file; `CKPTCONV_DEPS=latest` ignores it. The same versions, with each
# file's URL and sha256, go to pylock.toml (PEP 751, `pip lock`) for tools that read the standard format;
# tests/unit/test_pure.py checks that the two agree.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"${PYTHON:-$(command -v /usr/bin/python3 || command -v python3)}" -m venv "$tmp/venv"  # CI's Python (Debian 3.11.2): a pin must install there
quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }  # pip's own status still fails the script
quiet "$tmp/venv/bin/python" -m pip install -q --upgrade pip
quiet "$tmp/venv/bin/python" -m pip install -q "torch==2.13.0" -e ".[test,docs]"
{
  echo "# The lock: every package scripts/setup.sh installs, at the versions tested. Made by scripts/lock.sh."
  "$tmp/venv/bin/python" -m pip freeze --all --exclude-editable | sed 's/^torch==\(.*\)+cpu$/torch==\1/'
} > constraints.txt
quiet "$tmp/venv/bin/python" -m pip lock -q -c constraints.txt "torch==2.13.0" ".[test,docs]" -o pylock.toml
echo "wrote constraints.txt ($(grep -vc '^#' constraints.txt) packages) and pylock.toml"
