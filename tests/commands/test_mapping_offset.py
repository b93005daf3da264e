"""A rule's `offset` (Megatron's zero-centred norms: HF = runtime + 1) through the real CLI, both ways: values
computed in float32 and cast once, whole or slab by slab, at 1 and 2 ranks; refused where it cannot apply."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import ckptconv
from test_dcp_to_hf import load_dir, same_bits
from test_hf_to_dcp import load_plain

MAPPING = """
[mapping]
name = "offset-test"

[[rule]]
runtime = "layers.{layer}.out_norm.weight"
hf = "model.layers.{layer}.linear_attn.norm.weight"
offset = 1

[[rule]]
runtime = "layers.{layer}.scale"
hf = "model.layers.{layer}.scale"
offset = -0.5

[[rule]]
runtime = "layers.{layer}.proj.weight"
hf = "model.layers.{layer}.proj.weight"
"""


def runtime_tensors() -> dict[str, torch.Tensor]:
    """fp32 values whose +1 rounds in fp32 and again in bf16 (tiny and large magnitudes, negatives)."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for layer in range(2):
        norm = torch.randn(96, generator=g) * torch.logspace(-9, 3, 96)
        out[f"layers.{layer}.out_norm.weight"] = norm
        out[f"layers.{layer}.scale"] = torch.randn(40, 3, generator=g) * 7
        out[f"layers.{layer}.proj.weight"] = torch.randn(8, 6, generator=g)
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("offset")
    dcp.save(runtime_tensors(), checkpoint_id=str(root / "ckpt"), no_dist=True)
    (root / "map.toml").write_text(MAPPING)
    (root / "config.json").write_text(json.dumps({"model_type": "test"}))
    return root / "ckpt", root / "map.toml", root / "config.json"


def shift(x: torch.Tensor, offset: float, dtype: torch.dtype) -> torch.Tensor:
    """The reference: x + offset in float32, then cast."""
    return (x.to(torch.float32) + offset).to(dtype)


OFFSETS = {"out_norm.weight": 1.0, "scale": -0.5, "proj.weight": None}


