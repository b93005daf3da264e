"""`layout = [A, B]`: a rule that applies only when every named runtime layout (each of another group) is in
effect, read off a checkpoint's keys for each of its groups; refused when a name is unknown or two share a
group. Pure."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_mapping_ops import mapping

from ckptconv.errors import CkptconvError
from ckptconv.mapping import load_mapping
from ckptconv.mapping.layouts import detect
from ckptconv.mapping.patterns import Scope
from ckptconv.mapping.rules import map_keys

HEAD = """
[[mapping.layouts]]
name = "fused"
group = "format"
default = true

[[mapping.layouts]]
name = "halves"
group = "format"

[[mapping.layouts]]
name = "new"
group = "inner"
default = true

[[mapping.layouts]]
name = "old"
group = "inner"
"""
RULES = """
[[rule]]
runtime = "{inner}.fc1.weight"
hf = ["gate", "up"]
layout = ["fused", "{group}"]

[[rule]]
runtime = "{inner}.fc1.weight_w"
hf = "gate"
layout = ["halves", "{group}"]

[[rule]]
runtime = "{inner}.fc1.weight_v"
hf = "up"
layout = ["{group}", "halves"]
"""
SHAPES = {"gate": (2, 3), "up": (2, 3)}


def _mapping(tmp_path: Path, layouts: str | None = None) -> object:
    rules = RULES.format(inner="new_layer", group="new") + RULES.format(inner="old_layer", group="old")
    m = mapping(tmp_path, rules, HEAD)
    return m if layouts is None else load_mapping(str(tmp_path / "m.toml"), runtime_layout=layouts)


@pytest.mark.parametrize(
    ("layouts", "keys", "found"),
    [
        (None, ["new_layer.fc1.weight"], ("fused", "new")),
        ("old", ["old_layer.fc1.weight"], ("fused", "old")),
        ("halves", ["new_layer.fc1.weight_w", "new_layer.fc1.weight_v"], ("halves", "new")),
        ("halves,old", ["old_layer.fc1.weight_w", "old_layer.fc1.weight_v"], ("halves", "old")),
    ],
)
def test_each_pair_of_layouts_writes_its_own_keys_and_is_read_back(
    tmp_path: Path, layouts: str | None, keys: list[str], found: tuple[str, str]
) -> None:
    m = _mapping(tmp_path, layouts)
    made = map_keys(m, "to_runtime", SHAPES, {})
    assert sorted(t.key for t in made.targets) == sorted(keys)
    shapes = {t.key: t.shape for t in made.targets}
    assert detect(m, shapes, Scope({}, {}, "t")) == dict(zip(("format", "inner"), found, strict=True))
    back = map_keys(m, "to_hf", shapes, {})
    assert sorted(t.key for t in back.targets) == ["gate", "up"]


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ('["fused", "halves"]', "'fused' and 'halves' are both of group 'format'"),
        ('["fused", "nope"]', "layout 'nope' is not a \\[\\[mapping.layouts\\]\\] name"),
        ('["fused", "fused"]', "a list of different names"),
        ("[]", "a list of different names"),
        ("[1]", "a list of different names"),
    ],
)
def test_bad_layout_lists_are_refused(tmp_path: Path, layout: str, message: str) -> None:
    with pytest.raises(CkptconvError, match=message):
        mapping(tmp_path, f'[[rule]]\nruntime = "a"\nhf = "b"\nlayout = {layout}\n', HEAD)
