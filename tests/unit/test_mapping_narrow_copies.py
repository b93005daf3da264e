"""`narrow` with `duplicate` (DeepSeek-V3's per-MTP-layer copies of a vocabulary-padded embedding and head),
pure: to HF every copy narrowed like the main key; `duplicate = "reference"` writes a copy only where the
reference holds it; read back, the first key is padded and the copies are checked against it and dropped."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from test_mapping_ops import execute, mapping, values

from ckptconv.errors import CkptconvError
from ckptconv.mapping.rules import map_keys

RULES = """
[mapping.ranges]
mtp = { below = "num_nextn_predict_layers", default = 0 }

[[rule]]
runtime = "embedding.weight"
hf = ["model.embed_tokens.weight", "model.layers.{mtp + num_hidden_layers}.embed_tokens.weight"]
duplicate = DUPLICATE
narrow = "vocab_size"
multiple = 8

[[rule]]
runtime = "mtp.layers.{mtp}.enorm.weight"
hf = "model.layers.{mtp + num_hidden_layers}.enorm.weight"
"""
CONFIG = {"vocab_size": 5, "num_hidden_layers": 3, "num_nextn_predict_layers": 2}
COPIES = ("model.layers.3.embed_tokens.weight", "model.layers.4.embed_tokens.weight")


def runtime() -> dict[str, torch.Tensor]:
    return {
        "embedding.weight": values(8, 3),
        "mtp.layers.0.enorm.weight": values(3),
        "mtp.layers.1.enorm.weight": values(3) + 1,
    }


def _rules(tmp_path: Path, duplicate: str) -> object:
    head, rules = RULES.split("\n[[rule]]", 1)
    return mapping(tmp_path, "[[rule]]" + rules.replace("DUPLICATE", duplicate), head)


def test_every_copy_is_narrowed_and_read_back_padded(tmp_path: Path) -> None:
    m = _rules(tmp_path, "true")
    src = runtime()
    mapped = map_keys(m, "to_hf", {k: tuple(v.shape) for k, v in src.items()}, CONFIG)
    hf = execute(mapped.targets, src, random.Random(0))
    for key in ("model.embed_tokens.weight", *COPIES):
        assert torch.equal(hf[key], src["embedding.weight"][:5]), key
    back = map_keys(m, "to_runtime", {k: tuple(v.shape) for k, v in hf.items()}, CONFIG)
    assert sorted(back.same) == sorted((c, "model.embed_tokens.weight") for c in COPIES)
    got = execute(back.targets, hf, random.Random(0))
    assert got.keys() == src.keys()
    want = src["embedding.weight"].clone()
    want[5:] = 0
    assert torch.equal(got["embedding.weight"], want)


def test_reference_copies_follow_the_reference(tmp_path: Path) -> None:
    m = _rules(tmp_path, '"reference"')
    shapes = {k: tuple(v.shape) for k, v in runtime().items()}
    alone = {t.key for t in map_keys(m, "to_hf", shapes, CONFIG).targets}
    assert "model.embed_tokens.weight" in alone and not alone & set(COPIES)
    one = {t.key for t in map_keys(m, "to_hf", shapes, CONFIG, reference=[COPIES[1]]).targets}
    assert one & set(COPIES) == {COPIES[1]}
    both = map_keys(m, "to_hf", shapes, CONFIG, reference=COPIES).targets
    assert {t.key for t in both} >= set(COPIES)
    assert all(t.shape == (5, 3) for t in both if "embed_tokens" in t.key)


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ('runtime = "a"\nhf = ["b", "c"]\nduplicate = "yes"', 'duplicate must be true, false or "reference"'),
        ('runtime = "a"\nhf = ["b", "c"]\nduplicate = true\nhf_shape = [2, 2]', "narrow and hf_shape need"),
        ('runtime = "a"\nhf = ["b", "c"]\nnarrow = 3', "narrow and hf_shape need one runtime key"),
    ],
)
def test_refusals(tmp_path: Path, rule: str, message: str) -> None:
    with pytest.raises(CkptconvError, match=message):
        mapping(tmp_path, "[[rule]]\n" + rule)
