"""The torchtitan harness itself: tiny transformers checkpoints (families.py) and torchtitan 0.3.0's real
StateDictAdapters run out of process (titan.py, workers/titan_adapter.py).

Every tiny checkpoint saves, is seeded and loads back in transformers with the shapes pinned in EXPECTED; the
pinned torchtitan install is in place. What torchtitan's adapters do with these checkpoints (and what their
0.3.0 versions get wrong) is checked preset by preset in test_presets_v2.py.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from functools import cache
from pathlib import Path
from typing import Any

import families
import pytest
import torch
from safetensors.torch import load_file, save_file
from titan import REQUIREMENTS, titan_dir

# checkpoint name -> (families.tiny family, its options, torchtitan family)
CASES: dict[str, tuple[str, dict[str, Any], str]] = {
    "llama": ("llama", {}, "llama3"),
    "llama_tied": ("llama", {"tie": True}, "llama3"),
    "qwen3": ("qwen3", {}, "qwen3"),
    "qwen3_moe": ("qwen3", {"moe": True}, "qwen3"),
    "deepseek_v3": ("deepseek_v3", {}, "deepseek_v3"),
    "deepseek_v3_mtp": ("deepseek_v3", {"q_lora": False, "mtp": 1}, "deepseek_v3"),
    "gpt_oss": ("gpt_oss", {}, "gpt_oss"),
    "qwen3_5": ("qwen3_5", {}, "qwen3_5"),
    "qwen3_5_moe": ("qwen3_5_moe", {}, "qwen3_5"),
    "qwen3_5_moe_fused": ("qwen3_5_moe", {"fused_experts": True}, "qwen3_5"),
    "kimi_k25": ("kimi_k25", {}, "kimi_k2_7"),
    "kimi_k25_released": ("kimi_k25", {"released": True}, "kimi_k2_7"),
    "muse_glimmer": ("muse_glimmer", {}, "muse_glimmer"),
}

# A few saved tensors per checkpoint, as save_pretrained writes them (hidden 32, vocab 64; expert
# intermediate 8 so that [E, 2I, H] and [E, H, 2I] cannot be confused).
SAVED_SHAPES: dict[str, dict[str, list[int]]] = {
    "llama": {"model.layers.0.self_attn.k_proj.weight": [16, 32], "lm_head.weight": [64, 32]},
    "qwen3_moe": {
        # transformers 5.23 fuses experts in memory but saves them per expert again
        "model.layers.0.mlp.experts.3.gate_proj.weight": [8, 32],
        "model.layers.0.mlp.experts.3.down_proj.weight": [32, 8],
        "model.layers.0.self_attn.q_norm.weight": [8],
    },
    "deepseek_v3": {
        "model.layers.0.self_attn.q_a_proj.weight": [16, 32],
        "model.layers.0.self_attn.q_b_proj.weight": [48, 16],  # heads * (nope 8 + rope 4)
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": [20, 32],  # kv_lora 16 + rope 4
        "model.layers.0.self_attn.kv_b_proj.weight": [64, 16],  # heads * (nope 8 + v 8)
        "model.layers.1.mlp.experts.0.gate_proj.weight": [8, 32],
        "model.layers.1.mlp.gate.e_score_correction_bias": [4],
        "model.layers.1.mlp.shared_experts.up_proj.weight": [8, 32],
    },
    "deepseek_v3_mtp": {
        "model.layers.0.self_attn.q_proj.weight": [48, 32],
        "model.layers.2.eh_proj.weight": [32, 64],
        "model.layers.2.shared_head.head.weight": [64, 32],
        "model.layers.2.embed_tokens.weight": [64, 32],
        "model.layers.2.mlp.experts.3.down_proj.weight": [32, 8],
    },
    "gpt_oss": {
        # bf16 layout: [E, hidden, 2 * I] with gate and up interleaved on the last dim; down [E, I, hidden]
        "model.layers.0.mlp.experts.gate_up_proj": [4, 32, 48],
        "model.layers.0.mlp.experts.gate_up_proj_bias": [4, 48],
        "model.layers.0.mlp.experts.down_proj": [4, 24, 32],
        "model.layers.0.mlp.experts.down_proj_bias": [4, 32],
        "model.layers.0.self_attn.sinks": [4],
    },
    "qwen3_5": {
        "model.language_model.layers.0.linear_attn.in_proj_qkv.weight": [64, 32],  # 2 * (2 * 8) + 4 * 8
        "model.language_model.layers.0.linear_attn.conv1d.weight": [64, 1, 4],
        "model.language_model.layers.0.linear_attn.A_log": [4],
        "model.language_model.layers.3.self_attn.q_proj.weight": [256, 32],  # heads * head_dim * 2 (gate)
        "model.visual.patch_embed.proj.weight": [16, 3, 2, 4, 4],  # Conv3d
        "model.visual.blocks.0.attn.qkv.weight": [48, 16],
        "model.visual.pos_embed.weight": [16, 16],
        "lm_head.weight": [64, 32],
    },
    "qwen3_5_moe": {
        "model.language_model.layers.0.mlp.experts.0.gate_proj.weight": [8, 32],
        "model.language_model.layers.0.mlp.shared_expert_gate.weight": [1, 32],
    },
    "qwen3_5_moe_fused": {
        "model.language_model.layers.0.mlp.experts.gate_up_proj": [4, 16, 32],
        "model.language_model.layers.0.mlp.experts.down_proj": [4, 32, 8],
    },
    "kimi_k25": {
        # save_pretrained's own spelling; see families._KIMI_RELEASED
        "language_model.model.blocks.0.self_attn.q_b_proj.weight": [48, 16],
        "language_model.lm_head.weight": [64, 32],
        "vision_tower.encoder.blocks.0.wqkv.weight": [48, 16],
        "vision_tower.encoder.patch_embed.proj.weight": [16, 3, 4, 4],  # Conv2d
        "vision_tower.patch_embed.pos_emb.weight": [4, 4, 16],
        "model.mm_projector.pre_norm.weight": [16],
        "mm_projector.proj.0.weight": [64, 64],
    },
    "kimi_k25_released": {
        "language_model.model.layers.1.mlp.experts.0.up_proj.weight": [8, 32],
        "vision_tower.patch_embed.proj.weight": [16, 3, 4, 4],
        "mm_projector.pre_norm.weight": [16],
    },
    "muse_glimmer": {
        "model.language_model.layers.3.self_attn.gate_proj.weight": [32, 32],
        "model.language_model.layers.0.mlp.gate_proj.weight": [96, 32],
        "model.vision_tower.patch_embedder.patch_embedding.weight": [16, 96],  # Linear, 2 * 3 * 4 * 4
        "model.vision_tower.patch_embedder.position_embedding_table.weight": [16, 16],
        "model.vision_adapter.fc1.weight": [32, 64],
        "model.vision_projection.weight": [32, 32],
    },
}


def pattern(key: str) -> str:
    """A key with its layer and expert numbers as N."""
    return re.sub(r"\.\d+(?=\.|$)", ".N", key)


def patterns(keys: Any) -> set[str]:
    return {pattern(k) for k in keys}


_ROOT: list[Path] = []


@pytest.fixture(scope="module", autouse=True)
def _module_tmp(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Where `checkpoint` and `titan` keep what they make, once per module run."""
    _ROOT.append(tmp_path_factory.mktemp("titan"))
    yield
    _ROOT.clear()
    for cached in (checkpoint, reference_state):
        cached.cache_clear()


