#!/usr/bin/env bash
# The GPU checks, on a machine with CUDA GPUs and a Python whose torch is a CUDA build (CI has no GPU):
# tests/jobs/test_gpu.py (save_hf / load_hf with nccl, FSDP2 on every GPU, against the CPU job's bytes), then
# the save-hf benchmark on one GPU a rank. Logs and the results file go to LOGDIR (default gpu-out/).
#   PYTHON=python3 bash scripts/gpu.sh [LOGDIR] [GB]
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
logs=${1:-gpu-out}
gb=${2:-4}
mkdir -p "$logs"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$logs/gpus.txt"
"$PYTHON" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())" | tee -a "$logs/gpus.txt"
"$PYTHON" -m pytest -p no:cacheprovider -rs -v tests/jobs/test_gpu.py 2>&1 | tee "$logs/test_gpu.log"
tests=${PIPESTATUS[0]}
gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
"$PYTHON" scripts/bench.py save-hf --device cuda --nproc "$gpus" --gb "$gb" --runs 2 \
  --workdir "${TMPDIR:-/tmp}/ckptconv-gpu-bench" --out "$logs/save_hf_gpu.json" 2>&1 | tee "$logs/bench.log"
bench=${PIPESTATUS[0]}
echo "tests rc=$tests bench rc=$bench"
[ "$tests" = 0 ] && [ "$bench" = 0 ]
