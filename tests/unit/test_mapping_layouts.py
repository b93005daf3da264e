"""Runtime layouts, pure: `unbind` (a stacked [2, F, D] <-> two [F, D]) alone and under a stack over experts,
the [E, 2, F, D] <-> [E, 2F, D] reshape, and the layout read off the source's keys and shapes (to HF) or
picked by `--runtime-layout` (to runtime); a key no layout fits and a source mixing layouts are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_mapping_ops import mapping, round_trip, values

from ckptconv.errors import CkptconvError
from ckptconv.mapping import load_mapping
from ckptconv.mapping.rules import map_keys

FFN = """
[[mapping.layouts]]
name = "w1-w3"
group = "feed-forward"
description = "separate w1, w3 [F, D]"
default = true

[[mapping.layouts]]
name = "w13-interleaved"
group = "feed-forward"
description = "w13 [2F, D], gate rows even, up rows odd"

[[mapping.layouts]]
name = "w13-stacked"
group = "feed-forward"
description = "w13 [2, F, D]"

[[rule]]
runtime = "l.{layer}.w1"
hf = "m.{layer}.gate"
layout = "w1-w3"

[[rule]]
runtime = "l.{layer}.w3"
hf = "m.{layer}.up"
layout = "w1-w3"

[[rule]]
runtime = "l.{layer}.w13"
hf = ["m.{layer}.gate", "m.{layer}.up"]
interleave = true
layout = "w13-interleaved"
ndim = 2

[[rule]]
runtime = "l.{layer}.w13"
hf = ["m.{layer}.gate", "m.{layer}.up"]
unbind = true
layout = "w13-stacked"
ndim = 3