@cache
def checkpoint(name: str) -> Path:
    """The tiny checkpoint `name` (saved once per module run); `titan` writes its results beside it."""
    family, options, _ = CASES[name]
    return families.tiny(family, _ROOT[-1] / name / "hf", **options)


def read_hf(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def load_into_transformers(name: str, tensors: dict[str, torch.Tensor], where: Path) -> tuple[Any, dict]:
    """`tensors` as the weights of a copy of checkpoint `name` (its config), loaded by from_pretrained."""
    family, options, _ = CASES[name]
    shutil.copytree(checkpoint(name), where)
    for file in where.glob("*.safetensors"):
        file.unlink()
    save_file(tensors, where / "model.safetensors", metadata={"format": "pt"})
    return families.auto_class(family, **options).from_pretrained(
        where, output_loading_info=True, dtype=torch.float32
    )


@cache
def reference_state(name: str) -> dict[str, torch.Tensor]:
    """The state_dict transformers builds from checkpoint `name` itself."""
    family, options, _ = CASES[name]
    model = families.auto_class(family, **options).from_pretrained(checkpoint(name), dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------------------------------------
# the tiny checkpoints


@pytest.mark.parametrize("name", CASES)
def test_tiny_saves_and_transformers_loads_it_back(name: str, tmp_path: Path) -> None:
    family, options, _ = CASES[name]
    started = time.monotonic()
    path = families.tiny(family, tmp_path / "hf", **options)
    assert time.monotonic() - started < 10  # < 2 s once transformers is imported
    saved = read_hf(path)
    assert {t.dtype for t in saved.values()} == {torch.float32}
    for key, shape in SAVED_SHAPES.get(name, {}).items():
        assert list(saved[key].shape) == shape, key
    model, info = families.auto_class(family, **options).from_pretrained(
        path, output_loading_info=True, dtype=torch.float32
    )
    assert type(model).__name__ == families.CLASSES["qwen3_moe" if options.get("moe") else family][0]
    problems = {k: sorted(v) for k, v in info.items() if v}
    if name == "deepseek_v3_mtp":
        # DeepseekV3ForCausalLM only ignores r"model\.layers\.61.*" (the 671B checkpoint's MTP layer), so a
        # checkpoint of another depth gets its MTP layer reported as unexpected (after transformers fused
        # its experts) and dropped. transformers' separate MtpModel (generate(use_mtp=True)) looks for layer
        # 61 only as well.
        mtp = {k for k in saved if k.startswith("model.layers.2.") and ".mlp.experts." not in k}
        mtp |= {"model.layers.2.mlp.experts.gate_up_proj", "model.layers.2.mlp.experts.down_proj"}
        assert set(problems.pop("unexpected_keys")) == mtp
    assert problems == {}
    # Bit-exact: saving what was loaded gives the same tensors (after the same layout rewrite tiny did).
    model.save_pretrained(tmp_path / "again")
    again = read_hf(tmp_path / "again")
    if options.get("fused_experts"):
        again = families._fuse_experts(again)
    if options.get("released"):
        again = families._kimi_released(again)
    if options.get("mtp"):
        saved = {k: v for k, v in saved.items() if not k.startswith("model.layers.2.")}
    assert again.keys() == saved.keys()
    assert all(torch.equal(again[k], saved[k]) for k in saved)


def test_tiny_is_seeded(tmp_path: Path) -> None:
    a = read_hf(families.tiny("deepseek_v3", tmp_path / "a", mtp=1))
    b = read_hf(families.tiny("deepseek_v3", tmp_path / "b", mtp=1))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "a" / "config.json").read_text())["num_nextn_predict_layers"] == 1


