#!/usr/bin/env bash
# A CI release job: convert a training checkpoint to HF safetensors and prove the result is the checkpoint.
# The job fails (non-zero exit) on any mismatch or bad input; the JSON reports are kept as artifacts.
#
# usage: examples/ci-convert.sh CKPT OUT [--check-only]
#   CKPT  DCP checkpoint directory written by the training job
#   OUT   HF directory to write (replaced if it exists); OUT.convert.json and OUT.report.json are written
#   --check-only  skip the conversion, only verify an existing OUT against CKPT
set -euo pipefail
ckpt=$1
out=$2

if [[ "${3:-}" != "--check-only" ]]; then
  # bf16 release, the Mamba A_log parameters kept fp32; --verify re-reads OUT before publishing it
  ckptconv dcp-to-hf "$ckpt" "$out" --fp32 'A_log$' --overwrite --verify --json > "$out.convert.json"
fi

# An independent check: exit 0 = identical, 1 = mismatch (each key listed), 2 = bad input
status=0
ckptconv verify "$ckpt" "$out" --json > "$out.report.json" || status=$?
if [[ $status -ne 0 ]]; then
  python3 - "$out.report.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1])) if open(sys.argv[1]).read().strip() else {"mismatches": []}
for m in doc["mismatches"]:
    print(f"MISMATCH {m['key']}: {m['kind']} {m.get('differing', '')}")
PY
  exit $status
fi
echo "OK: $(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['compared'], 'tensors verified')" "$out.report.json")"