[[rule]]
runtime = "l.{layer}.w2"
hf = "m.{layer}.down"
"""


def ffn(tmp_path: Path, layout: str | None = None):
    (tmp_path / "ffn.toml").write_text('[mapping]\nname = "ffn"\n' + FFN)
    return load_mapping(str(tmp_path / "ffn.toml"), runtime_layout=layout)


def test_unbind_a_stacked_pair(tmp_path: Path) -> None:
    """[2, F, D] <-> gate [F, D] (slice 0), up [F, D] (slice 1)."""
    m = mapping(tmp_path, '[[rule]]\nruntime = "w13"\nhf = ["gate", "up"]\nunbind = true\n')
    w = values(2, 4, 3)
    round_trip(m, {"w13": w}, {}, {"gate": w[0], "up": w[1]})


def test_experts_stacked_with_their_pair(tmp_path: Path) -> None:
    """[E, 2, F, D] <-> per expert gate [F, D] = w[e, 0], up [F, D] = w[e, 1]."""
    rule = '[[rule]]\nruntime = "w"\nhf = ["e.{expert}.gate", "e.{expert}.up"]\nstack = "expert"\n'
    m = mapping(tmp_path, rule + "unbind = true\ndim = 1\n")
    w = values(3, 2, 4, 5)
    hf = {f"e.{e}.{n}": w[e, i] for e in range(3) for i, n in enumerate(("gate", "up"))}
    round_trip(m, {"w": w}, {}, hf)


def test_experts_pair_reshaped_to_fused_gate_up(tmp_path: Path) -> None:
    """[E, 2, F, D] <-> gate_up [E, 2F, D] (gate rows first): the same elements, one reshape."""
    rule = '[[rule]]\nruntime = "w"\nhf = "gate_up"\nhf_shape = [-1, -1, "d"]\n'
    m = mapping(tmp_path, rule + 'runtime_shape = [-1, 2, -1, "d"]\n')
    w = values(3, 2, 4, 5)
    round_trip(m, {"w": w}, {"d": 5}, {"gate_up": torch.cat([w[:, 0], w[:, 1]], dim=1)})


@pytest.mark.parametrize("layout", ["w1-w3", "w13-interleaved", "w13-stacked"])
def test_each_layout_is_read_from_its_keys_and_shapes_and_written_when_named(tmp_path: Path, layout) -> None:
    gate, up, down = values(4, 3), values(4, 3) + 100, values(3, 4)
    hf = {"m.0.gate": gate, "m.0.up": up, "m.0.down": down}
    runtime = {
        "w1-w3": {"l.0.w1": gate, "l.0.w3": up},
        "w13-interleaved": {"l.0.w13": torch.stack([gate, up], dim=1).reshape(8, 3)},
        "w13-stacked": {"l.0.w13": torch.stack([gate, up])},
    }[layout] | {"l.0.w2": down}
    round_trip(ffn(tmp_path, layout), runtime, {}, hf)
    # to HF the layout comes from the source alone, whatever hf-to-dcp would write
    shapes = {k: tuple(v.shape) for k, v in runtime.items()}
    assert {t.key for t in map_keys(ffn(tmp_path), "to_hf", shapes, {}).targets} == set(hf)


def test_default_layout_written_and_bad_names_refused(tmp_path: Path) -> None:
    hf = {"m.0.gate": (4, 3), "m.0.up": (4, 3), "m.0.down": (3, 4)}
    keys = {t.key for t in map_keys(ffn(tmp_path), "to_runtime", hf, {}).targets}
    assert keys == {"l.0.w1", "l.0.w3", "l.0.w2"}
    with pytest.raises(CkptconvError, match=r"--runtime-layout 'w13': not a layout of .* \(known: w1-w3, "):
        ffn(tmp_path, "w13")
    with pytest.raises(CkptconvError, match="both layouts of 'feed-forward'"):
        ffn(tmp_path, "w13-stacked,w1-w3")


def test_a_shape_no_layout_fits_and_mixed_layouts_are_refused(tmp_path: Path) -> None:
    m = ffn(tmp_path)
    with pytest.raises(CkptconvError) as e:
        map_keys(m, "to_hf", {"l.0.w13": (2, 2, 4, 3), "l.0.w2": (3, 4)}, {})
    assert "'l.0.w13' [2, 2, 4, 3] fits none of the runtime layouts of feed-forward" in str(e.value)
    assert "w13-interleaved (w13 [2F, D], gate rows even, up rows odd); w13-stacked (w13 [2, F, D])" in str(
        e.value
    )
    mixed = {"l.0.w13": (8, 3), "l.1.w13": (2, 4, 3), "l.0.w2": (3, 4), "l.1.w2": (3, 4)}
    with pytest.raises(CkptconvError, match=r"mixes runtime layouts of feed-forward: 'l.0.w13' \[8, 3\] is "):
        map_keys(m, "to_hf", mixed, {})
    with pytest.raises(CkptconvError, match="mixes runtime layouts"):
        map_keys(m, "to_hf", {"l.0.w1": (4, 3), "l.0.w3": (4, 3), "l.1.w13": (2, 4, 3)}, {})


@pytest.mark.parametrize(
    ("head", "message"),
    [
        ('[[mapping.layouts]]\nname = "a"\n', "group 'runtime' needs exactly one default"),
        ('[[mapping.layouts]]\nname = "a"\ndefault = true\nextra = 1\n', "unknown field"),
        ("", "layout 'a' is not a \\[\\[mapping.layouts\\]\\] name"),
    ],
)
def test_bad_layout_declarations_are_named(tmp_path: Path, head: str, message: str) -> None:
    (tmp_path / "m.toml").write_text(
        f'[mapping]\nname = "t"\n{head}\n[[rule]]\nruntime = "a"\nhf = "b"\nlayout = "a"\n'
    )
    with pytest.raises(CkptconvError, match=message):
        load_mapping(str(tmp_path / "m.toml"))


def test_presets_default_to_torchtitan_0_3_and_the_official_hf_releases() -> None:
    """hf-to-dcp writes torchtitan 0.3.0's layouts unless told; Qwen3.5-MoE's experts are written fused, as
    Qwen's releases hold them; DeepSeek-V3 writes its MTP layers' embedding and head copies."""
    titan = ("llama3", "qwen3", "qwen3_5", "deepseek-v3", "kimi-k2_7")
    for preset in (f"torchtitan-{name}" for name in titan):
        m = load_mapping(preset)
        assert set(m.written_layouts().values()) <= {"w1-w3", "experts-EFD"}, preset
        assert "w13-stacked" in {x.name for x in m.layouts}
    kimi = {x.name for x in load_mapping("torchtitan-kimi-k2_7").layouts}
    assert kimi == {x.name for x in load_mapping("torchtitan-deepseek-v3").layouts}
    assert load_mapping("torchtitan-qwen3_5").hf_experts == "fused"
    assert load_mapping("torchtitan-qwen3").hf_experts == "per_expert"
    copies = [r.hf for r in load_mapping("torchtitan-deepseek-v3").rules if r.duplicate]
    assert [len(hf) for hf in copies] == [2, 2] and all(
        r.layout is None for r in load_mapping("torchtitan-deepseek-v3").rules if r.duplicate
    )