@pytest.mark.parametrize(
    "rules",
    [
        [],  # save_pretrained's own: language_model.model.blocks.N, model.mm_projector.pre_norm, ...
        list(families._KIMI_RELEASED),  # the released Kimi-K2.5 names
        # what KimiK25StateDictAdapter.from_hf also takes: language_model.layers.N without model.
        [*families._KIMI_RELEASED, (r"^language_model\.model\.layers\.", "language_model.layers.")],
        # the in-memory names
        [
            (r"^language_model\.model\.blocks\.", "model.language_model.layers."),
            (r"^language_model\.model\.", "model.language_model."),
            (r"^language_model\.lm_head\.", "lm_head."),
        ],
    ],
    ids=["save_pretrained", "released", "language_model.layers", "model.language_model"],
)
def test_kimi_k25_loader_takes_every_spelling(rules: list[tuple[str, str]], tmp_path: Path) -> None:
    renamed = {}
    for key, value in read_hf(checkpoint("kimi_k25")).items():
        for old, new in rules:
            key = re.sub(old, new, key)
        renamed[key] = value
    model, info = load_into_transformers("kimi_k25", renamed, tmp_path / "hf")
    assert not any(info.values()), info
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in reference_state("kimi_k25").items())


# ---------------------------------------------------------------------------------------------------------
# torchtitan 0.3.0's adapters


@pytest.mark.slow  # the first call installs 1.1 GB (triton)
def test_titan_dir_holds_the_pins() -> None:
    pins = [line.split("#")[0].strip() for line in REQUIREMENTS.read_text().splitlines()]
    pins = [p for p in pins if p]
    assert pins and all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][A-Za-z0-9.]*", p) for p in pins), pins

    def canonical(name: str) -> str:
        return re.sub(r"[-_.]+", "_", name).lower()

    installed = {
        (canonical(d.name.split("-")[0]), d.name.removesuffix(".dist-info").split("-")[1])
        for d in titan_dir().glob("*.dist-info")
    }
    assert installed == {(canonical(p.split("==")[0]), p.split("==")[1]) for p in pins}
