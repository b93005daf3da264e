#!/usr/bin/env bash
# Set up, train a tiny model one step with FSDP2 on 2 ranks, save it with dcp.save, convert it with ckptconv
# on 2 ranks (bf16, A_log kept fp32), show both sides, verify, and convert back to DCP. Output in ./demo/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
rm -rf demo && mkdir -p demo
export OMP_NUM_THREADS=1
run() { echo "+ $*" >&2; "$@"; }
run .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 \
  tests/support/workers/make_dcp.py demo/ckpt fsdp2 2> >(grep -v "^W1\|\*\*\*\*\|OMP_NUM_THREADS" >&2)
run .venv/bin/ckptconv inspect demo/ckpt
run .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 \
  -m ckptconv dcp-to-hf demo/ckpt demo/hf --fp32 'A_log$' 2> >(grep -v "^W1\|\*\*\*\*\|OMP_NUM_THREADS" >&2)
run .venv/bin/ckptconv inspect demo/hf
run cat demo/hf/ckptconv_state.json
run .venv/bin/ckptconv verify demo/ckpt demo/hf
run .venv/bin/ckptconv hf-to-dcp demo/hf demo/back --prefix model. --verify
