"""The runtime layouts torchtitan has written since 0.3.0, against the other projects' own code.

Each case starts from torchtitan 0.3.0's own runtime state (its StateDictAdapter.from_hf of a tiny
transformers model where that adapter is right; else the preset's hf-to-dcp, which test_presets_v2 pins to
torchtitan's model and fixed math) and rebuilds the later layouts with the math of torchtitan's PRs:

- PR #4535: dense `feed_forward.w13.weight` [2F, D], rows interleaved (gate row i at 2i, up row i at 2i + 1);
- PR #4808: the same key stacked, [2, F, D] (gate, then up);
- PRs #4643 / #4667: routed experts `w1_EFD` [E, 2, F, D] (gate, up per expert), no `w3_EFD`.

Saved with dcp.save by one process and by two ranks (Shard(0), so a stacked pair splits across ranks), each
goes dcp-to-hf with the preset to the HF tensors bit for bit (the same bytes from both saves) and loads in
transformers with no missing or unexpected keys; hf-to-dcp --runtime-layout writes the same layout back
(and verifies it); a w13 of a shape no layout has, and a checkpoint mixing layouts, are exit 2 naming the key,
its shape and the layouts known.

Two cases go again through torchrun at two ranks: hf-to-dcp --runtime-layout writes a DCP that reads back as
the one-process one, and dcp-to-hf of either (and of the two-rank Shard(0) save), at one and two converting
ranks, writes the same bytes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import WORKERS, ckptconv, torchrun, tree_sha256
from families import auto_class, tiny
from safetensors.torch import load_file
from test_bad_input import run
from test_dcp_to_hf import load_dir, same_bits
from test_hf_to_dcp import load_plain
from test_presets_v2 import without_mtp_copies
from titan import run_adapter

from ckptconv.mapping import load_mapping

# name: (transformers family, its options, torchtitan family (None: the 0.3.0 adapter is wrong for these
# experts, the preset's hf-to-dcp stands in), preset, --hf-experts of the HF files)
CASES = {
    "llama": ("llama", {}, "llama3", "torchtitan-llama3", None),
    "qwen3_moe": ("qwen3", {"moe": True, "experts": 3}, "qwen3", "torchtitan-qwen3", "per_expert"),
    "deepseek_v3_mtp": (
        "deepseek_v3",
        {"q_lora": False, "mtp": 1, "experts": 3},
        "deepseek_v3",
        "torchtitan-deepseek-v3",
        "per_expert",
    ),
    "qwen3_5_moe_fused": (
        "qwen3_5_moe",
        {"fused_experts": True, "experts": 3},
        None,
        "torchtitan-qwen3_5",
        "fused",
    ),
    # DeepSeek-V3's text tower under `language_model.`, with MoonViT beside it
    "kimi_k25": (
        "kimi_k25",
        {"released": True, "experts": 3},
        "kimi_k2_7",
        "torchtitan-kimi-k2_7",
        "per_expert",
    ),
}
LAYOUTS = {  # --runtime-layout value: (dense feed-forward, routed experts)
    "w13-interleaved": ("interleaved", None),
    "w13-stacked,experts-E2FD": ("stacked", "E2FD"),
}
# (case, --runtime-layout) converted again at two ranks: experts per expert and fused in the HF files
AT_TWO_RANKS = [("kimi_k25", "w13-stacked,experts-E2FD"), ("qwen3_5_moe_fused", "w13-stacked,experts-E2FD")]
DENSE = re.compile(r"(.*)\.w1\.weight")
EXPERTS = re.compile(r"(.*)\.w1_EFD")


def relayout(state: dict[str, torch.Tensor], dense: str, experts: str | None) -> dict[str, torch.Tensor]:
    """torchtitan 0.3.0's state in a later layout, by the PRs' math (see the module docstring)."""
    out = dict(state)
    for key in list(state):
        if (m := DENSE.fullmatch(key)) is not None:
            gate, up = out.pop(key), out.pop(f"{m[1]}.w3.weight")
            pair = (
                torch.stack([gate, up], dim=1).reshape(-1, gate.shape[1]) if dense == "interleaved" else None
            )
            out[f"{m[1]}.w13.weight"] = torch.stack([gate, up]) if pair is None else pair
        elif experts and (m := EXPERTS.fullmatch(key)) is not None:
            out[key] = torch.stack([out[key], out.pop(f"{m[1]}.w3_EFD")], dim=1).contiguous()
    return out


def tensors(state: dict[str, object]) -> dict[str, torch.Tensor]:
    """The tensors of a loaded state (less DCP's non-tensor entries)."""
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def titan_state(name: str, hf_dir: Path, tmp_path: Path, capsys) -> dict[str, torch.Tensor]:
    """torchtitan 0.3.0's runtime state of the HF model (see CASES)."""
    titan_family, preset = CASES[name][2:4]
    code, err = run(capsys, "hf-to-dcp", str(hf_dir), str(tmp_path / "base"), "--mapping", preset)
    assert code == 0, err
    ours = tensors(load_plain(tmp_path / "base"))
    if titan_family is None:
        return ours
    config = json.loads((hf_dir / "config.json").read_text())
    src = without_mtp_copies(hf_dir, tmp_path / "adapter_in", config) if "mtp" in name else hf_dir
    run_adapter(titan_family, "from_hf", config, src, tmp_path / "titan.st")
    titan = {k: v for k, v in load_file(tmp_path / "titan.st").items() if k in ours}
    assert titan.keys() == ours.keys() and all(same_bits(ours[k], titan[k]) for k in ours)
    return titan


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", CASES)
def test_later_torchtitan_layouts_convert_both_ways(name: str, layout: str, tmp_path: Path, capsys) -> None:
    family, options, _, preset, hf_experts = CASES[name]
    hf_dir = tiny(family, tmp_path / "hf", **options)
    hf = load_dir(hf_dir)
    state = relayout(titan_state(name, hf_dir, tmp_path, capsys), *LAYOUTS[layout])
    known = {x.name for x in load_mapping(preset).layouts}
    layout = ",".join(n for n in layout.split(",") if n in known)  # Llama has no routed experts
    torch.save(state, tmp_path / "state.pt")
    dcp.save({"model": state}, checkpoint_id=str(tmp_path / "one"), no_dist=True)
    torchrun(2, str(WORKERS / "save_sharded_state.py"), str(tmp_path / "state.pt"), str(tmp_path / "two"))
    flags = ["--mapping", preset, "--copy-from", str(hf_dir), "--dtype", "keep"]
    flags += ["--hf-experts", hf_experts] if hf_experts else []
    for ckpt in ("one", "two"):
        code, err = run(capsys, "dcp-to-hf", str(tmp_path / ckpt), str(tmp_path / f"hf_{ckpt}"), *flags)
        assert code == 0, err
    assert tree_sha256(tmp_path / "hf_one") == tree_sha256(tmp_path / "hf_two")
    back = load_dir(tmp_path / "hf_one")
    assert back.keys() == hf.keys() and all(same_bits(back[k], hf[k]) for k in hf)
    _, info = auto_class(family, **options).from_pretrained(tmp_path / "hf_one", output_loading_info=True)
    _, original = auto_class(family, **options).from_pretrained(hf_dir, output_loading_info=True)
    assert not info["missing_keys"] and info["unexpected_keys"] == original["unexpected_keys"], info
    # the way back writes the layout named, the same tensors (--verify maps them to HF again: the layout
    # read off what was written)
    again = ["hf-to-dcp", str(hf_dir), str(tmp_path / "again"), "--mapping", preset, "--verify"]
    code, err = run(capsys, *again, "--runtime-layout", layout)
    assert code == 0, err
    again = tensors(load_plain(tmp_path / "again"))
    assert again.keys() == state.keys() and all(same_bits(again[k], state[k]) for k in state)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "layout"), AT_TWO_RANKS)
