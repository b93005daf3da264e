"""Presets: the helpers test_live uses (a preset's runtime spec, a tiny Qwen3), and a mapped DCP keeping its
config.json. Each preset against torchtitan and transformers: test_presets_v2.py."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from conftest import ckptconv
from safetensors.torch import load_file
from test_dcp_to_hf import load_dir, same_bits
from test_hf_to_dcp import TINY, tiny

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
