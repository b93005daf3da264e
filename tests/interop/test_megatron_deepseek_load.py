"""hf-to-dcp --mapping megatron-deepseek-v3 (torch_dist) loads in megatron-core 0.16.1's own
`dist_checkpointing.load` with its default strictness (issue #37).

The HF checkpoint: the release dcp-to-hf makes of the tiny DeepSeek-V3-style GPTModel megatron-core saves
(tests/support/workers/megatron_deepseek.py; test_megatron_deepseek.py shows it is transformers' own
save_pretrained of the model the config builds, bit for bit), with and without q_lora_rank (MLA's
linear_q_down_proj / linear_q_up_proj, or linear_q_proj). hf-to-dcp writes it back as torch_dist in the
local spec's module names (the model here has no TransformerEngine); the worker
builds the same GPTModel, zeroes it, and loads `gpt.sharded_state_dict()` from the directory: every tensor
and every `_extra_state` ShardedObject megatron asks for (MLA's projections, the MTP layer and its eh_proj,
the per-layer stacked experts' `shard_{e}_{E}`) must be there and nothing else; then
`load_state_dict(strict=True)`.
Every parameter is the HF tensor it came from, bit for bit, and the vocabulary padding rows are zeros.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from megatron import run_megatron
from test_dcp_to_hf import load_dir, same_bits
from test_megatron_deepseek import KEEP, PRESET, cli, hf_config, hf_expected
from test_megatron_gpt import _items

from ckptconv.formats.dcp import open_dcp
from ckptconv.plan.megatron import extra_state_objects

LOCAL = ("--runtime-layout", "local")  # megatron-core builds the model with the local spec (no TE on CPU)

# case -> the worker's deepseek options
CASES = {"q_lora": (), "no_q_lora": ("--no-q-lora",)}


class Converted:
    """megatron's checkpoint of one case, its HF release and hf-to-dcp's torch_dist of that release."""

    def __init__(self, root: Path, options: tuple[str, ...]) -> None:
        self.ckpt = root / "meg" / "ckpt"
        self.options = options
        run_megatron(1, "deepseek", str(self.ckpt), *options)
        self.meg = json.loads((self.ckpt.parent / "config.json").read_text())
        cfg = root / "hf_config"
        hf_config(self.meg).save_pretrained(cfg)
        back_config = json.loads((cfg / "config.json").read_text())
        back_config["make_vocab_size_divisible_by"] = self.meg["make_vocab_size_divisible_by"]
        (root / "back_config.json").write_text(json.dumps(back_config))
        self.hf = root / "hf"
        cli("dcp-to-hf", str(self.ckpt), str(self.hf), "--mapping", PRESET, "--copy-from", str(cfg), *KEEP)
        self.back = root / "back"
        config = ("--config", str(root / "back_config.json"))
        cli("hf-to-dcp", str(self.hf), str(self.back), "--mapping", PRESET, *config, *LOCAL)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Converted]:
    return {name: Converted(tmp_path_factory.mktemp(name), opts) for name, opts in CASES.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_extra_state_objects_are_megatrons(converted: dict[str, Converted], name: str) -> None:
    """extra_state_objects names exactly the `_extra_state` items megatron's own save wrote for the model
    (per-layer keys: a dense then an MoE layer, experts stacked per layer; MLA; MTP), and hf-to-dcp writes
    those and no others, each holding what megatron's does."""
    case = converted[name]
    saved, back = _items(case.ckpt), _items(case.back)
    objects = {k for k in saved if "._extra_state/" in k}
    assert objects == set(
        extra_state_objects({k: tuple(t.shape) for k, t in open_dcp(case.ckpt).tensors.items()})
    )
    assert any(".experts.experts.linear_fc1._extra_state/shard_3_4" in k for k in objects)
    assert any(k.startswith("mtp.layers.0.eh_proj._extra_state/") for k in objects)
    assert {k for k in back if "._extra_state/" in k} == objects
    assert all(saved[k]() == back[k]() == [None] for k in objects)


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_megatron_loads_hf_to_dcp_strictly(
    converted: dict[str, Converted], name: str, tmp_path: Path
) -> None:
    """megatron's own load (default strictness, then load_state_dict(strict=True)) of hf-to-dcp's output
    gives every parameter (and expert_bias) as the HF tensor it came from, bit for bit; the padded
    vocabulary rows are zeros."""
    case = converted[name]
    result = tmp_path / "loaded.pt"
    run_megatron(1, "load-deepseek", str(case.back), str(result), *case.options)
    model = torch.load(result, weights_only=True)["model"]
    original = torch.load(case.ckpt.parent / "expected.pt", weights_only=True)["model"]
    assert sorted(model) == sorted(original)
    vocab = case.meg["vocab_size"]
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert model[key].shape == original[key].shape and not model[key][vocab:].any(), key
    got, want = hf_expected(model, case.meg), load_dir(case.hf)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert same_bits(got[key], value), key


def test_extra_state_offsets_follow_the_stacked_axes() -> None:
    """The rule the slow tests check against megatron, without it: layer-stacked keys take the layer axis,
    stacked experts the expert axis, per-layer keys (decoder or MTP) only the expert axis if any; the output
    layer, router, embedding and norms have no `_extra_state`."""
    shapes = {
        "decoder.layers.mlp.experts.experts.linear_fc1.weight": (2, 3, 8, 4),
        "decoder.layers.self_attention.linear_qkv.weight": (2, 12, 4),
        "decoder.layers.1.mlp.experts.experts.linear_fc2.weight": (3, 4, 8),
        "decoder.layers.1.mlp.experts.experts.2.linear_fc1.weight_w": (8, 4),
        "decoder.layers.0.self_attention.linear_q_down_proj.weight": (6, 4),
        "mtp.layers.0.eh_proj.weight": (4, 8),
        "mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc1.weight": (2, 8, 4),
        "mtp.layers.0.transformer_layer.mlp.router.weight": (2, 4),
        "decoder.layers.0.self_attention.kv_layernorm.weight": (4,),
        "output_layer.weight": (16, 4),
        "embedding.word_embeddings.weight": (16, 4),
    }
    want = {
        *(
            f"decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_{i}.{e}_2.3"
            for i in range(2)
            for e in range(3)
        ),
        *(f"decoder.layers.self_attention.linear_qkv._extra_state/shard_{i}_2" for i in range(2)),
        *(f"decoder.layers.1.mlp.experts.experts.linear_fc2._extra_state/shard_{e}_3" for e in range(3)),
        "decoder.layers.1.mlp.experts.experts.2.linear_fc1._extra_state/shard_0_1",
        "decoder.layers.0.self_attention.linear_q_down_proj._extra_state/shard_0_1",
        "mtp.layers.0.eh_proj._extra_state/shard_0_1",
        *(
            f"mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc1._extra_state/shard_{e}_2"
            for e in range(2)
        ),
    }
    assert set(extra_state_objects(shapes)) == want