def test_layouts_are_the_same_bytes_at_one_and_two_ranks(
    name: str, layout: str, tmp_path: Path, capsys
) -> None:
    """hf-to-dcp --runtime-layout at two ranks writes what one process writes (the layout's math on the
    default, which the test above pins to torchtitan's); dcp-to-hf of either, at one and two ranks, and of
    the same state saved FSDP-style (Shard(0) over two ranks: a stacked pair split across them) at two ranks,
    writes the same bytes, the HF tensors bit for bit."""
    family, options, _, preset, hf_experts = CASES[name]
    hf_dir = tiny(family, tmp_path / "hf", **options)
    code, err = run(capsys, "hf-to-dcp", str(hf_dir), str(tmp_path / "base"), "--mapping", preset)
    assert code == 0, err
    state = relayout(tensors(load_plain(tmp_path / "base")), *LAYOUTS[layout])
    to_dcp = ["hf-to-dcp", str(hf_dir), "--mapping", preset, "--runtime-layout", layout]
    code, err = run(capsys, *to_dcp[:2], str(tmp_path / "one"), *to_dcp[2:])
    assert code == 0, err
    proc = ckptconv(*to_dcp[:2], str(tmp_path / "two"), *to_dcp[2:], nproc=2)
    assert proc.returncode == 0, proc.stderr
    for ckpt in ("one", "two"):
        written = tensors(load_plain(tmp_path / ckpt))
        assert written.keys() == state.keys() and all(same_bits(written[k], state[k]) for k in state), ckpt
    torch.save(state, tmp_path / "state.pt")
    torchrun(2, str(WORKERS / "save_sharded_state.py"), str(tmp_path / "state.pt"), str(tmp_path / "fsdp"))
    flags = ["--mapping", preset, "--copy-from", str(hf_dir), "--dtype", "keep", "--max-shard-size", "20KB"]
    flags += ["--hf-experts", hf_experts]
    trees = []
    for ckpt, nproc in (("one", 0), ("one", 2), ("two", 2), ("fsdp", 2)):
        args = ["dcp-to-hf", str(tmp_path / ckpt), str(tmp_path / f"hf_{ckpt}_{nproc}"), *flags]
        if nproc:
            proc = ckptconv(*args, nproc=nproc)
            assert proc.returncode == 0, proc.stderr
        else:
            code, err = run(capsys, *args)
            assert code == 0, err
        trees.append(tree_sha256(tmp_path / f"hf_{ckpt}_{nproc}"))
    assert len(trees[0]) > 1 and all(tree == trees[0] for tree in trees), trees
    hf, back = load_dir(hf_dir), load_dir(tmp_path / "hf_one_0")
    assert back.keys() == hf.keys() and all(same_bits(back[k], hf[k]) for k in hf)