def expected_hf(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in runtime_tensors().items():
        name = key.split(".", 2)[2]
        hf_key = "model." + key.replace("out_norm", "linear_attn.norm")
        offset = OFFSETS[name]
        out[hf_key] = value.to(dtype) if offset is None else shift(value, offset, dtype)
    return out


@pytest.mark.parametrize("dtype,flag", [(torch.float32, "keep"), (torch.bfloat16, "bf16")])
def test_offset_both_ways(ckpt, tmp_path: Path, dtype: torch.dtype, flag: str) -> None:
    source, mapping, config = ckpt
    out = tmp_path / "hf"
    flags = ["--mapping", str(mapping), "--config", str(config)]
    proc = ckptconv("dcp-to-hf", str(source), str(out), *flags, "--dtype", flag)
    assert proc.returncode == 0, proc.stderr
    got, want = load_dir(out), expected_hf(dtype)
    assert set(got) == set(want)
    for key, value in want.items():
        assert same_bits(got[key], value), key
    plan = ckptconv("dcp-to-hf", str(source), str(tmp_path / "x"), *flags, "--dry-run", "--json")
    ops = {t["key"]: t["op"] for f in json.loads(plan.stdout)["files"] for t in f["tensors"]}
    assert ops["model.layers.0.linear_attn.norm.weight"] == "shift", ops
    assert ops["model.layers.0.proj.weight"] == "rename"
    # back: HF - offset in float32, cast to the output dtype (fp32 here, and bf16)
    for back_flag, back_dtype in [("fp32", torch.float32), ("bf16", torch.bfloat16)]:
        back = tmp_path / f"back-{back_flag}"
        proc = ckptconv("hf-to-dcp", str(out), str(back), *flags, "--dtype", back_flag)
        assert proc.returncode == 0, proc.stderr
        state = load_plain(back)
        for key in runtime_tensors():
            hf_key = "model." + key.replace("out_norm", "linear_attn.norm")
            offset = OFFSETS[key.split(".", 2)[2]]
            ref = want[hf_key].to(back_dtype) if offset is None else shift(want[hf_key], -offset, back_dtype)
            assert same_bits(state[key], ref), key  # type: ignore[arg-type]


@pytest.mark.slow
def test_offset_slab_by_slab_at_two_ranks(ckpt, tmp_path: Path) -> None:
    """The shift applies to every slab a rank writes (rows of a tensor written in parts, read directly or
    gathered), and hf-to-dcp's row shards at 2 ranks: the same bytes as one process."""
    source, mapping, config = ckpt
    flags = ["--mapping", str(mapping), "--config", str(config), "--dtype", "bf16"]
    one = tmp_path / "one"
    assert ckptconv("dcp-to-hf", str(source), str(one), *flags).returncode == 0
    for read in ("direct", "gather"):
        out = tmp_path / read
        proc = ckptconv(
            "dcp-to-hf", str(source), str(out), *flags, "--read", read, "--write-granularity", "tensor",
            "--max-shard-size", "300", nproc=2,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert load_dir(out).keys() == load_dir(one).keys()
        for key, value in load_dir(one).items():
            assert same_bits(load_dir(out)[key], value), key
    back1, back2 = tmp_path / "b1", tmp_path / "b2"
    assert ckptconv("hf-to-dcp", str(one), str(back1), *flags).returncode == 0
    proc = ckptconv("hf-to-dcp", str(one), str(back2), *flags, nproc=2)
    assert proc.returncode == 0, proc.stderr
    a, b = load_plain(back1), load_plain(back2)
    assert all(same_bits(a[k], b[k]) for k in a)  # type: ignore[arg-type]


def test_offset_refused_on_integers_and_fp8(tmp_path: Path) -> None:
    """An integer tensor, or a weight --quantize fp8 selects, under a shifting rule: exit 2, one line."""
    ints = tmp_path / "ints"
    dcp.save({"layers.0.scale": torch.arange(6).reshape(2, 3)}, checkpoint_id=str(ints), no_dist=True)
    (tmp_path / "map.toml").write_text(MAPPING)
    (tmp_path / "config.json").write_text("{}")
    flags = ["--mapping", str(tmp_path / "map.toml"), "--config", str(tmp_path / "config.json")]
    proc = ckptconv("dcp-to-hf", str(ints), str(tmp_path / "o1"), *flags)
    assert proc.returncode == 2, proc.stderr
    assert "offset" in proc.stderr and "int64" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o1").exists()
    weights = tmp_path / "weights"
    dcp.save({"layers.0.proj.weight": torch.randn(256, 128)}, checkpoint_id=str(weights), no_dist=True)
    (tmp_path / "fp8.toml").write_text(MAPPING + "offset = 1\n")
    flags[1] = str(tmp_path / "fp8.toml")
    proc = ckptconv("dcp-to-hf", str(weights), str(tmp_path / "o2"), *flags, "--quantize", "fp8")
    assert proc.returncode == 2, proc.stderr
    assert "--quantize-skip" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o2").exists()


@pytest.mark.parametrize(
    "rule,message",
    [
        ('runtime = "a"\nhf = ["b", "c"]\noffset = 1', "offset needs one runtime key and one hf key"),
        ('runtime = "a"\nhf = "b"\noffset = "1"', "offset must be a finite number"),
        ('runtime = "a"\nhf = "b"\noffset = true', "offset must be a finite number"),
        ('runtime = "a"\nhf = "b"\noffset = inf', "offset must be a finite number"),
        ('runtime = "a"\nhf = "b"\ntied = "c"\noffset = 1', "offset needs one runtime key"),
    ],
)
def test_bad_offsets_are_named(tmp_path: Path, rule: str, message: str) -> None:
    from ckptconv.errors import CkptconvError
    from ckptconv.mapping import load_mapping

    path = tmp_path / "m.toml"
    path.write_text(f'[mapping]\nname = "t"\n[[rule]]\n{rule}\n')
    with pytest.raises(CkptconvError, match=message) as err:
        load_mapping(str(path))
    assert "rule 1" in str(err.value)
