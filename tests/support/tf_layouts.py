"""Tiny transformers-5 models of the families `--mapping transformers` covers, built from a config, seeded.

`build(model_type)` is the real class (causal LM, or image-text-to-text for a multimodal model_type) in
float32, its weights from seed 0: `model.state_dict()` is the runtime layout a training job saves with DCP,
`save_pretrained` the layout the release holds. Sizes: hidden 32, vocab 64, 2 layers, 3 experts (two ranks
split them unevenly); the families families.py already builds come from there.
"""

from __future__ import annotations

from typing import Any

import torch
from families import config as family_config

# model_type -> (families.py family, its options); the rest: AutoConfig.for_model with TINY
KNOWN = {
    "qwen3_moe": ("qwen3", {"moe": True, "experts": 3}),
    "deepseek_v3": ("deepseek_v3", {"experts": 3}),
    "gpt_oss": ("gpt_oss", {"experts": 3}),
    "qwen3_5_moe": ("qwen3_5_moe", {"experts": 3}),
}
TINY: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "moe_intermediate_size": 16,
    "num_experts": 3,
    "num_local_experts": 3,
    "n_routed_experts": 3,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "shared_expert_intermediate_size": 16,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "max_position_embeddings": 128,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "tie_word_embeddings": False,
}

# where a family reads a TINY size otherwise (DeepSeek-V2: head_dim is its rotary dims, MLA has as many KV
# heads as query heads); hybrid models get one attention layer in their two, and MoE in the second
OVERRIDES: dict[str, dict[str, Any]] = {
    "deepseek_v2": {"head_dim": 4, "num_key_value_heads": 4},
    "qwen3_next": {"layer_types": ["linear_attention", "full_attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "jamba": {
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
    },
}


def config(model_type: str) -> Any:
    """The tiny config of `model_type`."""
    import transformers as tf

    if model_type in KNOWN:
        family, options = KNOWN[model_type]
        return family_config(family, **options)
    default = tf.AutoConfig.for_model(model_type)
    sizes = {k: v for k, v in TINY.items() if hasattr(default, k)} | OVERRIDES.get(model_type, {})
    return tf.AutoConfig.for_model(model_type, **sizes)


def model_class(model_type: str) -> Any:
    import transformers as tf
    from transformers.models.auto import modeling_auto as ma

    for names in (ma.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        if model_type in names:
            return getattr(tf, names[model_type])
    raise KeyError(model_type)


def build(model_type: str) -> torch.nn.Module:
    """The tiny `model_type` model, seeded, float32, in eval mode."""
    torch.manual_seed(0)
    return model_class(model_type)(config(model_type)).to(torch.float32).eval()


def input_ids(vocab: int = 64) -> torch.Tensor:
    return torch.arange(24).remainder(vocab).view(2, 12)
