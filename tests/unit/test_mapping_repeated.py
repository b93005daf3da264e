"""Repeated hf keys and `hf_groups`, pure: Megatron's fused gated-delta-net projections (Qwen3.5 flat,
Qwen3-Next grouped per key head) cut by a grouped split at a tensor-parallel size and joined into HF tensors,
both ways, bit for bit against Megatron-Bridge's own layout functions (their math, copied below)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_mapping_ops import mapping, round_trip, values

from ckptconv.errors import CkptconvError
from ckptconv.mapping.rules import map_keys

# A tiny GDN: 4 key heads of 2, 8 value heads of 3 (2 per key head), hidden 5, conv kernel 4.
CONFIG = {
    "hidden_size": 5,
    "linear_key_head_dim": 2,
    "linear_value_head_dim": 3,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_conv_kernel_dim": 4,
}
QK, V, NV = 2 * 4, 3 * 8, 8


# --- Megatron-Bridge 0.3.1, src/megatron/bridge/models/conversion/param_mapping.py: merge_gdn_linear_weights
# and split_gdn_linear_weights (the fused in_proj of Megatron's GDN at TP size tp_size <-> HF Qwen3-Next's
# in_proj_qkvz / in_proj_ba); _fuse_gdn_separate_to_grouped is on Bridge main (commit 067f987d), for Qwen3.5's
# flat in_proj_qkv / z / b / a. Copied line for line (config attributes as in TransformerConfig).


def merge_gdn_linear_weights(provider, qkvz, ba, tp_size=1):
    hidden_size = provider.hidden_size
    qk_head_dim = provider.linear_key_head_dim
    v_head_dim = provider.linear_value_head_dim
    num_qk_heads = provider.linear_num_key_heads
    num_v_heads = provider.linear_num_value_heads
    qk_dim = qk_head_dim * num_qk_heads
    v_dim = v_head_dim * num_v_heads
    qkvz_reshaped = qkvz.reshape(num_qk_heads, (qk_dim * 2 + v_dim * 2) // num_qk_heads, hidden_size)
    ba_reshaped = ba.reshape(num_qk_heads, 2 * num_v_heads // num_qk_heads, hidden_size)
    q, k, v, z = torch.split(
        qkvz_reshaped,
        [
            qk_head_dim,
            qk_head_dim,
            num_v_heads // num_qk_heads * v_head_dim,
            num_v_heads // num_qk_heads * v_head_dim,
        ],
        dim=1,
    )
    b, a = torch.split(ba_reshaped, [num_v_heads // num_qk_heads, num_v_heads // num_qk_heads], dim=1)
    q, k, v, z, b, a = [weight.reshape(tp_size, -1, hidden_size) for weight in [q, k, v, z, b, a]]
    in_proj = torch.cat([q, k, v, z, b, a], dim=1)
    return in_proj.reshape(-1, hidden_size)


def split_gdn_linear_weights(provider, in_proj, tp_size=1):
    hidden_size = provider.hidden_size
    qk_head_dim = provider.linear_key_head_dim
    v_head_dim = provider.linear_value_head_dim
    num_qk_heads = provider.linear_num_key_heads
    num_qk_heads_local_tp = provider.linear_num_key_heads // tp_size
    num_v_heads_local_tp = provider.linear_num_value_heads // tp_size
    qk_dim_local_tp = qk_head_dim * num_qk_heads_local_tp
    v_dim_local_tp = v_head_dim * num_v_heads_local_tp
    in_proj = in_proj.reshape(tp_size, -1, hidden_size)
    q, k, v, z, b, a = torch.split(
        in_proj,
        [
            qk_dim_local_tp,
            qk_dim_local_tp,
            v_dim_local_tp,
            v_dim_local_tp,
            num_v_heads_local_tp,
            num_v_heads_local_tp,
        ],
        dim=1,
    )
    q, k, v, z, b, a = [weight.reshape(num_qk_heads, -1, hidden_size) for weight in [q, k, v, z, b, a]]
    qkvz = torch.cat([q, k, v, z], dim=1)
    ba = torch.cat([b, a], dim=1)
    return qkvz.reshape(-1, hidden_size), ba.reshape(-1, hidden_size)


def _fuse_gdn_separate_to_grouped(config, qkv, z, b, a):
    hidden_size = config.hidden_size
    qk_head_dim = config.linear_key_head_dim
    v_head_dim = config.linear_value_head_dim
    num_qk_heads = config.linear_num_key_heads
    num_v_heads = config.linear_num_value_heads
    qk_dim = qk_head_dim * num_qk_heads
    v_dim = v_head_dim * num_v_heads
    v_per_group = num_v_heads // num_qk_heads
    q_flat, k_flat, v_flat = torch.split(qkv, [qk_dim, qk_dim, v_dim], dim=0)
    q_g = q_flat.reshape(num_qk_heads, qk_head_dim, hidden_size)
    k_g = k_flat.reshape(num_qk_heads, qk_head_dim, hidden_size)
    v_g = v_flat.reshape(num_qk_heads, v_per_group * v_head_dim, hidden_size)
    z_g = z.reshape(num_qk_heads, v_per_group * v_head_dim, hidden_size)
    b_g = b.reshape(num_qk_heads, v_per_group, hidden_size)
    a_g = a.reshape(num_qk_heads, v_per_group, hidden_size)
    qkvz = torch.cat([q_g, k_g, v_g, z_g], dim=1).reshape(-1, hidden_size)
    ba = torch.cat([b_g, a_g], dim=1).reshape(-1, hidden_size)
    return qkvz, ba


# --- end of the copied Bridge code


PROVIDER = SimpleNamespace(**CONFIG)
SIZES = (
    'sizes = ["linear_key_head_dim * linear_num_key_heads / gdn_tensor_parallel_size", '
    '"linear_key_head_dim * linear_num_key_heads / gdn_tensor_parallel_size", '
    '"linear_value_head_dim * linear_num_value_heads / gdn_tensor_parallel_size", '
    '"linear_value_head_dim * linear_num_value_heads / gdn_tensor_parallel_size", '
    '"linear_num_value_heads / gdn_tensor_parallel_size", '
    '"linear_num_value_heads / gdn_tensor_parallel_size"]\n'
)
QWEN35 = (
    '[[rule]]\nruntime = "decoder.layers.{layer}.self_attention.in_proj.weight"\n'
    'hf = ["{p}.in_proj_qkv.weight", "{p}.in_proj_qkv.weight", "{p}.in_proj_qkv.weight", '
    '"{p}.in_proj_z.weight", "{p}.in_proj_b.weight", "{p}.in_proj_a.weight"]\n'
    'groups = "gdn_tensor_parallel_size"\n' + SIZES + "\n"
    '[[rule]]\nruntime = "decoder.layers.{layer}.self_attention.conv1d.weight"\n'
    'hf = ["{p}.conv1d.weight", "{p}.conv1d.weight", "{p}.conv1d.weight"]\n'
    'groups = "gdn_tensor_parallel_size"\n'
    'sizes = ["linear_key_head_dim * linear_num_key_heads / gdn_tensor_parallel_size", '
    '"linear_key_head_dim * linear_num_key_heads / gdn_tensor_parallel_size", '
    '"linear_value_head_dim * linear_num_value_heads / gdn_tensor_parallel_size"]\n'
).replace("{p}", "model.language_model.layers.{layer}.linear_attn")
QWEN3_NEXT = (
    '[[rule]]\nruntime = "decoder.layers.{layer}.self_attention.in_proj.weight"\n'
    'hf = ["{p}.in_proj_qkvz.weight", "{p}.in_proj_qkvz.weight", "{p}.in_proj_qkvz.weight", '
    '"{p}.in_proj_qkvz.weight", "{p}.in_proj_ba.weight", "{p}.in_proj_ba.weight"]\n'
    'groups = "gdn_tensor_parallel_size"\nhf_groups = "linear_num_key_heads"\n' + SIZES
).replace("{p}", "model.layers.{layer}.linear_attn")


def hf_qwen35(layer: int) -> dict[str, torch.Tensor]:
    """HF Qwen3.5's flat GDN tensors of one layer (distinct values everywhere)."""
    p = f"model.language_model.layers.{layer}.linear_attn"
    base = 1000.0 * layer
    return {
        f"{p}.in_proj_qkv.weight": values(2 * QK + V, 5) + base,
        f"{p}.in_proj_z.weight": values(V, 5) + base + 300,
        f"{p}.in_proj_b.weight": values(NV, 5) + base + 600,
        f"{p}.in_proj_a.weight": values(NV, 5) + base + 700,
        f"{p}.conv1d.weight": values(2 * QK + V, 1, 4) + base + 800,
    }


