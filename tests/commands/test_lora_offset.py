"""--lora merge and --lora adapter through a rule with an `offset` (HF = runtime + offset): the offset applies
to the final weight, so the merged HF weight is (W + update) + offset, computed in fp32 and cast once, and an
adapter's embedding base weight (`base_layer.weight`, which PEFT saves) is W + offset while the factors are
the trainer's (PEFT's merge of them then adds the update to the shifted base)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_values import cli, save_dcp

MAPPING = """
[mapping]
name = "lora-offset"

[[rule]]  # an embedding: PEFT's lora_embedding_A / B, merged on the whole renamed weight
runtime = "emb.weight"
hf = "model.embed.weight"
offset = 1

[[rule]]  # a linear layer renamed: merged on the whole weight
runtime = "proj.weight"
hf = "model.proj.weight"
offset = 1

[[rule]]  # a linear layer narrowed (padding rows dropped): merged block by block as it is read
runtime = "head.weight"
hf = "model.head.weight"
narrow = 5
offset = -0.5
"""
HF_KEYS = ("model.embed.weight", "model.proj.weight", "model.head.weight")


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    state = {
        "emb.base_layer.weight": r(6, 4),
        "emb.lora_embedding_A.default": r(2, 6),
        "emb.lora_embedding_B.default": r(4, 2),
        "proj.base_layer.weight": r(3, 4),
        "proj.lora_A.default.weight": r(2, 4),
        "proj.lora_B.default.weight": r(3, 2),
        "head.base_layer.weight": r(6, 4),
        "head.lora_A.default.weight": r(2, 4),
        "head.lora_B.default.weight": r(6, 2),
    }
    root = tmp_path_factory.mktemp("lora_offset")
    (root / "shifted.toml").write_text(MAPPING)
    (root / "plain.toml").write_text(MAPPING.replace("offset = 1\n", "").replace("offset = -0.5\n", ""))
    return save_dcp(state, root / "dcp")


def convert(src: Path, out: Path, mapping: str, *flags: str) -> Path:
    cli(
        "dcp-to-hf",
        str(src),
        str(out),
        "--mapping",
        str(src.parent / mapping),
        "--lora-alpha",
        "4",
        "-q",
        *flags,
    )
    return out


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_merge_shifts_the_merged_weight(src: Path, tmp_path: Path, dtype: str) -> None:
    """Without the offset the merge is W + update in fp32; with it, exactly that plus the offset in fp32,
    cast once (a shift before the merge rounds differently, and would enter a DoRA norm)."""
    plain = load_file(
        convert(src, tmp_path / "plain", "plain.toml", "--lora", "merge", "--dtype", "fp32")
        / "model.safetensors"
    )
    got = load_file(
        convert(src, tmp_path / "got", "shifted.toml", "--lora", "merge", "--dtype", dtype)
        / "model.safetensors"
    )
    want_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    for key, offset in zip(HF_KEYS, (1.0, 1.0, -0.5), strict=True):
        want = (plain[key] + offset).to(want_dtype)
        assert got[key].dtype == want_dtype
        assert torch.equal(got[key], want), key


def test_adapter_shifts_the_embedding_base_layer_only(src: Path, tmp_path: Path) -> None:
    plain = load_file(
        convert(src, tmp_path / "plain", "plain.toml", "--lora", "adapter") / "adapter_model.safetensors"
    )
    got = load_file(
        convert(src, tmp_path / "got", "shifted.toml", "--lora", "adapter") / "adapter_model.safetensors"
    )
    assert sorted(got) == sorted(plain)
    base = "base_model.model.model.embed.base_layer.weight"
    for key in got:
        want = plain[key] + 1 if key == base else plain[key]
        assert torch.equal(got[key], want), key
