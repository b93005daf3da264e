#!/usr/bin/env bash
# The scaling benchmark on a machine with many cores and (optionally) a GPU, e.g. 16 cores, 128 GiB, one
# GPU: dcp-to-hf and hf-to-dcp of a SIZE GB checkpoint at 1, 2, 4 and 8 ranks on the CPU (torchrun, gloo),
# then save_hf / load_hf on every GPU against full_tensor + a rank-0 save and dcp.load (skipped, with a note,
# without CUDA). Needs about 3x SIZE GB of disk under WORKDIR; logs and the results file go to LOGDIR.
#   PYTHON=python3 bash scripts/scaling.sh [LOGDIR] [SIZE] [RANKS] [WORKDIR]
#   bash scripts/scaling.sh scaling-out 0.05 1,2     # a smoke test anywhere
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
logs=${1:-scaling-out}
size=${2:-16}
ranks=${3:-1,2,4,8}
work=${4:-bench-out/scaling}
mkdir -p "$logs"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{ nproc; free -g | head -2; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo "no GPU"; \
  df -h "$(dirname "$work")" | tail -1; } | tee "$logs/machine.txt"
"$PYTHON" scripts/bench.py scaling --sizes "$size" --ranks "$ranks" --runs "${RUNS:-1}" --workdir "$work" \
  --out "$logs/scaling.json" 2>&1 | tee "$logs/scaling.log"
rc=${PIPESTATUS[0]}
rm -rf "$work"  # the checkpoints: 2x SIZE GB
echo "scaling rc=$rc"
exit "$rc"