def fused_conv1d(conv: torch.Tensor, tp: int) -> torch.Tensor:
    """Megatron's fused conv1d at TP size `tp`: the concatenation over ranks r of [q_r | k_r | v_r] (each
    rank's shard of Bridge's GDNConv1dMapping: its q, k and v rows, in that order)."""
    q, k, v = torch.split(conv, [QK, QK, V])
    return torch.cat([torch.cat([t.chunk(tp)[r] for t in (q, k, v)]) for r in range(tp)])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qwen35_fused_gdn(tmp_path: Path, tp: int) -> None:
    """Runtime fused in_proj / conv1d at TP `tp` <-> HF Qwen3.5's flat in_proj_qkv [Q;K;V], z, b, a,
    conv1d, both ways, per layer (oracle: Bridge's _fuse_gdn_separate_to_grouped, merge_gdn_linear_weights)"""
    m = mapping(tmp_path, QWEN35)
    runtime, hf = {}, {}
    for layer in range(2):
        h = hf_qwen35(layer)
        p = f"model.language_model.layers.{layer}.linear_attn"
        qkvz, ba = _fuse_gdn_separate_to_grouped(
            PROVIDER, h[f"{p}.in_proj_qkv.weight"], h[f"{p}.in_proj_z.weight"], h[f"{p}.in_proj_b.weight"],
            h[f"{p}.in_proj_a.weight"],
        )  # fmt: skip
        runtime[f"decoder.layers.{layer}.self_attention.in_proj.weight"] = merge_gdn_linear_weights(
            PROVIDER, qkvz, ba, tp_size=tp
        )
        runtime[f"decoder.layers.{layer}.self_attention.conv1d.weight"] = fused_conv1d(
            h[f"{p}.conv1d.weight"], tp
        )
        hf |= h
    round_trip(m, runtime, CONFIG | {"gdn_tensor_parallel_size": tp}, hf)