@pytest.mark.slow
def test_a_shape_no_layout_has_and_mixed_layouts_are_refused(tmp_path: Path, capsys) -> None:
    hf_dir = tiny("llama", tmp_path / "hf")
    code, err = run(
        capsys, "hf-to-dcp", str(hf_dir), str(tmp_path / "base"), "--mapping", "torchtitan-llama3"
    )
    assert code == 0, err
    state = {k: v for k, v in load_plain(tmp_path / "base").items() if isinstance(v, torch.Tensor)}
    stacked = relayout(state, "stacked", None)
    interleaved = relayout(state, "interleaved", None)
    flat = {
        **stacked,
        "layers.1.feed_forward.w13.weight": stacked["layers.1.feed_forward.w13.weight"].flatten(),
    }
    mixed = {**stacked, "layers.0.feed_forward.w13.weight": interleaved["layers.0.feed_forward.w13.weight"]}
    for what, bad in (("flat", flat), ("mixed", mixed)):
        dcp.save({"model": bad}, checkpoint_id=str(tmp_path / what), no_dist=True)
        out = tmp_path / f"hf_{what}"
        code, err = run(capsys, "dcp-to-hf", str(tmp_path / what), str(out), "--mapping", "torchtitan-llama3")
        assert code == 2 and len(err.strip().splitlines()) == 1 and not out.exists(), err
        assert "w1-w3 (torchtitan 0.3.0: feed_forward.w1 / w3 [F, D]); w13-interleaved (" in err
        shape = list(bad["layers.1.feed_forward.w13.weight"].shape)
        if what == "flat":
            assert f"'layers.1.feed_forward.w13.weight' {shape} fits none of the runtime layouts" in err
        else:
            assert "mixes runtime layouts of feed-forward: 'layers.0.feed_forward.w13.weight' [" in err
    code, err = run(
        capsys, "hf-to-dcp", str(hf_dir), str(tmp_path / "x"), "--mapping", "torchtitan-llama3",
        "--runtime-layout", "experts-E2FD",
    )  # fmt: skip
    assert code == 2 and "--runtime-layout 'experts-E2FD': not a layout of --mapping torchtitan-llama3" in err
    code, err = run(capsys, "hf-to-dcp", str(hf_dir), str(tmp_path / "y"), "--runtime-layout", "w13-stacked")
    assert code == 2 and "--runtime-layout picks a layout of a mapping; pass --mapping too" in err
