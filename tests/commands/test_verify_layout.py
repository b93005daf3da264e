"""verify --layout (issue #36 item 1): two checkpoints' layouts compared, not their values: key names, shapes,
dtypes and two HF directories' file split, from headers and `.metadata` alone; exit 0 the same, 1 a
difference (the first 20 printed, all in --json), 2 bad input. The checkpoints are transformers' own
save_pretrained of a tiny Llama (whole, sharded, bf16) and torch's dcp.save of its state dict."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import ckptconv
from families import seeded_llama
from safetensors.torch import load_file, save_file
from test_bad_input import assert_one_line
from test_json_schema import report


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """hf/ (fp32, one file), sharded/ (the same in 6 files), bf16/, dcp/ ({"model": the fp32 state dict})."""
    root = tmp_path_factory.mktemp("layout")
    model = seeded_llama()
    model.save_pretrained(root / "hf")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dcp.save({"model": weights, "step": 3}, checkpoint_id=str(root / "dcp"), no_dist=True)
    model.to(torch.bfloat16).save_pretrained(root / "bf16")
    return root


def edited(src: Path, dst: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    """A copy of the one-file HF directory `src`, its tensors passed through `edit(dict)` (safetensors' own
    save_file)."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_values_are_not_compared_nor_read(llama: Path, tmp_path: Path) -> None:
    other = edited(llama / "hf", tmp_path / "other", lambda t: t.update({k: v + 1 for k, v in t.items()}))
    proc = ckptconv("verify", str(llama / "hf"), str(other), "--layout")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("match: 21 tensors have the same layout"), proc.stdout
    assert ckptconv("verify", str(llama / "hf"), str(other)).returncode == 1  # the values differ
    doc = report("verify", str(llama / "hf"), str(other), "--layout")
    assert doc["layout"] is True and doc["match"] is True and doc["compared"] == 21
    assert doc["compared_bytes"] == 0 and doc["mismatches"] == [] and doc["notes"] == []


def test_the_file_split_is_its_own_kind(llama: Path) -> None:
    proc = ckptconv("verify", str(llama / "hf"), str(llama / "sharded"), "--layout")
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert len(lines) == 21 and lines[-1] == "... and 1 more (--json lists them all)", proc.stdout
    assert lines[0].startswith("lm_head.weight: file differs, A model.safetensors vs B model-0000")
    assert proc.stderr.splitlines()[-1].startswith("ckptconv: error: 21 layout difference(s) between")
    doc = report("verify", str(llama / "hf"), str(llama / "sharded"), "--layout", code=1)
    assert len(doc["mismatches"]) == 21 and {m["kind"] for m in doc["mismatches"]} == {"file"}
    index = json.loads((llama / "sharded" / "model.safetensors.index.json").read_text())["weight_map"]
    assert {m["key"]: m["b"]["file"] for m in doc["mismatches"]} == index
    assert all(m["a"]["file"] == "model.safetensors" for m in doc["mismatches"])
    same = ckptconv("verify", str(llama / "sharded"), str(llama / "sharded"), "--layout")
    assert same.returncode == 0, same.stdout + same.stderr


def test_keys_shapes_and_dtypes(llama: Path, tmp_path: Path) -> None:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        del tensors["model.norm.weight"]
        tensors["lm_head.weight"] = tensors["lm_head.weight"][:-1].clone()
        tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"].half()
        tensors["extra.bias"] = torch.zeros(2)

    changed = edited(llama / "hf", tmp_path / "changed", change)
    doc = report("verify", str(changed), str(llama / "hf"), "--layout", code=1)
    found = [(m["key"], m["kind"]) for m in doc["mismatches"]]
    assert found == [
        ("extra.bias", "only_in_a"),
        ("lm_head.weight", "shape"),
        ("model.layers.0.mlp.up_proj.weight", "dtype"),
        ("model.norm.weight", "only_in_b"),
    ]
    assert doc["mismatches"][1]["a"] == {"shape": [63, 32], "dtype": "float32", "file": "model.safetensors"}
    proc = ckptconv("verify", str(changed), str(llama / "hf"), "--layout")
    assert "model.layers.0.mlp.up_proj.weight: dtype differs, A float16[64, 32] vs B float32[64, 32]" in (
        proc.stdout
    )
    dtyped = report("verify", str(llama / "hf"), str(llama / "bf16"), "--layout", code=1)
    assert len(dtyped["mismatches"]) == 21 and {m["kind"] for m in dtyped["mismatches"]} == {"dtype"}


def test_a_dcp_side_as_verify_sees_it(llama: Path) -> None:
    doc = report("verify", str(llama / "dcp"), str(llama / "hf"), "--layout")  # the model group, stripped
    assert doc["match"] is True and doc["compared"] == 21
    assert doc["notes"] == ["file split not compared: A and B are not both HF directories"]
    dtyped = report("verify", str(llama / "bf16"), str(llama / "dcp"), "--layout", code=1)
    assert {(m["kind"], m["a"]["dtype"], m["b"]["dtype"]) for m in dtyped["mismatches"]} == {
        ("dtype", "bfloat16", "float32")
    }
    both = report("verify", str(llama / "dcp"), str(llama / "dcp"), "--layout")
    assert both["match"] is True and both["compared"] == 21


def test_bad_input_is_exit_2(llama: Path, tmp_path: Path) -> None:
    proc = ckptconv("verify", str(tmp_path / "nope"), str(llama / "hf"), "--layout")
    assert_one_line(proc.returncode, proc.stderr, "no such file or directory")
    proc = ckptconv("verify", str(llama / "hf"), str(llama / "hf"), "--layout", "--atol", "0.1")
    assert_one_line(proc.returncode, proc.stderr, "--atol with --layout: --layout compares no values")
    mapped = ("--layout", "--mapping", "torchtitan-llama3")
    proc = ckptconv("verify", str(llama / "hf"), str(llama / "bf16"), *mapped)
    assert_one_line(proc.returncode, proc.stderr, "--mapping applies to DCP checkpoints")


@pytest.mark.slow
def test_two_ranks_give_the_same_report(llama: Path) -> None:
    args = ("verify", str(llama / "hf"), str(llama / "sharded"), "--layout", "--json")
    docs = []
    for nproc in (0, 2):
        proc = ckptconv(*args, nproc=nproc, timeout=180)
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.count("layout difference(s)") == 1, proc.stderr
        docs.append(json.loads(proc.stdout)["mismatches"])
    assert docs[0] == docs[1]