@pytest.mark.parametrize("tp", [1, 2])
def test_qwen3_next_fused_gdn_regrouped_per_key_head(tmp_path: Path, tp: int) -> None:
    """Runtime fused in_proj at TP `tp` <-> HF Qwen3-Next's in_proj_qkvz (per key head [q k v z]) and
    in_proj_ba (per key head [b a]): exactly Bridge's split_gdn_linear_weights, and merge_gdn_linear_weights
    back; TP 1 and TP 2 give the same HF tensors."""
    m = mapping(tmp_path, QWEN3_NEXT)
    qkvz = values(4 * (2 * 2 + 2 * 6), 5)
    ba = values(4 * 4, 5) + 5000
    fused = merge_gdn_linear_weights(PROVIDER, qkvz, ba, tp_size=tp)
    split = split_gdn_linear_weights(PROVIDER, fused, tp)
    assert all(torch.equal(a, b) for a, b in zip(split, (qkvz, ba), strict=True))
    hf = {
        "model.layers.3.linear_attn.in_proj_qkvz.weight": qkvz,
        "model.layers.3.linear_attn.in_proj_ba.weight": ba,
    }
    round_trip(
        m,
        {"decoder.layers.3.self_attention.in_proj.weight": fused},
        CONFIG | {"gdn_tensor_parallel_size": tp},
        hf,
    )


