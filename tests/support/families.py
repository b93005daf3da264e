"""Tiny, randomly initialised transformers checkpoints of the model families torchtitan 0.3.0 converts.

`tiny(family, path, **options)` builds the model from its transformers 5.23 config class (no network), seeded,
and writes it with `save_pretrained` in float32 (config.json, generation_config.json, model.safetensors):
hidden 16-32, vocab 64, 2-4 layers, 4 experts (`experts=3`: a count two ranks split unevenly), so it saves
in well under 2 s. `auto_class` is the Auto
class that loads it back.

- llama: LlamaForCausalLM, 4 heads of 8, 2 KV heads. `tie=True`: tied embeddings (no lm_head saved).
- qwen3: Qwen3ForCausalLM; `moe=True`: Qwen3MoeForCausalLM (every layer MoE, saved per expert as
  mlp.experts.{e}.{gate,up,down}_proj.weight; its config.json says num_local_experts, not num_experts).
- deepseek_v3: DeepseekV3ForCausalLM, MLA (q_lora_rank 16, kv_lora_rank 16, nope 8 / rope 4 / v 8), layer 0
  dense, layer 1 MoE with a shared expert. `q_lora=False`: q_proj instead of q_a/q_b. `mtp=N`: N
  multi-token-prediction layers, appended by tiny() itself (see `_append_mtp`).
- gpt_oss: GptOssForCausalLM; experts in the bf16 layout, mlp.experts.gate_up_proj [E, hidden, 2 * I] with
  gate and up interleaved on the last dim (gate = [..., ::2]), down_proj [E, I, hidden], plus their biases.
- qwen3_5: Qwen3_5ForConditionalGeneration: 3 gated delta-net layers and 1 full-attention layer (q_proj with
  its output gate, head_dim 32, mrope_section [2, 1, 1]), and a 2-block vision tower (Conv3d patches).
- qwen3_5_moe: Qwen3_5MoeForConditionalGeneration, the same with MoE layers (shared expert with a gate);
  saved per expert. `fused_experts=True`: rewritten as mlp.experts.gate_up_proj [E, 2I, H] and down_proj
  [E, H, I], the layout of the loaded parameters, which from_pretrained also reads (`_fuse_experts`).
- kimi_k25: Kimi_K25ForConditionalGeneration: a DeepseekV3 text model (as above) and a 2-block MoonViT tower.
  save_pretrained's own key spelling differs from the released checkpoints; `released=True` rewrites it to
  the released one (`_KIMI_RELEASED`).
- muse_glimmer: MuseGlimmerForConditionalGeneration: 4 text layers (3 sliding-window, 1 global NoPE) with an
  attention output gate, FFN 3 * hidden as torchtitan assumes, a 2-layer vision tower, adapter, projection.

Sizes are in config.json at the top level for the causal LMs and under text_config / vision_config for the
three multimodal ones (vision: qwen3_5 depth / num_heads, kimi_k25 and muse_glimmer num_hidden_layers /
num_attention_heads).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

SEED = 0

# name -> (transformers class to save, Auto class that loads it back)
CLASSES = {
    "llama": ("LlamaForCausalLM", "AutoModelForCausalLM"),
    "qwen3": ("Qwen3ForCausalLM", "AutoModelForCausalLM"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "AutoModelForCausalLM"),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "AutoModelForCausalLM"),
    "gpt_oss": ("GptOssForCausalLM", "AutoModelForCausalLM"),
    "qwen3_5": ("Qwen3_5ForConditionalGeneration", "AutoModelForImageTextToText"),
    "qwen3_5_moe": ("Qwen3_5MoeForConditionalGeneration", "AutoModelForImageTextToText"),
    "kimi_k25": ("Kimi_K25ForConditionalGeneration", "AutoModelForImageTextToText"),
    "muse_glimmer": ("MuseGlimmerForConditionalGeneration", "AutoModelForImageTextToText"),
}
FAMILIES = ("llama", "qwen3", "deepseek_v3", "gpt_oss", "qwen3_5", "qwen3_5_moe", "kimi_k25", "muse_glimmer")

_TEXT = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}


def _deepseek_text(q_lora: bool = True, mtp: int = 0, experts: int = 4) -> dict[str, Any]:
    return {
        **_TEXT,
        "moe_intermediate_size": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_shared_experts": 1,
        "n_routed_experts": experts,
        "num_experts_per_tok": 2,
        "n_group": 2 if experts % 2 == 0 else 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "kv_lora_rank": 16,
        "q_lora_rank": 16 if q_lora else None,
        "qk_rope_head_dim": 4,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
        "num_mtp_layers": mtp,
        "tie_word_embeddings": False,
    }


def _qwen3_5_text(moe: bool, experts: int = 4) -> dict[str, Any]:
    text = {
        **_TEXT,
        "num_hidden_layers": 4,  # layer_types: linear, linear, linear, full (full_attention_interval 4)
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        # rotary_dim = head_dim * partial_rotary_factor 0.25 = 8, and mrope_section must sum to rotary_dim / 2
        "head_dim": 32,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "tie_word_embeddings": False,
    }
    if moe:
        text |= {
            "moe_intermediate_size": 8,
            "shared_expert_intermediate_size": 16,
            "num_experts": experts,
            "num_experts_per_tok": 2,
        }
        del text["intermediate_size"]
    return text


_QWEN3_5_VISION = {
    "depth": 2,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_heads": 2,
    "in_channels": 3,
    "patch_size": 4,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": 32,
    "num_position_embeddings": 16,
}


def config(family: str, **options: Any) -> Any:
    """The transformers config object `tiny` saves for `family`."""
    import transformers as tf

    if family == "llama":
        return tf.LlamaConfig(
            **_TEXT,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            tie_word_embeddings=options.get("tie", False),
        )
    if family == "qwen3" and not options.get("moe"):
        return tf.Qwen3Config(
            **_TEXT, num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False
        )
    if family == "qwen3":
        return tf.Qwen3MoeConfig(
            **_TEXT,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            moe_intermediate_size=8,
            num_experts=options.get("experts", 4),
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            tie_word_embeddings=False,
        )
    if family == "deepseek_v3":
        return tf.DeepseekV3Config(
            **_deepseek_text(options.get("q_lora", True), options.get("mtp", 0), options.get("experts", 4))
        )
    if family == "gpt_oss":
        return tf.GptOssConfig(
            num_hidden_layers=2,
            num_local_experts=options.get("experts", 4),
            vocab_size=64,
            hidden_size=32,
            intermediate_size=24,
            head_dim=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=8,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
        )
    if family in ("qwen3_5", "qwen3_5_moe"):
        cls = tf.Qwen3_5Config if family == "qwen3_5" else tf.Qwen3_5MoeConfig
        return cls(
            text_config=_qwen3_5_text(family == "qwen3_5_moe", options.get("experts", 4)),
            vision_config=dict(_QWEN3_5_VISION),
            tie_word_embeddings=False,
        )
    if family == "kimi_k25":
        return tf.Kimi_K25Config(
            text_config={"model_type": "deepseek_v3", **_deepseek_text(experts=options.get("experts", 4))},
            vision_config={
                "patch_size": 4,
                "pos_emb_height": 4,
                "pos_emb_width": 4,
                "pos_emb_time": 2,
                "num_attention_heads": 2,
                "num_hidden_layers": 2,
                "hidden_size": 16,
                "intermediate_size": 32,
                "merge_kernel_size": [2, 2],
            },
            projection_hidden_size=16,
            tie_word_embeddings=False,
        )
    if family == "muse_glimmer":
        return tf.MuseGlimmerConfig(
            text_config={
                **_TEXT,
                "intermediate_size": 96,  # torchtitan's muse_glimmer fixes the FFN at 3 * hidden_size
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 8,
                "sliding_window": 8,
                "bos_token_id": None,
                "eos_token_id": None,
                "tie_word_embeddings": False,
            },
            vision_config={
                "patch_size": 4,
                "pos_emb_height": 4,
                "pos_emb_width": 4,
                "num_attention_heads": 2,
                "num_hidden_layers": 2,
                "hidden_size": 16,
                "intermediate_size": 32,
                "patch_temporal": 2,
                "merge_size": 2,
            },
            out_hidden_size=64,
            projector_hidden_size=32,
        )
    raise ValueError(f"unknown family {family!r}")


def tiny(family: str, path: Path, **options: Any) -> Path:
    """Save a tiny seeded `family` model under `path` (created) with `save_pretrained`; returns `path`."""
    import transformers as tf

    cfg = config(family, **options)
    key = "qwen3_moe" if family == "qwen3" and options.get("moe") else family
    cls = getattr(tf, CLASSES[key][0])
    torch.manual_seed(SEED)
    model = cls(cfg).to(torch.float32)
    path = Path(path)
    model.save_pretrained(path)
    if family == "deepseek_v3" and options.get("mtp"):
        _append_mtp(path, cfg.num_hidden_layers, options["mtp"])
    if family == "qwen3_5_moe" and options.get("fused_experts"):
        _rewrite(path, _fuse_experts)
    if family == "kimi_k25" and options.get("released"):
        _rewrite(path, _kimi_released)
    return path


def _rewrite(path: Path, fn: Any) -> None:
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    save_file(fn(load_file(file)), file, metadata={"format": "pt"})


def _fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight` (what transformers 5.23 saves for Qwen3.5-MoE)
    -> the fused `mlp.experts.gate_up_proj` [E, 2 * I, H] (gate rows, then up rows) and
    `mlp.experts.down_proj` [E, H, I]: the layout of Qwen3_5MoeExperts' own parameters, which
    from_pretrained loads as is."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for key, value in tensors.items():
        match = re.fullmatch(r"(.*\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight", key)
        if match is None:
            out[key] = value
        else:
            experts.setdefault(match[1], {}).setdefault(int(match[2]), {})[match[3]] = value
    for prefix, by_expert in experts.items():
        ordered = [by_expert[e] for e in sorted(by_expert)]
        out[prefix + "gate_up_proj"] = torch.stack([torch.cat([w["gate"], w["up"]]) for w in ordered])
        out[prefix + "down_proj"] = torch.stack([w["down"] for w in ordered])
    return out


# save_pretrained of Kimi_K25ForConditionalGeneration runs transformers' load-time renames backwards, and
# three of them do not invert to the released Kimi-K2.5 names: `blocks -> layers` (meant for the vision
# tower) turns every text layer into `language_model.model.blocks.N`, the projector's pre_norm keeps the
# `model.` prefix, and `vision_tower.encoder -> model.vision_tower` moves the patch embedding under
# `encoder`. from_pretrained reads both spellings.
_KIMI_RELEASED = (
    (r"^language_model\.model\.blocks\.", "language_model.model.layers."),
    (r"^model\.mm_projector\.", "mm_projector."),
    (r"^vision_tower\.encoder\.patch_embed\.", "vision_tower.patch_embed."),
)


def _kimi_released(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in tensors.items():
        for pattern, replacement in _KIMI_RELEASED:
            key = re.sub(pattern, replacement, key)
        out[key] = value
    return out


def _append_mtp(path: Path, num_hidden_layers: int, count: int) -> None:
    """Add `count` multi-token-prediction layers to a saved DeepseekV3ForCausalLM, as the released DeepSeek-V3
    checkpoints carry them: `model.layers.{num_hidden_layers + i}.*` holding a whole decoder layer (the keys
    and shapes of the last one, a MoE layer) plus enorm, hnorm, eh_proj [hidden, 2 * hidden],
    shared_head.norm,
    and copies of the model's embed_tokens and lm_head as embed_tokens and shared_head.head.

    transformers 5.23 does not create these: DeepseekV3ForCausalLM has no MTP module (num_mtp_layers /
    num_nextn_predict_layers in config.json only feeds its separate MtpModel for speculative decoding), so
    save_pretrained writes none and tiny() appends them, seeded, to model.safetensors."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(file)
    last = f"model.layers.{num_hidden_layers - 1}."
    block = {k[len(last) :]: v for k, v in tensors.items() if k.startswith(last)}
    embed, head = tensors["model.embed_tokens.weight"], tensors["lm_head.weight"]
    hidden = embed.shape[1]
    g = torch.Generator().manual_seed(SEED + 1)
    for i in range(count):
        prefix = f"model.layers.{num_hidden_layers + i}."
        for name, like in block.items():
            tensors[prefix + name] = torch.randn(like.shape, generator=g, dtype=like.dtype)
        for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
            tensors[prefix + name] = 1 + 0.1 * torch.randn(hidden, generator=g)
        tensors[prefix + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=g)
        tensors[prefix + "embed_tokens.weight"] = embed.clone()
        tensors[prefix + "shared_head.head.weight"] = head.clone()
    save_file(tensors, file, metadata={"format": "pt"})


