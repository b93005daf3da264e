"""Megatron's fused GDN layer through the real CLI, both ways: a DCP holding a TP-2 fused in_proj and conv1d
and a zero-centred out_norm, made with torch DCP, to Qwen3-Next's grouped in_proj_qkvz / in_proj_ba (Bridge's
split_gdn_linear_weights) and norm + 1, and back, bit for bit, at 1 and 2 ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import ckptconv
from test_dcp_to_hf import load_dir, same_bits
from test_hf_to_dcp import load_plain
from test_mapping_repeated import (
    CONFIG,
    PROVIDER,
    SIZES,
    V,
    merge_gdn_linear_weights,
    split_gdn_linear_weights,
)

QK = 2 * 4
CONV = (
    'sizes = ["linear_key_head_dim * linear_num_key_heads / gdn_tensor_parallel_size", '
    '"linear_key_head_dim * linear_num_key_heads / gdn_tensor_parallel_size", '
    '"linear_value_head_dim * linear_num_value_heads / gdn_tensor_parallel_size"]\n'
)
MAPPING = (
    '[mapping]\nname = "gdn-test"\n\n'
    '[[rule]]\nruntime = "decoder.layers.{layer}.self_attention.in_proj.weight"\n'
    'hf = ["{p}.in_proj_qkvz.weight", "{p}.in_proj_qkvz.weight", "{p}.in_proj_qkvz.weight", '
    '"{p}.in_proj_qkvz.weight", "{p}.in_proj_ba.weight", "{p}.in_proj_ba.weight"]\n'
    'groups = "gdn_tensor_parallel_size"\nhf_groups = "linear_num_key_heads"\n' + SIZES + "\n"
    '[[rule]]\nruntime = "decoder.layers.{layer}.self_attention.conv1d.weight"\n'
    'hf = ["{p}.conv1d.weight", "{p}.conv1d.weight", "{p}.conv1d.weight"]\n'
    'groups = "gdn_tensor_parallel_size"\n' + CONV + "\n"
    '[[rule]]\nruntime = "decoder.layers.{layer}.self_attention.out_norm.weight"\n'
    'hf = "{p}.norm.weight"\noffset = 1\n'
).replace("{p}", "model.layers.{layer}.linear_attn")


def hf_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    out = {}
    for layer in range(2):
        p = f"model.layers.{layer}.linear_attn"
        out[f"{p}.in_proj_qkvz.weight"] = torch.randn(4 * (2 * 2 + 2 * 6), 5, generator=g).to(torch.bfloat16)
        out[f"{p}.in_proj_ba.weight"] = torch.randn(16, 5, generator=g).to(torch.bfloat16)
        out[f"{p}.conv1d.weight"] = torch.randn(2 * QK + V, 1, 4, generator=g).to(torch.bfloat16)
        out[f"{p}.norm.weight"] = (1 + torch.randn(3, generator=g) / 10).to(torch.bfloat16)
    return out


def runtime_tensors(hf: dict[str, torch.Tensor], tp: int) -> dict[str, torch.Tensor]:
    """Megatron's fused layout at TP `tp`: Bridge's merge_gdn_linear_weights; conv1d per rank [q_r|k_r|v_r];
    out_norm zero-centred (HF - 1 in fp32, as bf16)."""
    out = {}
    for layer in range(2):
        p, r = f"model.layers.{layer}.linear_attn", f"decoder.layers.{layer}.self_attention"
        qkvz, ba = hf[f"{p}.in_proj_qkvz.weight"], hf[f"{p}.in_proj_ba.weight"]
        out[f"{r}.in_proj.weight"] = merge_gdn_linear_weights(PROVIDER, qkvz, ba, tp_size=tp)
        q, k, v = torch.split(hf[f"{p}.conv1d.weight"], [QK, QK, V])
        out[f"{r}.conv1d.weight"] = torch.cat(
            [torch.cat([t.chunk(tp)[i] for t in (q, k, v)]) for i in range(tp)]
        )
        out[f"{r}.out_norm.weight"] = (hf[f"{p}.norm.weight"].float() - 1).to(torch.bfloat16)
    return out


@pytest.mark.parametrize("nproc", [0, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("tp", [1, 2])
def test_fused_gdn_both_ways(tmp_path: Path, tp: int, nproc: int) -> None:
    hf = hf_tensors()
    runtime = runtime_tensors(hf, tp)
    dcp.save(runtime, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    (tmp_path / "map.toml").write_text(MAPPING)
    (tmp_path / "config.json").write_text(json.dumps(CONFIG | {"gdn_tensor_parallel_size": tp}))
    flags = ["--mapping", str(tmp_path / "map.toml"), "--config", str(tmp_path / "config.json")]
    out = tmp_path / "hf"
    proc = ckptconv("dcp-to-hf", str(tmp_path / "ckpt"), str(out), *flags, "--dtype", "keep", nproc=nproc)
    assert proc.returncode == 0, proc.stderr
    got = load_dir(out)
    assert set(got) == set(hf)
    for layer in range(2):  # Bridge's split of the fused tensor is what the release holds
        p, r = f"model.layers.{layer}.linear_attn", f"decoder.layers.{layer}.self_attention"
        qkvz, ba = split_gdn_linear_weights(PROVIDER, runtime[f"{r}.in_proj.weight"], tp_size=tp)
        assert same_bits(got[f"{p}.in_proj_qkvz.weight"], qkvz) and same_bits(
            got[f"{p}.in_proj_ba.weight"], ba
        )
        norm = (runtime[f"{r}.out_norm.weight"].float() + 1).to(torch.bfloat16)
        assert same_bits(got[f"{p}.norm.weight"], norm)
        assert same_bits(got[f"{p}.conv1d.weight"], hf[f"{p}.conv1d.weight"])
    back = tmp_path / "back"
    proc = ckptconv("hf-to-dcp", str(out), str(back), *flags, nproc=nproc)
    assert proc.returncode == 0, proc.stderr
    state = load_plain(back)
    assert set(state) == set(runtime)
    for key, value in runtime.items():
        if "out_norm" in key:  # HF - 1 in fp32, then cast
            hf_key = key.replace("decoder", "model").replace("self_attention.out_norm", "linear_attn.norm")
            value = (got[hf_key].float() - 1).to(torch.bfloat16)
        assert same_bits(state[key], value), key  # type: ignore[arg-type]
