"""Run one of torchtitan 0.3.0's StateDictAdapters on a checkpoint, in a process that can import torchtitan.

    python titan_adapter.py FAMILY DIRECTION CONFIG_JSON SRC DST

FAMILY: llama3, qwen3, deepseek_v3, gpt_oss, qwen3_5, kimi_k2_7, muse_glimmer. CONFIG_JSON: the HF config.json
of the checkpoint (a path, or the JSON text itself); the torchtitan model config is built from it with the
family's own config helpers (torchtitan/models/<family>/__init__.py), so the adapter sees the head counts,
layer counts, expert counts and vision sizes of that checkpoint. DIRECTION:

- from_hf: SRC is an HF safetensors directory (every *.safetensors in it is read, and it is the adapter's
  hf_assets_path); `adapter.from_hf` of all its tensors is saved to the file DST.
- to_hf: SRC is a safetensors file of the torchtitan (runtime) state dict; `adapter.to_hf` is saved to DST.
- load: what torchtitan's own HF load does (components/checkpointer/dcp.py): the model is built on the meta
  device, `adapter.to_hf(model.state_dict())` names the HF tensors to read, only those are read from SRC (an
  HF directory; a missing one or a shape mismatch fails, as dcp.load would), and their `adapter.from_hf` is
  saved to DST. HF tensors the model does not ask for are never seen; torchtitan then calls
  model.load_state_dict(..., strict=False), so runtime keys absent from DST silently keep their init.
- model: the torchtitan model is built on the meta device and DST gets {fqn: [shape, dtype]} of its
  state_dict as JSON: the runtime keys and shapes from_hf should produce.

titan.py runs this with PYTHONPATH set to the separate torchtitan install; it is not importable from the
main venv. The adapters run unmodified; any exception (an unmapped key, say) propagates and fails the run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

ATTN = "flex"
MOE_COMM = "standard"


def _rope_theta(text: dict[str, Any], default: float = 10000.0) -> float:
    rope = text.get("rope_parameters") or {}
    return float(rope.get("rope_theta", text.get("rope_theta", default)))


def _yarn(text: dict[str, Any], dim: int) -> dict[str, Any]:
    """ComplexRoPE/CosSinRoPE.Config kwargs for an HF rope_parameters dict (default or yarn)."""
    rope = text.get("rope_parameters") or {}
    kw: dict[str, Any] = {
        "dim": dim,
        "max_seq_len": int(text.get("max_position_embeddings", 4096)),
        "theta": _rope_theta(text),
    }
    if rope.get("rope_type") == "yarn":
        kw |= {
            "scaling": "yarn",
            "rope_factor": float(rope.get("factor", 1.0)),
            "beta_fast": float(rope.get("beta_fast", 32.0)),
            "beta_slow": float(rope.get("beta_slow", 1.0)),
            "original_seq_len": int(rope.get("original_max_position_embeddings", 4096)),
        }
    elif rope.get("rope_type") == "llama3":
        kw |= {
            "scaling": "llama",
            "scaling_factor": float(rope["factor"]),
            "low_freq_factor": float(rope["low_freq_factor"]),
            "high_freq_factor": float(rope["high_freq_factor"]),
            "original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
        }
    return kw


def _decoder_parts(dim: int, vocab: int) -> dict[str, Any]:
    from torchtitan.models.common import Embedding, Linear, RMSNorm

    return {
        "dim": dim,
        "vocab_size": vocab,
        "tok_embeddings": Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
        "norm": RMSNorm.Config(normalized_shape=dim),
        "lm_head": Linear.Config(in_features=dim, out_features=vocab),
    }


def _head_dim(text: dict[str, Any]) -> int:
    return int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])


def llama3(hf: dict[str, Any]) -> Any:
    from torchtitan.models.common import ComplexRoPE
    from torchtitan.models.llama3 import _build_llama3_layers
    from torchtitan.models.llama3.model import Llama3Model

    dim, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    if _head_dim(hf) != dim // n_heads:
        raise ValueError(f"torchtitan llama3 has head_dim = dim // n_heads; config.json says {_head_dim(hf)}")
    return Llama3Model.Config(
        **_decoder_parts(dim, hf["vocab_size"]),
        enable_weight_tying=bool(hf.get("tie_word_embeddings", False)),
        layers=_build_llama3_layers(
            n_layers=hf["num_hidden_layers"],
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            hidden_dim=hf["intermediate_size"],
            rope=ComplexRoPE.Config(**_yarn(hf, dim // n_heads)),
            attn_backend=ATTN,
        ),
    )


def qwen3(hf: dict[str, Any]) -> Any:
    from torchtitan.models.common import CosSinRoPE
    from torchtitan.models.qwen3 import _build_qwen3_layers, _build_qwen3_moe_layers
    from torchtitan.models.qwen3.model import Qwen3Model

    dim, head_dim = hf["hidden_size"], _head_dim(hf)
    common = {
        "n_layers": hf["num_hidden_layers"],
        "dim": dim,
        "n_heads": hf["num_attention_heads"],
        "n_kv_heads": hf["num_key_value_heads"],
        "head_dim": head_dim,
        "attn_backend": ATTN,
        "rope": CosSinRoPE.Config(**_yarn(hf, head_dim)),
    }
    # transformers 5.23 writes Qwen3-MoE's expert count as num_local_experts (its attribute_map), the released
    # Qwen3 configs as num_experts.
    experts = hf.get("num_experts") or hf.get("num_local_experts")
    if experts:
        if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
            raise ValueError("torchtitan qwen3 MoE puts a MoE in every layer")
        layers = _build_qwen3_moe_layers(
            **common,
            moe_hidden_dim=hf["moe_intermediate_size"],
            num_experts=experts,
            top_k=hf["num_experts_per_tok"],
            moe_comm_backend=MOE_COMM,
        )
    else:
        layers = _build_qwen3_layers(**common, hidden_dim=hf["intermediate_size"])
    return Qwen3Model.Config(
        **_decoder_parts(dim, hf["vocab_size"]),
        enable_weight_tying=bool(hf.get("tie_word_embeddings", False)),
        layers=layers,
    )


def _mla_layers(text: dict[str, Any], builder: Any) -> list[Any]:
    from torchtitan.models.common import ComplexRoPE

    rope = text.get("rope_parameters") or {}
    mscale = float(rope.get("mscale", 1.0)) if rope.get("rope_type") == "yarn" else 1.0
    return builder(
        n_layers=text["num_hidden_layers"],
        n_dense_layers=text["first_k_dense_replace"],
        dim=text["hidden_size"],
        n_heads=text["num_attention_heads"],
        q_lora_rank=text.get("q_lora_rank") or 0,
        kv_lora_rank=text["kv_lora_rank"],
        qk_nope_head_dim=text["qk_nope_head_dim"],
        qk_rope_head_dim=text["qk_rope_head_dim"],
        v_head_dim=text["v_head_dim"],
        mscale=mscale,
        dense_hidden_dim=text["intermediate_size"],
        moe_hidden_dim=text["moe_intermediate_size"],
        num_experts=text["n_routed_experts"],
        num_shared_experts=text.get("n_shared_experts") or 0,
        router_top_k=text["num_experts_per_tok"],
        router_score_func=text.get("scoring_func", "sigmoid"),
        router_num_expert_groups=text.get("n_group"),
        router_num_limited_groups=text.get("topk_group"),
        router_route_scale=float(text.get("routed_scaling_factor", 1.0)),
        router_route_norm=bool(text.get("norm_topk_prob", False)),
        attn_backend=ATTN,
        moe_comm_backend=MOE_COMM,
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(**_yarn(text, text["qk_rope_head_dim"])),
    )


def _num_mtp(text: dict[str, Any]) -> int:
    return int(text.get("num_nextn_predict_layers", text.get("num_mtp_layers", 0)) or 0)


def deepseek_v3(hf: dict[str, Any]) -> Any:
    from torchtitan.models.deepseek_v3 import _build_dsv3_layers, _build_mtp_layers
    from torchtitan.models.deepseek_v3.model import DeepSeekV3Model

    layers = _mla_layers(hf, _build_dsv3_layers)
    dim = hf["hidden_size"]
    return DeepSeekV3Model.Config(
        **_decoder_parts(dim, hf["vocab_size"]),
        layers=layers,
        mtp_layers=_build_mtp_layers(layers[-1], dim=dim, num_mtp_layers=_num_mtp(hf)),
    )


def gpt_oss(hf: dict[str, Any]) -> Any:
    """As torchtitan's gpt_oss `_build_gptoss_layers`, which fixes 64 heads of 64, 8 KV heads and a 128 window
    on even layers: the same per-layer helpers, with the sizes and layer_types of config.json."""
    import torchtitan.models.gpt_oss as G
    from torchtitan.models.common import CosSinRoPE, Linear, RMSNorm
    from torchtitan.models.common.moe import TokenChoiceTopKRouter
    from torchtitan.models.gpt_oss.model import GptOssModel

    dim, experts, top_k = hf["hidden_size"], hf["num_local_experts"], hf["num_experts_per_tok"]
    head_dim = _head_dim(hf)
    types = hf.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(hf["num_hidden_layers"])
    ]
    rope = CosSinRoPE.Config(**_yarn(hf, head_dim), truncate=False)
    layers = []
    for layer_id, kind in enumerate(types):
        attn = G._make_gptoss_attn_config(
            dim=dim,
            layer_id=layer_id,
            attn_backend=ATTN,
            n_heads=hf["num_attention_heads"],
            n_kv_heads=hf["num_key_value_heads"],
            head_dim=head_dim,
            sliding_window_size=hf["sliding_window"] if kind == "sliding_attention" else None,
            rope=rope,
        )
        experts_cfg = G._make_gptoss_experts_config(
            dim=dim,
            hidden_dim=hf["intermediate_size"],
            num_experts=experts,
            layer_id=layer_id,
            top_k=top_k,
            moe_comm_backend=MOE_COMM,
        )
        moe = G.GptOssMoE.Config(
            num_experts=experts,
            load_balance_coeff=1e-3,
            routed_experts=experts_cfg,
            router=TokenChoiceTopKRouter.Config(
                num_experts=experts,
                score_func="softmax",
                route_norm=True,
                gate=Linear.Config(in_features=dim, out_features=experts, bias=True),
                top_k=top_k,
            ),
        )
        layers.append(
            G.GptOssTransformerBlock.Config(
                attention=attn,
                attention_norm=RMSNorm.Config(normalized_shape=dim),
                ffn_norm=RMSNorm.Config(normalized_shape=dim),
                moe=moe,
            )
        )
    return GptOssModel.Config(**_decoder_parts(dim, hf["vocab_size"]), layers=layers)


def qwen3_5(hf: dict[str, Any]) -> Any:
    """Qwen3_5ForConditionalGeneration and Qwen3_5MoeForConditionalGeneration (text_config, vision_config)."""
    import torchtitan.models.qwen3_5 as Q
    from torchtitan.models.common import Embedding, Linear
    from torchtitan.models.qwen3_5.model import Qwen35Model

    text, vision = hf["text_config"], hf["vision_config"]
    dim, head_dim, n = text["hidden_size"], _head_dim(text), text["num_hidden_layers"]
    rope = text.get("rope_parameters") or {}
    rotary_dim = int(head_dim * float(rope.get("partial_rotary_factor", 0.25)))
    interval = next(i + 1 for i, kind in enumerate(text["layer_types"]) if kind == "full_attention")
    expected = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    if text["layer_types"] != expected:
        raise ValueError(
            f"torchtitan qwen3_5 has a full-attention layer every {interval}: {text['layer_types']}"
        )
    common = {
        "n_layers": n,
        "dim": dim,
        "n_heads": text["num_attention_heads"],
        "n_kv_heads": text["num_key_value_heads"],
        "head_dim": head_dim,
        "rotary_dim": rotary_dim,
        "rope": Q.MRoPE.Config(
            dim=rotary_dim,
            max_seq_len=int(text.get("max_position_embeddings", 4096)),
            theta=_rope_theta(text),
            mrope_section=list(rope["mrope_section"]),
        ),
        "n_key_heads": text["linear_num_key_heads"],
        "n_value_heads": text["linear_num_value_heads"],
        "key_head_dim": text["linear_key_head_dim"],
        "value_head_dim": text["linear_value_head_dim"],
        "full_attention_interval": interval,
        "attn_backend": ATTN,
    }
    if text.get("num_experts"):
        layers = Q._build_qwen35_moe_layers(
            **common,
            moe_hidden_dim=text["moe_intermediate_size"],
            num_experts=text["num_experts"],
            top_k=text["num_experts_per_tok"],
            shared_expert_hidden_dim=text["shared_expert_intermediate_size"],
            moe_comm_backend=MOE_COMM,
        )
    else:
        layers = Q._build_qwen35_layers(**common, hidden_dim=text["intermediate_size"])
    vocab = text["vocab_size"]
    return Qwen35Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=Q._offset_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
        lm_head=Linear.Config(in_features=dim, out_features=vocab),
        enable_weight_tying=bool(hf.get("tie_word_embeddings", False)),
        layers=layers,
        vision_encoder=Q._qwen35_vision_encoder_config(
            dim=vision["hidden_size"],
            ffn_dim=vision["intermediate_size"],
            num_layers=vision["depth"],
            num_heads=vision["num_heads"],
            patch_size=vision["patch_size"],
            temporal_patch_size=vision["temporal_patch_size"],
            spatial_merge_size=vision["spatial_merge_size"],
            out_hidden_size=vision["out_hidden_size"],
            num_position_embeddings=vision["num_position_embeddings"],
            in_channels=vision.get("in_channels", 3),
        ),
    )


def kimi_k2_7(hf: dict[str, Any]) -> Any:
    """Kimi K2.5 / K2.6 / K2.7 (transformers' kimi_k25): DeepSeek-V3 text_config, MoonViT vision_config."""
    import torchtitan.models.kimi_k2_7 as K
    from torchtitan.models.kimi_k2_7.model import KimiK25Model

    text, vision = hf["text_config"], hf["vision_config"]
    dim = text["hidden_size"]
    layers = _mla_layers(text, K._build_kimi_layers)
    return KimiK25Model.Config(
        **_decoder_parts(dim, text["vocab_size"]),
        layers=layers,
        vision_encoder=K._vision_encoder_config(
            dim=vision["hidden_size"],
            ffn_dim=vision["intermediate_size"],
            num_layers=vision["num_hidden_layers"],
            num_heads=vision["num_attention_heads"],
            patch_size=vision["patch_size"],
            init_pos_emb_height=vision["pos_emb_height"],
            init_pos_emb_width=vision["pos_emb_width"],
            merge_kernel_size=list(vision.get("merge_kernel_size", [2, 2])),
            text_hidden_size=dim,
        ),
    )


def muse_glimmer(hf: dict[str, Any]) -> Any:
    import torchtitan.models.muse_glimmer as M

    text, vision = hf["text_config"], hf["vision_config"]
    dim, n = text["hidden_size"], text["num_hidden_layers"]
    if text["intermediate_size"] != int(M._FFN_DIM_MULTIPLIER * dim):
        raise ValueError(f"torchtitan muse_glimmer's FFN is {M._FFN_DIM_MULTIPLIER} * dim")
    window = text.get("sliding_window") or 0
    pattern = [window, window, window, 0]
    expected = [M._layer_window_size(i, n, pattern) for i in range(n)]
    actual = [window if kind == "sliding_attention" else None for kind in text["layer_types"]]
    if expected != actual:
        raise ValueError(f"torchtitan muse_glimmer windows {expected}, config.json {actual}")
    encoder = M.muse_glimmer_vision_encoder_config(
        latent_dim=vision["hidden_size"],
        num_layers=vision["num_hidden_layers"],
        num_heads=vision["num_attention_heads"],
        mlp_ratio=vision["intermediate_size"] / vision["hidden_size"],
        patch_size=vision["patch_size"],
        patch_temporal=vision.get("patch_temporal", 2),
        downsample_factor=vision.get("merge_size", 2),
        pos_emb_grid_h=vision["pos_emb_height"],
        pos_emb_grid_w=vision["pos_emb_width"],
    )
    adapter = M.muse_glimmer_vision_adapter_config(
        input_dim=hf["out_hidden_size"], output_dim=hf["projector_hidden_size"]
    )
    return M._muse_glimmer_config(
        dim=dim,
        n_layers=n,
        n_heads=text["num_attention_heads"],
        n_kv_heads=text["num_key_value_heads"],
        head_dim=_head_dim(text),
        vocab_size=text["vocab_size"],
        max_seq_len=int(text.get("max_position_embeddings", 4096)),
        window_pattern=pattern,
        output_multiplier=float(text.get("output_multiplier", 1.0)),
        attn_backend=ATTN,
        vision_adapter_dim=hf["projector_hidden_size"],
        vision_encoder=encoder,
        vision_adapter=adapter,
    )


FAMILIES = {
    "llama3": (llama3, "torchtitan.models.llama3.state_dict_adapter", "Llama3StateDictAdapter"),
    "qwen3": (qwen3, "torchtitan.models.qwen3.state_dict_adapter", "Qwen3StateDictAdapter"),
    "deepseek_v3": (
        deepseek_v3,
        "torchtitan.models.deepseek_v3.state_dict_adapter",
        "DeepSeekV3StateDictAdapter",
    ),
    "gpt_oss": (gpt_oss, "torchtitan.models.gpt_oss.state_dict_adapter", "GptOssStateDictAdapter"),
    "qwen3_5": (qwen3_5, "torchtitan.models.qwen3_5.state_dict_adapter", "Qwen35StateDictAdapter"),
    "kimi_k2_7": (kimi_k2_7, "torchtitan.models.kimi_k2_7.state_dict_adapter", "KimiK25StateDictAdapter"),
    "muse_glimmer": (
        muse_glimmer,
        "torchtitan.models.muse_glimmer.state_dict_adapter",
        "MuseGlimmerStateDictAdapter",
    ),
}


def _save(tensors: dict[str, Any], dst: Path) -> None:
    # Own contiguous copies: adapters return views (chunk, transpose) and aliases (lm_head = embeddings),
    # which save_file refuses.
    out = {k: v.detach().clone(memory_format=torch.contiguous_format) for k, v in tensors.items()}
    save_file(out, str(dst))


def main(argv: list[str]) -> int:
    if len(argv) != 6:
        print(__doc__, file=sys.stderr)
        return 2
    family, direction, config_json, src_arg, dst_arg = argv[1:]
    hf = json.loads(config_json if config_json.lstrip().startswith("{") else Path(config_json).read_text())
    build, module, name = FAMILIES[family]
    model_config = build(hf)
    src, dst = Path(src_arg), Path(dst_arg)
    if direction in ("model", "load"):
        with torch.device("meta"):
            model = model_config.build()
    if direction == "model":
        shapes = {
            k: [list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in model.state_dict().items()
        }
        dst.write_text(json.dumps(shapes, indent=1))
        return 0
    import importlib

    adapter_cls = getattr(importlib.import_module(module), name)
    if direction == "from_hf":
        hf_state: dict[str, Any] = {}
        for file in sorted(src.glob("*.safetensors")):
            hf_state.update(load_file(str(file)))
        adapter = adapter_cls(model_config, str(src))
        _save(adapter.from_hf(hf_state), dst)
    elif direction == "load":
        adapter = adapter_cls(model_config, str(src))
        wanted = adapter.to_hf(model.state_dict())
        found: dict[str, Any] = {}
        for file in sorted(src.glob("*.safetensors")):
            found.update({k: v for k, v in load_file(str(file)).items() if k in wanted})
        problems = [f"missing {k}" for k in wanted if k not in found]
        problems += [
            f"shape of {k}: checkpoint {list(found[k].shape)}, model {list(v.shape)}"
            for k, v in wanted.items()
            if k in found and found[k].shape != v.shape
        ]
        if problems:
            raise SystemExit("torchtitan would fail to read " + src_arg + ":\n  " + "\n  ".join(problems))
        _save(adapter.from_hf({k: found[k] for k in wanted}), dst)
    elif direction == "to_hf":
        adapter = adapter_cls(model_config, None)
        _save(adapter.to_hf(load_file(str(src))), dst)
    else:
        raise SystemExit(f"unknown direction {direction!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