def auto_class(family: str, **options: Any) -> Any:
    import transformers as tf

    key = "qwen3_moe" if family == "qwen3" and options.get("moe") else family
    return getattr(tf, CLASSES[key][1])


def hf_config(path: Path) -> dict[str, Any]:
    return json.loads((Path(path) / "config.json").read_text())


# Quantized sources (issue #17): the tiny models above at sizes that are not multiples of the 128 FP8 block,
# then quantized the way the released checkpoints are.

# left unquantized as DeepSeek / Qwen do: embeddings, heads (an MTP shared_head.head too), norms, routers
FP8_SKIP = re.compile(r"embed|lm_head|shared_head\.head|norm|(^|\.)gate\.weight$|router")


def sized(
    family: str, path: Path, sizes: dict[str, int], dtype: torch.dtype = torch.bfloat16, **options: Any
) -> Path:
    """`tiny` with config attributes overridden by `sizes` (hidden_size=200, ...), saved in `dtype` (so
    config.json says `"dtype": "bfloat16"`, as FP8 releases do); `mtp=N` as in `tiny`; returns `path`."""
    import transformers as tf

    cfg = config(family, **options)
    for name, value in sizes.items():
        setattr(cfg, name, value)
    key = "qwen3_moe" if family == "qwen3" and options.get("moe") else family
    torch.manual_seed(SEED)
    getattr(tf, CLASSES[key][0])(cfg).to(dtype).save_pretrained(Path(path))
    if family == "deepseek_v3" and options.get("mtp"):  # appended in fp32: made `dtype` like the rest
        _append_mtp(Path(path), cfg.num_hidden_layers, options["mtp"])
        _rewrite(Path(path), lambda tensors: {k: v.to(dtype) for k, v in tensors.items()})
    return Path(path)


