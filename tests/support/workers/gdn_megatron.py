"""Megatron's tensors of a tiny HF Qwen3.5 / Qwen3-Next model, computed with megatron-bridge 0.3.1's own
mapping functions (the oracle of tests/interop/test_megatron_gdn.py).

    python gdn_megatron.py BRIDGE_DIR HF_DIR OUT.pt FAMILY TP [TP ...]

Run by tests/support/bridge.py with megatron-bridge 0.3.1 and megatron-core 0.16.1 on PYTHONPATH. Reads
HF_DIR's model.safetensors and config.json (FAMILY: qwen3_5, qwen3_5_moe or qwen3_next) and torch.saves
{"split": {key: tensor}, "fused{TP}": {key: tensor}, ...}: "split" is Megatron-Core torch_dist's layout (per
layer keys, GDN split into .query/.key/... as megatron/core/ssm's `_split_tensor_factory` saves them, SwiGLU
fc1 [gate; up], experts stacked [E, ...]); "fused{TP}" is Megatron-FSDP fsdp_dtensor's (no `model.module.`
prefix: the caller adds it) on Megatron-LM main, GDN in_proj / conv1d fused by the TP ranks of a job at that
TP size, fc1 as weight_w / weight_v, experts per expert under TE's grouped-GEMM names.

Only megatron.bridge.models.conversion.param_mapping is imported, without running megatron.bridge's package
__init__ (it imports transformer_engine, which needs CUDA): the three package modules above it are created
empty with their real __path__, and the module's own code runs unchanged. What is not in 0.3.1 or needs a
TP process group is ported, each marked PORTED with its source.
"""

from __future__ import annotations

import json
import re
import sys
import types
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file


def _param_mapping(root: Path) -> Any:
    for name in ("megatron.bridge", "megatron.bridge.models", "megatron.bridge.models.conversion"):
        mod = types.ModuleType(name)
        mod.__path__ = [str(root / name.replace(".", "/"))]
        sys.modules[name] = mod
    import megatron.bridge.models.conversion.param_mapping as pm

    return pm


