"""Ranges of one layer type (`{ where = "layer_types", equals = "linear_attention" }`): a placeholder takes
the indices whose entry of a config.json list is that type, so one HF key maps to a different runtime name
per layer type, both ways; every bad range or config list is one CkptconvError naming the key and the range.
Pure: keys, parts and values on small tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_mapping_ops import round_trip, values

from ckptconv.errors import CkptconvError
from ckptconv.mapping import KeyMapping, load_mapping
from ckptconv.mapping.patterns import MAX_TYPES, Pattern, Range, Scope
from ckptconv.mapping.rules import map_keys

HEAD = """
[mapping.ranges]
layer = "n"
full = { where = "cfg.types", equals = "full", below = "n" }
linear = { where = "cfg.types", equals = "linear" }
"""
RULES = """
[[rule]]
runtime = "layers.{full}.qkv.norm"
hf = "layers.{full}.input_norm"

[[rule]]
runtime = "layers.{linear}.in_proj.norm"
hf = "layers.{linear}.input_norm"

[[rule]]
runtime = "layers.{layer}.out"
hf = "layers.{layer}.o"
"""
CONFIG = {"n": 4, "cfg": {"types": ["linear", "linear", "full", "linear"]}}


def mapping(tmp_path: Path, rules: str = RULES, head: str = HEAD) -> KeyMapping:
    path = tmp_path / "m.toml"
    path.write_text(f'[mapping]\nname = "t"\n{head}\n{rules}')
    return load_mapping(str(path))


def test_each_layer_type_keeps_its_runtime_name_both_ways(tmp_path: Path) -> None:
    runtime: dict[str, torch.Tensor] = {}
    hf: dict[str, torch.Tensor] = {}
    for i, kind in enumerate(CONFIG["cfg"]["types"]):  # type: ignore[index]
        norm, out = values(3) + 10 * i, values(2, 3) + 10 * i
        name = "qkv" if kind == "full" else "in_proj"
        runtime[f"layers.{i}.{name}.norm"], runtime[f"layers.{i}.out"] = norm, out
        hf[f"layers.{i}.input_norm"], hf[f"layers.{i}.o"] = norm, out
    round_trip(mapping(tmp_path), runtime, CONFIG, hf)
    back = map_keys(mapping(tmp_path), "to_runtime", {k: tuple(v.shape) for k, v in hf.items()}, CONFIG)
    assert sorted(t.key for t in back.targets if t.key.endswith(".norm")) == [
        "layers.0.in_proj.norm",
        "layers.1.in_proj.norm",
        "layers.2.qkv.norm",
        "layers.3.in_proj.norm",
    ]


def test_a_key_of_the_other_type_is_not_matched() -> None:
    ranges = {"full": Range("n", None, "types", "full")}
    scope = Scope({"n": 3, "types": ["full", "linear", "full"]}, ranges, "--mapping")
    pattern = Pattern("layers.{full}.qkv")
    got = [pattern.match(f"layers.{i}.qkv", scope) for i in range(4)]
    assert got == [{"full": 0}, None, {"full": 2}, None]


def test_a_runtime_key_on_a_layer_of_the_other_type_is_unmapped(tmp_path: Path) -> None:
    """The config says what each layer is: a full-attention norm on a delta-net layer is not taken."""
    shapes = {"layers.0.qkv.norm": (3,)}
    with pytest.raises(CkptconvError, match=r"no rule maps 'layers\.0\.qkv\.norm'"):
        map_keys(mapping(tmp_path), "to_hf", shapes, CONFIG)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"n": 4}, r"needs config\.json's 'cfg\.types', a list of layer types; pass --config"),
        ({"n": 4, "cfg": {"types": "full"}}, r"needs config\.json's 'cfg\.types'"),
        ({"n": 4, "cfg": {"types": ["full", 1, "x", "y"]}}, r"'cfg\.types' has an entry of type int"),
        ({"n": 3, "cfg": {"types": ["full"] * 4}}, r"'cfg\.types' has 4 entries, not 3 \(n\)"),
        ({"cfg": {"types": ["full"] * 4}}, r"the range of \{full\} needs 'n' from config\.json"),
    ],
)
def test_a_bad_config_list_is_one_error_naming_key_and_range(
    tmp_path: Path, config: dict[str, object], message: str
) -> None:
    m = mapping(tmp_path)
    with pytest.raises(CkptconvError, match=message) as err:
        map_keys(m, "to_runtime", {"layers.0.input_norm": (3,)}, config)
    text = str(err.value)
    assert "\n" not in text and text.startswith("--mapping: ")
    assert "{full}" in text or "{linear}" in text


def test_a_list_longer_than_the_limit_is_refused() -> None:
    ranges = {"t": Range(None, None, "types", "a")}
    scope = Scope({"types": ["a"] * (MAX_TYPES + 1)}, ranges, "--mapping")
    with pytest.raises(CkptconvError, match=rf"'types' has {MAX_TYPES + 1} entries, more than {MAX_TYPES}"):
        Pattern("l.{t}").match("l.0", scope)
    fits = Scope({"types": ["a"] * MAX_TYPES}, ranges, "--mapping")
    assert Pattern("l.{t}").match(f"l.{MAX_TYPES - 1}", fits) == {"t": MAX_TYPES - 1}
    assert Pattern("l.{t}").match(f"l.{MAX_TYPES}", fits) is None


def test_a_stack_over_a_layer_type_range_is_refused(tmp_path: Path) -> None:
    rules = '[[rule]]\nruntime = "w"\nhf = "layers.{linear}.w"\nstack = "linear"\n'
    m = mapping(tmp_path, rules)
    with pytest.raises(CkptconvError, match=r"\{linear\} ranges over the layers whose cfg\.types is"):
        map_keys(m, "to_runtime", {"layers.0.w": (2,), "layers.1.w": (2,)}, CONFIG)


@pytest.mark.parametrize(
    "spec",
    [
        '{ where = "layer_types" }',
        '{ equals = "linear_attention" }',
        '{ where = "layer_types", equals = "" }',
        '{ where = "layer_types", equals = 1 }',
        '{ where = 3, equals = "x" }',
        '{ where = "a..b", equals = "x" }',
        '{ where = "layer_types[0]", equals = "x" }',
        '{ where = "layer_types", equals = "x", default = 0 }',
        '{ where = "layer_types", equals = "x", below = true }',
        '{ where = "layer_types", equals = "x", below = [1] }',
        '{ where = "layer_types", equals = ["x"] }',
        '{ where = "layer_types", equals = "x", every = "k" }',
        '{ where = "layer_types", equals = "x", below = "n", every = true }',
        '{ where = "layer_types", equals = "x", below = "n", between = true }',
        '{ where = "layer_types", equals = "x", below = "n", every = "k", between = 1 }',
    ],
)
def test_a_bad_layer_type_range_is_refused_when_read(tmp_path: Path, spec: str) -> None:
    with pytest.raises(CkptconvError, match=r"range of 'linear' must be \{ where = config key") as err:
        mapping(tmp_path, RULES, f"[mapping.ranges]\nlayer = 'n'\nfull = 'n'\nlinear = {spec}\n")
    assert "\n" not in str(err.value)


def test_the_plain_range_message_names_the_new_form(tmp_path: Path) -> None:
    with pytest.raises(CkptconvError, match=r"a size, \{ below = size, default = integer \} or \{ where"):
        mapping(tmp_path, RULES, "[mapping.ranges]\nlayer = { below = 'n', default = 'x' }\n")


EVERY = """
[mapping.ranges]
layer = "n"
full = { where = "cfg.types", equals = "full", below = "n", every = "cfg.interval" }
linear = { where = "cfg.types", equals = "linear", below = "n", every = "cfg.interval", between = true }
"""


def test_without_the_list_every_interval_th_layer_is_of_the_type(tmp_path: Path) -> None:
    """Qwen3-Next's released config.json gives `full_attention_interval` and no `layer_types`: the layers
    are typed as transformers types them (i + 1 a multiple of the interval: full attention), and the same
    list given explicitly maps the same keys; the list wins where both are given."""
    derived = {"n": 8, "cfg": {"interval": 4}}
    types = ["linear"] * 3 + ["full"] + ["linear"] * 3 + ["full"]
    listed = {"n": 8, "cfg": {"types": types, "interval": 2}}
    shapes = {f"layers.{i}.input_norm": (3,) for i in range(8)} | {f"layers.{i}.o": (2, 3) for i in range(8)}
    m = mapping(tmp_path, head=EVERY)
    got = {
        name: sorted(t.key for t in map_keys(m, "to_runtime", shapes, cfg).targets)
        for name, cfg in (("derived", derived), ("listed", listed))
    }
    assert got["derived"] == got["listed"]
    full = [k for k in got["derived"] if k.endswith(".qkv.norm")]
    assert full == ["layers.3.qkv.norm", "layers.7.qkv.norm"]


@pytest.mark.parametrize("interval", [None, 0])
def test_without_list_or_interval_is_one_error(tmp_path: Path, interval: int | None) -> None:
    cfg: dict = {"n": 4, "cfg": {} if interval is None else {"interval": interval}}
    shapes = {f"layers.{i}.input_norm": (3,) for i in range(4)}
    with pytest.raises(CkptconvError, match=r"cfg\.types|cfg\.interval") as err:
        map_keys(mapping(tmp_path, head=EVERY), "to_runtime", shapes, cfg)
    assert "\n" not in str(err.value)
