"""Mapping language additions for Megatron-Core (issue #16): a stack over two placeholders (layers x experts),
`[mapping.defaults]` for config keys config.json lacks, `multiple` as a size expression, a tied tensor read
back padded like its rule, and the `checkpoint` field. Pure: keys, parts and `blocks.place` on small tensors,
compared with explicit torch expressions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_mapping_ops import round_trip, values

from ckptconv.errors import CkptconvError
from ckptconv.mapping import KeyMapping, load_mapping
from ckptconv.mapping.rules import map_keys


def mapping(tmp_path: Path, rules: str, head: str = "") -> KeyMapping:
    path = tmp_path / "m.toml"
    path.write_text(f'[mapping]\nname = "t"\n{head}\n{rules}')
    return load_mapping(str(path))


EXPERTS_FC1 = """
[[rule]]
runtime = "experts.fc1"
hf = ["l.{layer}.e.{expert}.gate", "l.{layer}.e.{expert}.up"]
stack = ["layer", "expert"]
dim = 2
"""


def test_two_stacked_placeholders_with_a_split(tmp_path: Path) -> None:
    """Megatron's experts: [L, E, 2F, D] <-> per layer and expert gate [F, D], up [F, D]."""
    L, E, F, D = 2, 3, 4, 5
    w = values(L, E, 2 * F, D)
    expected = {}
    for layer in range(L):
        for e in range(E):
            gate, up = w[layer, e].chunk(2, dim=0)
            expected[f"l.{layer}.e.{e}.gate"], expected[f"l.{layer}.e.{e}.up"] = gate, up
    round_trip(mapping(tmp_path, EXPERTS_FC1), {"experts.fc1": w}, {}, expected)


def test_two_stacked_placeholders_from_a_later_dim(tmp_path: Path) -> None:
    """stack_dim 1: [D, L, E] <-> [D] per layer and expert."""
    rule = '[[rule]]\nruntime = "w"\nhf = "a.{i}.b.{j}"\nstack = ["i", "j"]\nstack_dim = 1\n'
    w = values(4, 2, 3)
    expected = {f"a.{i}.b.{j}": w[:, i, j] for i in range(2) for j in range(3)}
    round_trip(mapping(tmp_path, rule), {"w": w}, {}, expected)


def test_a_missing_element_of_two_stacks_is_named(tmp_path: Path) -> None:
    m = mapping(tmp_path, EXPERTS_FC1)
    shapes = {f"l.{layer}.e.{e}.{h}": (4, 5) for layer in range(2) for e in range(3) for h in ("gate", "up")}
    del shapes["l.1.e.0.up"]
    with pytest.raises(CkptconvError, match=r"'l\.1\.e\.0\.up' is missing"):
        map_keys(m, "to_runtime", shapes, {})


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ('runtime = "w"\nhf = "a.{i}"\nstack = ["i", "i"]', "list of different placeholders"),
        ('runtime = "w"\nhf = "a.{i}"\nstack = ["i", "j"]', r"needs \{j\} in every hf key"),
        ('runtime = "w.{j}"\nhf = "a.{i}.{j}"\nstack = ["i", "j"]', "without"),
        ('runtime = "w"\nhf = "a.{i}"\nstack = []', "list of different placeholders"),
    ],
)
def test_bad_stacks_are_refused(tmp_path: Path, rule: str, message: str) -> None:
    with pytest.raises(CkptconvError, match=message):
        mapping(tmp_path, f"[[rule]]\n{rule}\n")


VOCAB = """
[mapping.defaults]
make_vocab_size_divisible_by = 128
tensor_model_parallel_size = 1
parallel.width = 3

[[rule]]
runtime = "emb"
hf = "embed"
narrow = "vocab_size"
multiple = "make_vocab_size_divisible_by * tensor_model_parallel_size"

[[rule]]
runtime = "out"
hf = "head"
narrow = "vocab_size"
multiple = "make_vocab_size_divisible_by * tensor_model_parallel_size"
tied = "embed"
"""


