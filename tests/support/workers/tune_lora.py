"""A torchtune 0.6.1 LoRA (or DoRA) Llama 3, saved whole with DCP, and torchtune's own conversions of it:
the input and the oracles of `dcp-to-hf --mapping torchtune-llama3 --lora ...` (tests/interop/test_lora.py).

    python tune_lora.py OUT_DIR [dora]        (torchtune's install on PYTHONPATH: tests/support/tune.py)

A tiny `lora_llama3` (LoRA r=4, alpha=8 on q_proj, k_proj, v_proj, output_proj and the MLP; with `dora`,
DoRA on v_proj and output_proj only, whose weights the mapping renames), seeded, B made non-zero as training
makes it (and DoRA's magnitude initialised by torchtune's `initialize_dora_magnitude`). Written:
  OUT_DIR/dcp                 `dcp.save({"model": model.state_dict()})`
  OUT_DIR/config.json         the HF config.json of that model (heads, sizes) for the mapping
  OUT_DIR/adapter/            torchtune's `tune_to_peft_adapter_weights` (adapter_model.safetensors) and
                              `tune_to_peft_adapter_config` (adapter_config.json)
  OUT_DIR/merged.safetensors  torchtune's `get_merged_lora_ckpt`, then `tune_to_hf`
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torchtune.models import convert_weights
from torchtune.models.llama3 import lora_llama3
from torchtune.modules.peft import get_merged_lora_ckpt

HEADS, KV_HEADS, DIM, VOCAB, LAYERS, FFN, RANK, ALPHA = 4, 2, 32, 64, 2, 64, 4, 8.0


def main() -> None:
    out = Path(sys.argv[1])
    dora = len(sys.argv) > 2 and sys.argv[2] == "dora"
    torch.manual_seed(0)
    modules = ["v_proj", "output_proj"] if dora else ["q_proj", "k_proj", "v_proj", "output_proj"]
    model = lora_llama3(
        lora_attn_modules=modules,
        apply_lora_to_mlp=not dora,
        vocab_size=VOCAB,
        num_layers=LAYERS,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        embed_dim=DIM,
        max_seq_len=64,
        intermediate_dim=FFN,
        lora_rank=RANK,
        lora_alpha=ALPHA,
        use_dora=dora,
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_b" in name:  # zero at init; a trained adapter's is not
                p.normal_(0, 0.1)
        if dora:
            for m in model.modules():
                if hasattr(m, "initialize_dora_magnitude"):
                    m.initialize_dora_magnitude()
    state = model.state_dict()
    out.mkdir(parents=True, exist_ok=True)
    dcp.save({"model": state}, checkpoint_id=str(out / "dcp"), no_dist=True)
    hf_config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": DIM,
        "intermediate_size": FFN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": LAYERS,
        "vocab_size": VOCAB,
        "tie_word_embeddings": False,
    }
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    lora = {k: v for k, v in state.items() if "lora" in k or "magnitude" in k}
    adapter = convert_weights.tune_to_peft_adapter_weights(lora, HEADS, KV_HEADS, DIM)
    (out / "adapter").mkdir(exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in adapter.items()}, str(out / "adapter" / "adapter_model.safetensors")
    )
    config = {
        "r": RANK,
        "lora_alpha": ALPHA,
        "target_modules": modules + ([] if dora else ["w1", "w2", "w3"]),
    }
    peft_config = convert_weights.tune_to_peft_adapter_config(config)
    peft_config["peft_type"] = "LORA"
    peft_config["use_dora"] = dora
    (out / "adapter" / "adapter_config.json").write_text(json.dumps(peft_config, indent=2))
    merged = get_merged_lora_ckpt(dict(state), rank=RANK, alpha=ALPHA)
    hf = convert_weights.tune_to_hf(merged, HEADS, KV_HEADS, DIM)
    save_file({k: v.contiguous() for k, v in hf.items()}, str(out / "merged.safetensors"))
    print("tune_lora: saved")


if __name__ == "__main__":
    main()
