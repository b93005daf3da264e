"""Worker of the lora benchmark (scripts/benchmarks/lora.py), run by path in a process of its own.

usage: python lora_peft.py make PATH GB     the checkpoint: PATH/dcp, PATH/config.json, adapter_config.json
       python lora_peft.py merge CKPT OUT   the baseline: PEFT's merge of CKPT, saved to OUT

make: a Llama-shaped model of about GB of fp32 weights (hidden 2048, FFN 5632, vocab 32000, as many layers
as the size takes) wrapped by PEFT with a LoRA of r=16 on every projection (`init_lora_weights=False`, so B
is not zero), saved whole with `dcp.save({"model": peft_model.state_dict()})`. merge: what trainers' merge
scripts do: the model built from its config on the meta device, then `to_empty` (no time goes to a random
init), wrapped with `get_peft_model`, `dcp.load` into its state dict, `merge_and_unload()`, cast to bf16,
`save_pretrained`.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

HIDDEN, FFN, VOCAB, HEADS = 2048, 5632, 32000, 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def model_config(gb: float) -> dict:
    per_layer = 4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN
    layers = max(1, round((gb * 1e9 / 4 - 2 * VOCAB * HIDDEN) / per_layer))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "num_hidden_layers": layers,
        "vocab_size": VOCAB,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def lora_config() -> dict:
    return {"r": 16, "lora_alpha": 32, "target_modules": TARGETS, "init_lora_weights": False}


def make(path: Path, gb: float) -> None:
    """The checkpoint: PATH/dcp, PATH/config.json, PATH/adapter_config.json."""
    import torch
    import torch.distributed.checkpoint as dcp
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = model_config(gb)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**config))
    peft_model = get_peft_model(model, LoraConfig(**lora_config()))
    peft_model.peft_config["default"].save_pretrained(str(tmp))
    dcp.save({"model": peft_model.state_dict()}, checkpoint_id=str(tmp / "dcp"), no_dist=True)
    tmp.rename(path)


def peft_merge(ckpt: Path, out: Path) -> None:
    """The baseline, in this process."""
    import torch
    import torch.distributed.checkpoint as dcp
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**json.loads((ckpt / "config.json").read_text()))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    peft_model = get_peft_model(model, LoraConfig.from_pretrained(str(ckpt)))
    peft_model.to_empty(device="cpu")
    state = {"model": peft_model.state_dict()}
    dcp.load(state, checkpoint_id=str(ckpt / "dcp"), no_dist=True)
    merged = peft_model.merge_and_unload()
    merged.to(torch.bfloat16).save_pretrained(str(out))


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(Path(sys.argv[2]), float(sys.argv[3]))
    else:
        peft_merge(Path(sys.argv[2]), Path(sys.argv[3]))