@pytest.mark.parametrize(
    ("config", "padded"),
    [
        ({"vocab_size": 50}, 128),  # both defaults
        ({"vocab_size": 50, "make_vocab_size_divisible_by": 32, "tensor_model_parallel_size": 2}, 64),
        ({"vocab_size": 130, "make_vocab_size_divisible_by": 32}, 160),  # config.json wins, TP default
        ({"vocab_size": 128}, 128),  # a multiple already: no padding
    ],
)
def test_defaults_and_multiple_expression(tmp_path: Path, config: dict, padded: int) -> None:
    """The way back pads the vocabulary to a multiple given by config keys, defaults filling the gaps."""
    m = mapping(tmp_path, VOCAB, head="")
    V, D = config["vocab_size"], 3
    emb = torch.zeros(padded, D, dtype=torch.float64)
    emb[:V] = values(V, D)
    out = torch.zeros(padded, D, dtype=torch.float64)
    out[:V] = values(V, D) + 1000
    round_trip(m, {"emb": emb, "out": out}, config, {"embed": emb[:V], "head": out[:V]})


def test_defaults_table_is_parsed_with_dotted_keys(tmp_path: Path) -> None:
    m = mapping(tmp_path, VOCAB)
    assert dict(m.defaults) == {
        "make_vocab_size_divisible_by": 128,
        "tensor_model_parallel_size": 1,
        "parallel.width": 3,
    }
    rule = '[[rule]]\nruntime = "a"\nhf = ["b", "c"]\nsizes = ["parallel.w", "w"]\n'
    m = mapping(tmp_path, "[mapping.defaults]\nw = 4\nparallel.w = 2\n" + rule)
    split = map_keys(m, "to_hf", {"a": (6, 2)}, {"parallel": {}})
    assert {t.key: t.shape for t in split.targets} == {"b": (2, 2), "c": (4, 2)}
    split = map_keys(m, "to_hf", {"a": (6, 2)}, {"parallel": {"w": 5}, "w": 1})  # config.json wins
    assert {t.key: t.shape for t in split.targets} == {"b": (5, 2), "c": (1, 2)}


@pytest.mark.parametrize("value", ['"128"', "1.5", "true", "[1]"])
def test_a_default_must_be_an_integer(tmp_path: Path, value: str) -> None:
    with pytest.raises(CkptconvError, match="must be an integer"):
        mapping(tmp_path, f'[mapping.defaults]\nk = {value}\n[[rule]]\nruntime = "a"\nhf = "b"\n')


def test_a_missing_key_without_default_says_pass_config(tmp_path: Path) -> None:
    m = mapping(tmp_path, VOCAB.replace("tensor_model_parallel_size = 1\n", ""))
    with pytest.raises(CkptconvError, match=r"'tensor_model_parallel_size' is not an integer"):
        map_keys(m, "to_runtime", {"embed": (50, 3)}, {"vocab_size": 50})


def test_tied_reads_back_padded_like_its_rule(tmp_path: Path) -> None:
    """tie_word_embeddings: HF has no head; read back the runtime head is the embedding, padded with zeros
    to the same multiple as the embedding ([50, 3] -> [64, 3])."""
    m = mapping(tmp_path, VOCAB)
    config = {"vocab_size": 50, "make_vocab_size_divisible_by": 64, "tie_word_embeddings": True}
    back = map_keys(m, "to_runtime", {"embed": (50, 3)}, config)
    made = {t.key: t for t in back.targets}
    assert made["out"].shape == (64, 3) and made["out"].padded and made["out"].op == "tied+pad"
    assert made["emb"].shape == (64, 3) and made["emb"].padded
    to_hf = map_keys(m, "to_hf", {"emb": (64, 3), "out": (64, 3)}, config)
    assert [t.key for t in to_hf.targets] == ["embed"]


def test_checkpoint_field_and_unknown_header_fields(tmp_path: Path) -> None:
    rule = '[[rule]]\nruntime = "a"\nhf = "b"\n'
    assert mapping(tmp_path, rule).checkpoint == "dcp"
    assert mapping(tmp_path, rule, head='checkpoint = "megatron"').checkpoint == "megatron"
    with pytest.raises(CkptconvError, match="checkpoint 'nemo' is not one of dcp, megatron"):
        mapping(tmp_path, rule, head='checkpoint = "nemo"')
    with pytest.raises(CkptconvError, match=r"unknown \[mapping\] field\(s\) defualts"):
        mapping(tmp_path, rule, head="defualts = 1")
    assert load_mapping("megatron-gpt").checkpoint == "megatron"
    assert load_mapping("torchtitan-llama3").checkpoint == "dcp"