def quantize_fp8(src: Path, dst: Path, scale_dtype: torch.dtype = torch.float32) -> list[str]:
    """`src`'s model.safetensors with every 2-D linear weight (not embeddings, lm_head, norms, routers) in
    block FP8 by DeepSeek's math (`ckptconv.quant.fp8.quantize`) plus its `weight_scale_inv` (in
    `scale_dtype`), written by safetensors' own save_file into `dst`: the weights in
    model-00001-of-00002.safetensors, the scales in model-00002-of-00002.safetensors, an index (torch's
    quantized reader needs one), and config.json with DeepSeek-V3's quantization_config. Returns the
    quantized weights' keys."""
    from safetensors.torch import load_file, save_file

    from ckptconv.quant import fp8

    dst.mkdir(parents=True)
    weights, scales = {}, {}
    for key, value in load_file(src / "model.safetensors").items():
        if value.dim() == 2 and key.endswith(".weight") and not FP8_SKIP.search(key):
            weights[key], scale = fp8.quantize(value)
            scales[key + fp8.SCALE_SUFFIX] = scale.to(scale_dtype)
        else:
            weights[key] = value
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    for name, part in zip(names, (weights, scales), strict=True):
        save_file(part, dst / name, metadata={"format": "pt"})
    weight_map = {k: names[0] for k in weights} | {k: names[1] for k in scales}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    doc = hf_config(src)
    doc["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [fp8.BLOCK, fp8.BLOCK],
    }
    (dst / "config.json").write_text(json.dumps(doc, indent=2))
    return [k.removesuffix(fp8.SCALE_SUFFIX) for k in scales]


