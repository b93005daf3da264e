"""Presets: torchtitan-named sharded checkpoints -> the HF keys and values tiny transformers models expect."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import WORKERS, ckptconv, torchrun, tree_sha256
from safetensors.torch import load_file
from test_dcp_to_hf import load_dir, same_bits
from test_hf_to_dcp import TINY, load_plain, tiny
from test_mapping import titan_permute

from ckptconv.mapping import load_mapping
from ckptconv.mapping.rules import map_keys


def runtime_spec(preset: str, hf_dir: Path) -> dict[str, list]:
    """Runtime keys and shapes the preset gives the HF model, sharded like FSDP2 (3-D experts on dim 1)."""
    config = json.loads((hf_dir / "config.json").read_text())
    shapes = {k: tuple(v.shape) for k, v in load_dir(hf_dir).items()}
    targets = map_keys(load_mapping(preset), "to_runtime", shapes, config).targets
    spec = {}
    for t in targets:
        placement = "shard1" if len(t.shape) == 3 else "shard0" if t.shape and t.shape[0] > 1 else "replicate"
        spec[t.key] = [list(t.shape), "float32", placement]
    return spec


def convert_and_load(preset: str, hf_dir: Path, tmp_path: Path) -> tuple[dict, dict, Path]:
    import sys

    from transformers import AutoModelForCausalLM

    spec = runtime_spec(preset, hf_dir)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    ckpt = tmp_path / "ckpt"
    torchrun(2, str(WORKERS / "save_runtime.py"), str(ckpt), str(tmp_path / "spec.json"))
    out = tmp_path / "hf"
    proc = ckptconv(
        "dcp-to-hf",
        str(ckpt),
        str(out),
        "--mapping",
        preset,
        "--copy-from",
        str(hf_dir),
        "--dtype",
        "keep",
        "--max-shard-size",
        "20KB",
        "--verify",
        nproc=2,
    )
    assert proc.returncode == 0, proc.stderr
    assert "verified:" in proc.stderr
    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    sys.path.insert(0, str(WORKERS))
    from save_runtime import full_tensors

    return full_tensors(spec), load_dir(out), out


def round_trip(preset: str, out: Path, runtime: dict[str, torch.Tensor], tmp_path: Path) -> None:
    back = tmp_path / "back"
    proc = ckptconv(
        "hf-to-dcp", str(out), str(back), "--mapping", preset, "--prefix", "model.", "--verify", nproc=2
    )
    assert proc.returncode == 0, proc.stderr
    assert "verified:" in proc.stderr
    # verify with the mapping: the runtime-named DCP (stacked experts, permuted q/k) against the HF parts
    for ckpt in (back, out.parent / "ckpt"):
        proc = ckptconv(
            "verify", str(ckpt), str(out), "--mapping", preset, "--config", str(out / "config.json")
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert proc.stdout.startswith("match: ")
    state = load_plain(back)
    for key, value in runtime.items():
        assert same_bits(state[f"model.{key}"], value), key  # type: ignore[arg-type]
    again = tmp_path / "again"
    proc = ckptconv(
        "dcp-to-hf",
        str(back),
        str(again),
        "--mapping",
        preset,
        "--copy-from",
        str(out),
        "--dtype",
        "keep",
        "--max-shard-size",
        "20KB",
    )
    assert proc.returncode == 0, proc.stderr
    assert tree_sha256(again) == tree_sha256(out)


def test_torchtitan_llama3(tmp_path: Path) -> None:
    hf_dir = tiny("llama", tmp_path / "ref")
    runtime, got, out = convert_and_load("torchtitan-llama3", hf_dir, tmp_path)
    config = json.loads((hf_dir / "config.json").read_text())
    q_heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for layer in range(config["num_hidden_layers"]):
        hf, rt = f"model.layers.{layer}.", f"layers.{layer}."
        assert same_bits(
            got[hf + "self_attn.q_proj.weight"],
            titan_permute(runtime[rt + "attention.qkv_linear.wq.weight"], q_heads),
        )
        assert same_bits(
            got[hf + "self_attn.k_proj.weight"],
            titan_permute(runtime[rt + "attention.qkv_linear.wk.weight"], kv_heads),
        )
        assert same_bits(got[hf + "mlp.gate_proj.weight"], runtime[rt + "feed_forward.w1.weight"])
        assert same_bits(got[hf + "post_attention_layernorm.weight"], runtime[rt + "ffn_norm.weight"])
    assert same_bits(got["lm_head.weight"], runtime["lm_head.weight"])
    assert len(got) == len(runtime)
    round_trip("torchtitan-llama3", out, runtime, tmp_path)


def tiny_qwen3(path: Path, moe: bool, tied: bool) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    torch.manual_seed(0)
    common = dict(TINY, intermediate_size=24, tie_word_embeddings=tied)
    config = (
        Qwen3MoeConfig(moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2, **common)
        if moe
        else Qwen3Config(**common)
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.mark.parametrize(("moe", "tied"), [(False, True), (True, False)])
def test_torchtitan_qwen3(tmp_path: Path, moe: bool, tied: bool) -> None:
    hf_dir = tiny_qwen3(tmp_path / "ref", moe, tied)
    runtime, got, out = convert_and_load("torchtitan-qwen3", hf_dir, tmp_path)
    assert ("lm_head.weight" in got) != tied
    for layer in range(2):
        hf, rt = f"model.layers.{layer}.", f"layers.{layer}."
        assert same_bits(got[hf + "self_attn.q_proj.weight"], runtime[rt + "attention.qkv_linear.wq.weight"])
        assert same_bits(got[hf + "self_attn.k_norm.weight"], runtime[rt + "attention.k_norm.weight"])
        if moe:
            for e in range(4):
                assert same_bits(
                    got[hf + f"mlp.experts.{e}.up_proj.weight"],
                    runtime[rt + "moe.routed_experts.inner_experts.w3_EFD"][e],
                )
                assert same_bits(
                    got[hf + f"mlp.experts.{e}.down_proj.weight"],
                    runtime[rt + "moe.routed_experts.inner_experts.w2_EDF"][e],
                )
            assert same_bits(got[hf + "mlp.gate.weight"], runtime[rt + "moe.router.gate.weight"])
    if tied:  # HF keeps one copy; coming back, the runtime lm_head is the embedding (as the config says)
        runtime["lm_head.weight"] = runtime["tok_embeddings.weight"]
    round_trip("torchtitan-qwen3", out, runtime, tmp_path)


def test_torchtitan_deepseek_v3(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        moe_intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        q_lora_rank=8,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=4,
        n_group=2,
        topk_group=1,
        tie_word_embeddings=False,
    )
    hf_dir = tmp_path / "ref"
    AutoModelForCausalLM.from_config(config).save_pretrained(hf_dir)
    runtime, got, out = convert_and_load("torchtitan-deepseek-v3", hf_dir, tmp_path)
    assert same_bits(
        got["model.layers.0.self_attn.q_a_proj.weight"], runtime["layers.0.attention.wq_a.weight"]
    )
    assert same_bits(got["model.layers.0.mlp.down_proj.weight"], runtime["layers.0.feed_forward.w2.weight"])
    assert same_bits(
        got["model.layers.1.mlp.gate.e_score_correction_bias"], runtime["layers.1.moe.expert_bias_E"]
    )
    assert same_bits(
        got["model.layers.1.mlp.shared_experts.up_proj.weight"],
        runtime["layers.1.moe.shared_experts.w3.weight"],
    )
    for e in range(4):
        assert same_bits(
            got[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"],
            runtime["layers.1.moe.routed_experts.inner_experts.w1_EFD"][e],
        )
    round_trip("torchtitan-deepseek-v3", out, runtime, tmp_path)


def test_a_mapped_dcp_keeps_its_config_and_maps_back_without_config(tmp_path: Path) -> None:
    """hf-to-dcp --mapping keeps the config.json it read beside `.metadata` (dcp.load ignores it), so
    dcp-to-hf / verify / inspect of that checkpoint map it back with no --config, as a new user tries it."""
    hf_dir = tiny("llama", tmp_path / "hf")
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    proc = ckptconv("hf-to-dcp", str(hf_dir), str(ckpt), "--mapping", "torchtitan-llama3")
    assert proc.returncode == 0, proc.stderr
    assert (ckpt / "config.json").read_bytes() == (hf_dir / "config.json").read_bytes()
    proc = ckptconv("dcp-to-hf", str(ckpt), str(back), "--mapping", "torchtitan-llama3", "--dtype", "keep")
    assert proc.returncode == 0, proc.stderr
    want = {k: v for f in sorted(hf_dir.glob("*.safetensors")) for k, v in load_file(f).items()}
    got = {k: v for f in sorted(back.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert want.keys() == got.keys() and all(same_bits(want[k], got[k]) for k in want)
    proc = ckptconv("verify", str(ckpt), str(hf_dir), "--mapping", "torchtitan-llama3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = ckptconv("inspect", str(ckpt), "--mapping", "torchtitan-llama3", "--json")
    assert proc.returncode == 0 and "model.layers.0.self_attn.q_proj.weight" in proc.stdout, proc.stderr
    plain = tmp_path / "plain"  # without a mapping nothing is added beside .metadata
    assert ckptconv("hf-to-dcp", str(hf_dir), str(plain)).returncode == 0
    assert not (plain / "config.json").exists()
