"""A torchtitan 0.3.0 model wrapped by PEFT with LoRA, saved whole with DCP, and PEFT's merge of it in HF
names: the input and the oracle of `dcp-to-hf --mapping torchtitan-FAMILY --lora ...` (interop/test_lora.py).

    python titan_peft.py FAMILY HF_BASE_DIR LORA_CONFIG_JSON OUT_DIR     (torchtitan's install on PYTHONPATH)

The model is built from HF_BASE_DIR's config.json with torchtitan's own config helpers (titan_adapter.py)
and loaded with torchtitan's own StateDictAdapter `from_hf`; `get_peft_model` wraps it with the LoraConfig
(B made non-zero by `init_lora_weights: false`, seeded). Then OUT_DIR/dcp: `dcp.save({"model":
peft_model.state_dict()})`, and OUT_DIR/merged.safetensors: the adapter's `to_hf` of
`peft_model.merge_and_unload().state_dict()`.
"""

import importlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from titan_adapter import FAMILIES


def main() -> None:
    family, base, config, out = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3]), Path(sys.argv[4])
    build, module, name = FAMILIES[family]
    model_config = build(json.loads((base / "config.json").read_text()))
    adapter = getattr(importlib.import_module(module), name)(model_config, str(base))
    torch.manual_seed(0)
    model = model_config.build()
    hf_state: dict[str, torch.Tensor] = {}
    for file in sorted(base.glob("*.safetensors")):
        hf_state.update(load_file(file))
    missing, unexpected = model.load_state_dict(adapter.from_hf(hf_state), strict=False)
    assert not unexpected and all("freqs_cis" in k or "expert_bias" in k for k in missing), (
        missing,
        unexpected,
    )
    peft_model = get_peft_model(model, LoraConfig(**config, init_lora_weights=False))
    out.mkdir(parents=True, exist_ok=True)
    dcp.save({"model": peft_model.state_dict()}, checkpoint_id=str(out / "dcp"), no_dist=True)
    merged = {k: v for k, v in peft_model.merge_and_unload().state_dict().items() if "freqs_cis" not in k}
    save_file({k: v.contiguous() for k, v in adapter.to_hf(merged).items()}, str(out / "merged.safetensors"))
    print("titan_peft: saved")


if __name__ == "__main__":
    main()