def pack_mxfp4(src: Path, dst: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A gpt_oss `src` (bf16 layout) with its experts in gpt-oss's MXFP4 layout: `mlp.experts.gate_up_proj`
    [E, D, 2F] and `down_proj` [E, F, D] replaced by seeded random `_blocks` [E, out, in/32, 16] uint8 and
    `_scales` [E, out, in/32] uint8 (exponents 118..130), as the research did; config.json with gpt-oss's
    quantization_config. Returns {logical key: (blocks, scales)}."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    g = torch.Generator().manual_seed(SEED + 2)
    out, packed = {}, {}
    for key, value in load_file(src / "model.safetensors").items():
        if not re.search(r"\.experts\.(gate_up|down)_proj$", key):
            out[key] = value
            continue
        experts, inputs, outputs = value.shape
        blocks = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(118, 131, (experts, outputs, inputs // 32), dtype=torch.uint8, generator=g)
        out[key + "_blocks"], out[key + "_scales"] = blocks, scales
        packed[key] = (blocks, scales)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    doc = hf_config(src)
    doc["quantization_config"] = {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    }
    (dst / "config.json").write_text(json.dumps(doc, indent=2))
    return packed


def seeded_llama() -> Any:
    """The reference tests' model: a LlamaForCausalLM (vocab 64, hidden 32, FFN 64, 2 layers, 4 heads and 2 KV
    heads, untied head), float32, its weights from seed 0."""
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(cfg)
