"""dcp-to-hf against a reference model (issue #36 item 1, its check): `--reference BASE`, or
`--copy-from BASE` holding weights, makes BASE's index and headers the reference; before a byte is written
the planned output's key set and shapes must match it (exit 2, one line, unless `--allow-layout-change`: then
warnings), dtype differences are only told; `--json` lists every difference."""

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
from test_bad_input import assert_one_line, run
from test_json_schema import report

from ckptconv.plan.reference import Difference, compare, dtype_note, refusal


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny fp32 Llama: its own `save_pretrained` directory (hf/) and its weights as a DCP (dcp/)."""
    root = tmp_path_factory.mktemp("reference")
    model = seeded_llama()
    model.save_pretrained(root / "hf")
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dcp.save({"model": weights}, checkpoint_id=str(root / "dcp"), no_dist=True)
    return root


def reshaped(base: Path, dst: Path, key: str) -> Path:
    """A copy of `base` whose `key` has one row fewer (rewritten with safetensors' own API)."""
    shutil.copytree(base, dst)
    tensors = load_file(dst / "model.safetensors")
    tensors[key] = tensors[key][:-1].clone()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


# -- the comparison alone ------------------------------------------------------------------------------------


def test_compare_orders_missing_extra_shape_dtype() -> None:
    ref = {"a": ((4, 2), "bfloat16"), "b": ((4, 2), "bfloat16"), "c": ((3,), "float32")}
    out = {"x": ((1,), "float32"), "c": ((4,), "bfloat16"), "a": ((4, 2), "float32")}
    found = compare(out, ref)
    assert [(d.kind, d.key) for d in found] == [
        ("missing", "b"),
        ("extra", "x"),
        ("shape", "c"),
        ("dtype", "a"),
        ("dtype", "c"),
    ]
    assert found[2].text == "shape of 'c': [4] in OUT, [3] in the reference"
    assert found[0].to_json() == {
        "kind": "missing",
        "key": "b",
        "planned": None,
        "reference": "[4, 2] bfloat16",
    }
    assert [d.refuses for d in found] == [True, True, True, False, False]
    assert compare(out, ref, dtypes=False)[-1].kind == "shape"  # a quantized output: dtypes not compared


def test_refusal_is_one_line_and_dtypes_never_refuse() -> None:
    same = {"a": ((2,), "bfloat16")}
    assert compare(same, same) == []
    dtyped = compare({"a": ((2,), "float32")}, same)
    assert refusal("BASE", dtyped) is None
    assert dtype_note("BASE", dtyped) == (
        "1 tensor(s) differ in dtype from the reference BASE, e.g. dtype of 'a': float32 in OUT, bfloat16 in "
        "the reference (--dtype and --fp32 choose the output's dtypes)"
    )
    many = [Difference("extra", f"k{i}", "[1] float32", None) for i in range(5)]
    line = refusal("BASE", many)
    assert line is not None and "\n" not in line
    assert line.startswith("OUT would not match the reference BASE: 5 difference(s) (extra 'k0' ")
    assert "; and 2 more); fix --prefix, --mapping or --hf-experts, or pass --allow-layout-change" in line


# -- dcp-to-hf -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--copy-from", "--reference"])
def test_an_output_matching_its_base_passes(llama: Path, tmp_path: Path, flag: str) -> None:
    out = tmp_path / "out"
    doc = report("dcp-to-hf", str(llama / "dcp"), str(out), flag, str(llama / "hf"), "--dtype", "keep")
    nothing = {"experts": None, "left_out": [], "written": [], "dtypes": {}, "file_split": False}
    assert doc["reference"] == {"path": str(llama / "hf"), "differences": [], "adopted": nothing}
    assert not doc["warnings"]
    assert set(load_file(out / "model.safetensors")) == set(load_file(llama / "hf" / "model.safetensors"))
    assert (out / "config.json").exists() == (flag == "--copy-from")  # --reference copies nothing


def test_dtypes_differing_from_the_base_are_one_info_line(
    llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, base = str(tmp_path / "out"), str(llama / "hf")  # --dtype given: it beats the reference's dtypes
    code, err = run(capsys, "dcp-to-hf", str(llama / "dcp"), out, "--reference", base, "--dtype", "bf16")
    assert code == 0, err
    lines = [line for line in err.splitlines() if "differ in dtype" in line]
    assert len(lines) == 1 and "tensor(s) differ in dtype from the reference" in lines[0], err
    assert "bfloat16 in OUT, float32 in the reference" in lines[0]


@pytest.mark.parametrize("how", ["prefix", "shape"])
def test_a_wrong_layout_is_refused_before_writing(
    llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str
) -> None:
    out = tmp_path / "out"
    if how == "prefix":  # keys lose their "model." group: every base key missing, every output key extra
        base, extra, needles = (
            llama / "hf",
            ["--prefix", "model.model."],
            ["missing 'model.embed_tokens.weight'"],
        )
    else:
        base = reshaped(llama / "hf", tmp_path / "base", "lm_head.weight")
        extra, needles = [], ["1 difference(s)", "shape of 'lm_head.weight': [64, 32] in OUT, [63, 32]"]
    args = ["dcp-to-hf", str(llama / "dcp"), str(out), "--reference", str(base), *extra]
    code, err = run(capsys, *args)
    assert_one_line(code, err, f"OUT would not match the reference {base}", *needles, "--allow-layout-change")
    assert not out.exists()
    code, err = run(capsys, *args, "--dry-run")  # the dry run refuses as the conversion would
    assert_one_line(code, err, f"OUT would not match the reference {base}")
    code, err = run(capsys, *args, "--allow-layout-change")
    assert code == 0, err
    warned = [line for line in err.splitlines() if "--allow-layout-change: " in line]
    assert warned and all(str(base) in line for line in warned), err
    assert (out / "model.safetensors").exists()


def test_copy_from_without_weights_is_no_reference(
    llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = tmp_path / "files"
    files.mkdir()
    shutil.copy(llama / "hf" / "config.json", files)
    args = ["dcp-to-hf", str(llama / "dcp"), str(tmp_path / "out"), "--copy-from", str(files)]
    code, err = run(capsys, *args, "--prefix", "model.model.")
    assert code == 0, err
    code, err = run(capsys, "dcp-to-hf", str(llama / "dcp"), str(tmp_path / "o2"), "--reference", str(files))
    assert_one_line(code, err, f"--reference {files}: ", "no .safetensors files")


def test_reference_is_an_input_out_keeps_clear_of(
    llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = shutil.copytree(llama / "hf", tmp_path / "base")
    for out in (base, base / "inside"):
        code, err = run(
            capsys, "dcp-to-hf", str(llama / "dcp"), str(out), "--reference", str(base), "--overwrite"
        )
        assert_one_line(code, err, "--reference")
    code, err = run(capsys, "dcp-to-hf", str(llama / "dcp"), "o", "--reference", str(tmp_path / "none"))
    assert_one_line(code, err, f"--reference {tmp_path / 'none'}: not a directory")


def test_a_quantized_base_is_compared_as_its_logical_tensors(
    llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fp8 = tmp_path / "fp8"
    code, err = run(
        capsys,
        "dcp-to-hf",
        str(llama / "dcp"),
        str(fp8),
        "--quantize",
        "fp8",
        "--copy-from",
        str(llama / "hf"),
    )
    assert code == 0, err
    assert any(k.endswith("_scale_inv") for k in load_file(fp8 / "model.safetensors"))
    code, err = run(capsys, "dcp-to-hf", str(llama / "dcp"), str(tmp_path / "out"), "--reference", str(fp8))
    assert code == 0, err  # the scales are not extra keys, the weights not missing
    assert "--allow-layout-change" not in err, err


def test_json_lists_the_differences(llama: Path, tmp_path: Path) -> None:
    base = reshaped(llama / "hf", tmp_path / "base", "lm_head.weight")
    out = str(tmp_path / "out")
    args = ["dcp-to-hf", str(llama / "dcp"), out, "--reference", str(base), "--dtype", "bf16"]
    doc = report(*args, "--dry-run", "--allow-layout-change")
    diffs = doc["reference"]["differences"]
    assert doc["reference"]["path"] == str(base)
    assert diffs[0] == {
        "kind": "shape",
        "key": "lm_head.weight",
        "planned": "[64, 32]",
        "reference": "[63, 32]",
    }
    assert {d["kind"] for d in diffs[1:]} == {"dtype"}  # bf16 out of an fp32 base: told, not refused
    assert json.dumps(diffs)
    refused = report(*args, code=2)
    assert "OUT would not match the reference" in refused["error"]["message"]
    plain = report("dcp-to-hf", str(llama / "dcp"), str(tmp_path / "o2"), "--dry-run")
    assert plain["reference"] is None


def test_two_ranks_refuse_and_allow_as_one(llama: Path, tmp_path: Path) -> None:
    """Rank 0 reads BASE's headers for both ranks; both refuse together, one line; allowed, both write."""
    base = reshaped(llama / "hf", tmp_path / "base", "lm_head.weight")
    out = tmp_path / "out"
    args = ["dcp-to-hf", str(llama / "dcp"), str(out), "--reference", str(base)]
    proc = ckptconv(*args, nproc=2, timeout=180)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ckptconv: error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr  # the ranks exit 2, torchrun itself 1
    assert "OUT would not match the reference" in errors[0] and not out.exists()
    proc = ckptconv(*args, "--allow-layout-change", "--max-shard-size", "20KB", nproc=2, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("--allow-layout-change: shape of 'lm_head.weight'") == 1, proc.stderr
    assert (out / "model.safetensors.index.json").exists()


def test_a_block_of_the_base_the_checkpoint_lacks_is_named(
    llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A base holding a block the training never had (here an MTP block, as Qwen3.5's release holds
    `mtp.*`): the refusal says every difference is a key under that block, then lists the first."""
    base = shutil.copytree(llama / "hf", tmp_path / "base")
    tensors = load_file(base / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.zeros(32, 64)
    tensors["mtp.norm.weight"] = torch.ones(32)
    save_file(tensors, base / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    args = ["dcp-to-hf", str(llama / "dcp"), str(out), "--reference", str(base)]
    code, err = run(capsys, *args)
    said = "2 difference(s), all of them keys under 'mtp.' that OUT lacks (missing 'mtp.fc.weight'"
    assert_one_line(code, err, f"OUT would not match the reference {base}: {said}")
    assert not out.exists()
    code, err = run(capsys, *args, "--allow-layout-change")
    assert code == 0, err
    assert "mtp.fc.weight" not in load_file(out / "model.safetensors")