def test_stacked_repeated_keys_with_groups(tmp_path: Path) -> None:
    """A stacked runtime tensor [L, rows, D], split per group and joined per hf_groups, element by element."""
    rule = (
        '[[rule]]\nruntime = "w"\nhf = ["l.{layer}.x", "l.{layer}.x", "l.{layer}.y"]\nstack = "layer"\n'
        "dim = 1\ngroups = 2\nsizes = [2, 4, 1]\nhf_groups = 2\n"
    )
    w = values(3, 14, 2)
    expected = {}
    for layer in range(3):
        a, b, c = (
            torch.cat(parts) for parts in zip(*(g.split([2, 4, 1]) for g in w[layer].chunk(2)), strict=True)
        )
        expected[f"l.{layer}.x"] = torch.cat(
            [a[:2], b[:4], a[2:], b[4:]]
        )  # per hf group: its rows of a, then b
        expected[f"l.{layer}.y"] = c
    round_trip(mapping(tmp_path, rule), {"w": w}, {}, expected)


def test_ops_names(tmp_path: Path) -> None:
    m = mapping(tmp_path, QWEN3_NEXT)
    config = CONFIG | {"gdn_tensor_parallel_size": 2}
    to_hf = map_keys(m, "to_hf", {"decoder.layers.0.self_attention.in_proj.weight": (80, 5)}, config)
    assert {t.op for t in to_hf.targets} == {"grouped-split+hf-regroup"}
    shapes = {t.key: t.shape for t in to_hf.targets}
    assert {t.op for t in map_keys(m, "to_runtime", shapes, config).targets} == {"grouped-concat+hf-ungroup"}
    flat = map_keys(
        mapping(tmp_path, QWEN35),
        "to_hf",
        {"decoder.layers.0.self_attention.conv1d.weight": (40, 1, 4)},
        config,
    )
    assert {t.op for t in flat.targets} == {"grouped-split+hf-concat"}


@pytest.mark.parametrize(
    "rule,message",
    [
        ('runtime = "a"\nhf = ["b", "b"]\nhf_groups = 0', "hf_groups must be at least 1"),
        (
            'runtime = "a"\nhf = ["b", "c"]\nhf_groups = 2',
            "hf_groups lays out an hf key named more than once",
        ),
        ('runtime = ["a", "a"]\nhf = "b"', "runtime names 'a' twice"),
        ('runtime = "a"\nhf = ["b", "b"]\ninterleave = true', "an hf key named twice"),
        ('runtime = "a"\nhf = ["b", "b"]\nduplicate = true', "an hf key named twice"),
        ('runtime = "a"\nhf = ["b", "b"]\nunbind = true', "an hf key named twice"),
    ],
)
def test_bad_repeated_rules_are_named(tmp_path: Path, rule: str, message: str) -> None:
    with pytest.raises(CkptconvError, match=message) as err:
        mapping(tmp_path, f"[[rule]]\n{rule}\n")
    assert "rule 1" in str(err.value) and "\n" not in str(err.value)


def test_hf_groups_must_divide_each_piece(tmp_path: Path) -> None:
    """3 rows of a piece cannot be laid out in 2 groups: refused, naming the rule and the key, both ways."""
    m = mapping(tmp_path, '[[rule]]\nruntime = "w"\nhf = ["x", "x"]\nsizes = [3, 1]\nhf_groups = 2\n')
    with pytest.raises(CkptconvError, match=r"'w': rule 1: hf_groups 2: a piece of 3 rows") as err:
        map_keys(m, "to_hf", {"w": (4, 2)}, {})
    assert "\n" not in str(err.value)
    with pytest.raises(CkptconvError, match=r"rule 1: hf_groups 2: a piece of 3 rows"):
        map_keys(m, "to_runtime", {"x": (4, 2)}, {})


def test_wrong_hf_shape_is_refused(tmp_path: Path) -> None:
    """An HF tensor that does not hold the pieces the sizes name is refused, not read as something else."""
    m = mapping(tmp_path, QWEN3_NEXT)
    shapes = {
        "model.layers.0.linear_attn.in_proj_qkvz.weight": (60, 5),
        "model.layers.0.linear_attn.in_proj_ba.weight": (16, 5),
    }
    with pytest.raises(CkptconvError, match=r"cannot combine|add up"):
        map_keys(m, "to_runtime", shapes, CONFIG | {"gdn_tensor_parallel_size": 2})
