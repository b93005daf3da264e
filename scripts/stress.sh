#!/usr/bin/env bash
# Longer reliability runs than CI: fuzzing of every file kind and random round trips through real DCP jobs.
# usage: bash scripts/stress.sh [FUZZ_EXAMPLES] [ROUNDTRIP_SEEDS] [MAPPING_EXAMPLES]  (2000, 20, 500: ~20 min)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
export CKPTCONV_FUZZ_EXAMPLES=${1:-2000}
export CKPTCONV_ROUNDTRIP_SEEDS=${2:-20}
export CKPTCONV_MAPPING_EXAMPLES=${3:-500}
.venv/bin/python -m pytest -q -p no:cacheprovider tests/fuzz/test_fuzz.py tests/jobs/test_roundtrip.py tests/commands/test_mapping_property.py tests/jobs/test_faults.py