def _fuse_gdn_separate_to_grouped(
    c: Any, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """PORTED from Megatron-Bridge main, src/megatron/bridge/models/conversion/param_mapping.py
    `_fuse_gdn_separate_to_grouped` (not in 0.3.1): Qwen3.5's flat in_proj_qkv / z / b / a -> the head-grouped
    qkvz / ba that merge_gdn_linear_weights takes (shape checks left out)."""
    h, kd, vd = c.hidden_size, c.linear_key_head_dim, c.linear_value_head_dim
    nk, nv = c.linear_num_key_heads, c.linear_num_value_heads
    qk_dim, v_dim, per = kd * nk, vd * nv, nv // nk
    q_flat, k_flat, v_flat = torch.split(qkv, [qk_dim, qk_dim, v_dim], dim=0)
    q_g = q_flat.reshape(nk, kd, h)
    k_g = k_flat.reshape(nk, kd, h)
    v_g = v_flat.reshape(nk, per * vd, h)
    z_g = z.reshape(nk, per * vd, h)
    b_g = b.reshape(nk, per, h)
    a_g = a.reshape(nk, per, h)
    qkvz = torch.cat([q_g, k_g, v_g, z_g], dim=1).reshape(-1, h)
    ba = torch.cat([b_g, a_g], dim=1).reshape(-1, h)
    return qkvz, ba


def _conv1d_fused(pm: Any, c: Any, conv: torch.Tensor, tp: int) -> torch.Tensor:
    """Megatron's conv1d at TP size `tp`, concatenated over the ranks: GDNConv1dMapping.get_shard_idx (0.3.1,
    global indices) and PORTED from ChunkedMapping.hf_to_megatron (0.3.1; it needs a TP group) the reshape
    to [tp, -1, 1, K] per component and the concatenation per rank."""
    mapping = pm.GDNConv1dMapping("decoder.layers.0.self_attention.conv1d.weight", "conv1d.weight")
    idx = mapping.get_shard_idx(c, local_tp=False)
    parts = [conv[i].reshape(tp, -1, *conv.shape[-2:]) for i in idx]
    return torch.cat(parts, dim=1).reshape(-1, *conv.shape[-2:])


def _conv1d_split(pm: Any, c: Any, conv: torch.Tensor) -> dict[str, torch.Tensor]:
    mapping = pm.GDNConv1dMapping("decoder.layers.0.self_attention.conv1d.weight", "conv1d.weight")
    q, k, v = mapping.get_shard_idx(c, local_tp=False)
    return {"query": conv[q], "key": conv[k], "value": conv[v]}


def _split_in_proj(pm: Any, c: Any, in_proj: torch.Tensor) -> dict[str, torch.Tensor]:
    """torch_dist's split keys: each component of Megatron's TP=1 in_proj (merge_gdn_linear_weights at
    tp_size 1 is [q; k; v; z; b; a], every component whole)."""
    qk = c.linear_key_head_dim * c.linear_num_key_heads
    v, nv = c.linear_value_head_dim * c.linear_num_value_heads, c.linear_num_value_heads
    parts = torch.split(in_proj, [qk, qk, v, v, nv, nv], dim=0)
    return dict(zip(("query", "key", "value", "z", "beta", "alpha"), parts, strict=True))


def _provider(text: dict[str, Any]) -> Any:
    return types.SimpleNamespace(
        hidden_size=text["hidden_size"],
        num_attention_heads=text["num_attention_heads"],
        num_query_groups=text["num_key_value_heads"],
        kv_channels=text["head_dim"],
        attention_output_gate=True,
        linear_key_head_dim=text["linear_key_head_dim"],
        linear_value_head_dim=text["linear_value_head_dim"],
        linear_num_key_heads=text["linear_num_key_heads"],
        linear_num_value_heads=text["linear_num_value_heads"],
    )


def build(pm: Any, hf: dict[str, torch.Tensor], text: dict[str, Any], family: str, tps: list[int]) -> dict:
    c = _provider(text)
    prefix = "model." if family == "qwen3_next" else "model.language_model."
    out: dict[str, dict[str, torch.Tensor]] = {"split": {}, **{f"fused{tp}": {} for tp in tps}}

    def both(key: str, value: torch.Tensor) -> None:
        for d in out.values():
            d[key] = value

    def fsdp(key: str, value: torch.Tensor) -> None:
        for name, d in out.items():
            if name != "split":
                d[key] = value

    vocab = text["vocab_size"]
    for name, d in out.items():  # Megatron-LM pads to make_vocab_size_divisible_by (128) x TP
        multiple = 128 * (1 if name == "split" else int(name[len("fused") :]))
        rows = -(-vocab // multiple) * multiple - vocab
        pairs = (("embedding.word_embeddings", prefix + "embed_tokens"), ("output_layer", "lm_head"))
        for key, hf_key in pairs:
            weight = hf[hf_key + ".weight"]
            d[key + ".weight"] = torch.cat([weight, weight.new_zeros(rows, weight.shape[1])])
    both("decoder.final_layernorm.weight", hf[prefix + "norm.weight"])
    blocks = [(prefix + f"layers.{i}.", f"decoder.layers.{i}.") for i in range(text["num_hidden_layers"])]
    if "mtp.fc.weight" in hf:
        both("mtp.layers.0.eh_proj.weight", hf["mtp.fc.weight"])
        both("mtp.layers.0.enorm.weight", hf["mtp.pre_fc_norm_embedding.weight"])
        both("mtp.layers.0.hnorm.weight", hf["mtp.pre_fc_norm_hidden.weight"])
        both("mtp.layers.0.final_layernorm.weight", hf["mtp.norm.weight"])
        blocks.append(("mtp.layers.0.", "mtp.layers.0.transformer_layer."))
    for h, m in blocks:
        if h + "self_attn.q_proj.weight" in hf:
            both(m + "self_attention.linear_qkv.layer_norm_weight", hf[h + "input_layernorm.weight"])
            qkv = [hf[h + f"self_attn.{p}_proj.weight"] for p in "qkv"]
            both(m + "self_attention.linear_qkv.weight", pm.merge_qkv_weights(c, *qkv))
            both(m + "self_attention.linear_proj.weight", hf[h + "self_attn.o_proj.weight"])
            both(m + "self_attention.q_layernorm.weight", hf[h + "self_attn.q_norm.weight"])
            both(m + "self_attention.k_layernorm.weight", hf[h + "self_attn.k_norm.weight"])
        else:
            la = h + "linear_attn."
            both(m + "self_attention.in_proj.layer_norm_weight", hf[h + "input_layernorm.weight"])
            both(m + "self_attention.out_proj.weight", hf[la + "out_proj.weight"])
            both(m + "self_attention.A_log", hf[la + "A_log"])
            both(m + "self_attention.dt_bias", hf[la + "dt_bias"])
            # PORTED from RMSNorm2ZeroCenteredRMSNormMapping.hf_to_megatron (0.3.1): Megatron = HF - 1
            both(m + "self_attention.out_norm.weight", hf[la + "norm.weight"] - 1)
            if family == "qwen3_next":
                qkvz, ba = hf[la + "in_proj_qkvz.weight"], hf[la + "in_proj_ba.weight"]
            else:
                qkvz, ba = _fuse_gdn_separate_to_grouped(
                    c, *(hf[la + f"in_proj_{p}.weight"] for p in ("qkv", "z", "b", "a"))
                )
            for part, t in _split_in_proj(pm, c, pm.merge_gdn_linear_weights(c, qkvz, ba, tp_size=1)).items():
                out["split"][m + f"self_attention.in_proj.weight.{part}"] = t
            for part, t in _conv1d_split(pm, c, hf[la + "conv1d.weight"]).items():
                out["split"][m + f"self_attention.conv1d.weight.{part}"] = t
            for tp in tps:
                fused = out[f"fused{tp}"]
                fused[m + "self_attention.in_proj.weight"] = pm.merge_gdn_linear_weights(
                    c, qkvz, ba, tp_size=tp
                )
                fused[m + "self_attention.conv1d.weight"] = _conv1d_fused(pm, c, hf[la + "conv1d.weight"], tp)
        if h + "mlp.gate_proj.weight" in hf:  # dense: TE fuses the pre-MLP norm into linear_fc1
            both(m + "mlp.linear_fc1.layer_norm_weight", hf[h + "post_attention_layernorm.weight"])
            gate, up = hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]
            out["split"][m + "mlp.linear_fc1.weight"] = torch.cat([gate, up])  # GatedMLPMapping at TP 1
            fsdp(m + "mlp.linear_fc1.weight_w", gate)
            fsdp(m + "mlp.linear_fc1.weight_v", up)
            both(m + "mlp.linear_fc2.weight", hf[h + "mlp.down_proj.weight"])
            continue
        both(m + "pre_mlp_layernorm.weight", hf[h + "post_attention_layernorm.weight"])
        both(m + "mlp.router.weight", hf[h + "mlp.gate.weight"])
        gate, up = hf[h + "mlp.shared_expert.gate_proj.weight"], hf[h + "mlp.shared_expert.up_proj.weight"]
        out["split"][m + "mlp.shared_experts.linear_fc1.weight"] = torch.cat([gate, up])
        fsdp(m + "mlp.shared_experts.linear_fc1.weight_w", gate)
        fsdp(m + "mlp.shared_experts.linear_fc1.weight_v", up)
        both(m + "mlp.shared_experts.linear_fc2.weight", hf[h + "mlp.shared_expert.down_proj.weight"])
        both(m + "mlp.shared_experts.gate_weight", hf[h + "mlp.shared_expert_gate.weight"])
        experts = sorted(
            {int(x[1]) for k in hf if (x := re.fullmatch(re.escape(h) + r"mlp\.experts\.(\d+)\..*", k))}
        )
        fc1, fc2 = [], []
        for e in experts:
            gate, up = hf[h + f"mlp.experts.{e}.gate_proj.weight"], hf[h + f"mlp.experts.{e}.up_proj.weight"]
            down = hf[h + f"mlp.experts.{e}.down_proj.weight"]
            fc1.append(torch.cat([gate, up]))
            fc2.append(down)
            fsdp(m + f"mlp.experts.linear_fc1.weight{e}_w", gate)
            fsdp(m + f"mlp.experts.linear_fc1.weight{e}_v", up)
            fsdp(m + f"mlp.experts.linear_fc2.weight{e}", down)
        out["split"][m + "mlp.experts.experts.linear_fc1.weight"] = torch.stack(fc1)
        out["split"][m + "mlp.experts.experts.linear_fc2.weight"] = torch.stack(fc2)
    return {name: {k: v.contiguous().clone() for k, v in d.items()} for name, d in out.items()}


def main() -> None:
    root, hf_dir, out, family = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    tps = [int(x) for x in sys.argv[5:]]
    pm = _param_mapping(root)
    cfg = json.loads((hf_dir / "config.json").read_text())
    text = cfg if family == "qwen3_next" else cfg["text_config"]
    hf = load_file(hf_dir / "model.safetensors")
    torch.save(build(pm, hf, text, family, tps), out)


if __name__ == "__main__":
    main()
