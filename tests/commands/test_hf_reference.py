"""hf-to-dcp into an existing training job (issue #36 item 1, the mirror of dcp-to-hf's check): `--reference
CKPT_DIR`, a DCP checkpoint `dcp.save` wrote for the target model, makes its model tensors' keys, shapes and
dtypes the reference: the DCP is written in its dtypes (no --dtype given) and `dcp.load`s into the job's state
dict with strict keys; a key or shape difference is exit 2 with nothing written, unless
`--allow-layout-change` (then warnings); `--json` lists every difference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import ckptconv, tree_sha256
from families import seeded_llama
from test_bad_input import assert_one_line, run
from test_json_schema import report

from ckptconv.formats.dcp import open_dcp

FP32_KEY = "model.model.norm.weight"  # the one tensor the job keeps in fp32


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama (transformers' own save_pretrained: hf/, fp32) and its training job's checkpoint (ref/):
    `dcp.save` of {"model": the model's state dict in bf16 with one fp32 norm, "step", "optimizer"}."""
    root = tmp_path_factory.mktemp("hf_reference")
    model = seeded_llama()
    model.save_pretrained(root / "hf")
    state = job_state(model.state_dict())
    extra = {"step": 7, "optimizer": {"state": {"exp_avg": torch.zeros(3)}}}  # not weights: not compared
    dcp.save({"model": state, **extra}, checkpoint_id=str(root / "ref"), no_dist=True)
    return root


def job_state(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The job's state dict: bf16, the final norm fp32 (`model.` + this key is FP32_KEY)."""
    return {
        k: v.detach().clone().to(torch.float32 if "model." + k == FP32_KEY else torch.bfloat16)
        for k, v in weights.items()
    }


def source_weights(hf: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(hf / "model.safetensors")


def test_a_dcp_in_the_references_dtypes_loads_with_strict_keys(job: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["--prefix", "model.", "--reference", str(job / "ref")]
    doc = report("hf-to-dcp", str(job / "hf"), str(out), *args)
    assert doc["reference"] == {"path": str(job / "ref"), "differences": []}
    want = job_state(source_weights(job / "hf"))  # the HF values, cast once to the job's dtypes
    # the job's own state dict, as the job builds it: dcp.load fills every key of it (strict: none missing)
    state = {"model": {k: torch.full_like(v, 7) for k, v in want.items()}}
    dcp.load(state, checkpoint_id=str(out), no_dist=True)
    for key, value in want.items():
        got = state["model"][key]
        assert got.dtype == value.dtype and torch.equal(got.view(-1), value.view(-1)), key
    written, reference = open_dcp(out).tensors, open_dcp(job / "ref").tensors
    assert set(written) == {k for k in reference if k.startswith("model.")}  # and no key beyond the job's
    assert all(written[k].dtype_name == reference[k].dtype_name for k in written)
    assert written[FP32_KEY].dtype_name == "float32"


def test_dtype_given_wins_and_is_one_info_line(
    job: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    args = ["hf-to-dcp", str(job / "hf"), str(out), "--prefix", "model.", "--reference", str(job / "ref")]
    code, err = run(capsys, *args, "--dtype", "fp32")
    assert code == 0, err
    lines = [line for line in err.splitlines() if "differ in dtype" in line]
    assert len(lines) == 1 and lines[0].startswith("20 tensor(s) differ in dtype from the reference"), err
    assert {t.dtype_name for t in open_dcp(out).tensors.values()} == {"float32"}
    doc = report(*args, "--dtype", "fp32", "--fp32", "embed", "--dry-run")
    assert {d["kind"] for d in doc["reference"]["differences"]} == {"dtype"}
    kept = report(*args[:3], "--prefix", "model.", "--dry-run")  # no --reference: keep, reference null
    assert kept["reference"] is None and {t["dtype"] for t in kept["tensors"]} == {"float32"}


@pytest.mark.parametrize("prefix", [[], ["--prefix", "module."]])
def test_a_wrong_prefix_is_refused_with_nothing_written(
    job: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], prefix: list[str]
) -> None:
    out = tmp_path / "out"
    args = ["hf-to-dcp", str(job / "hf"), str(out), *prefix, "--reference", str(job / "ref")]
    code, err = run(capsys, *args)
    assert_one_line(
        code,
        err,
        f"OUT would not match the reference {job / 'ref'}: 42 difference(s) (missing 'model.model.embed",
        "; and 39 more); fix --prefix or --mapping, or pass --allow-layout-change to write it anyway",
    )
    assert not out.exists()
    code, err = run(capsys, *args, "--dry-run")  # the dry run refuses as the conversion would
    assert_one_line(code, err, "OUT would not match the reference")
    code, err = run(capsys, *args, "--allow-layout-change")
    assert code == 0, err
    warned = [line for line in err.splitlines() if "warning: --allow-layout-change: " in line]
    assert len(warned) == 42 and all(f"(--reference {job / 'ref'})" in line for line in warned), err
    assert set(open_dcp(out).tensors) == {"".join(prefix[1:]) + k for k in source_weights(job / "hf")}


def test_a_shape_difference_is_refused(job: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    wider = LlamaForCausalLM(LlamaConfig.from_pretrained(job / "hf", vocab_size=80))
    ref = tmp_path / "ref"
    dcp.save({"model": job_state(wider.state_dict())}, checkpoint_id=str(ref), no_dist=True)
    out = tmp_path / "out"
    args = ["--prefix", "model.", "--reference", str(ref)]
    code, err = run(capsys, "hf-to-dcp", str(job / "hf"), str(out), *args)
    assert_one_line(
        code,
        err,
        "2 difference(s) (shape of 'model.model.embed_tokens.weight': [64, 32] in OUT, [80, 32] in the "
        "reference; shape of 'model.lm_head.weight': [64, 32] in OUT, [80, 32] in the reference)",
    )
    assert not out.exists()


def test_bad_references_are_one_line(job: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hf, ref = str(job / "hf"), job / "ref"
    cases = [
        (tmp_path / "nope", "no such file or directory"),
        (job / "hf", "not a DCP checkpoint (no .metadata) (an HF model is dcp-to-hf's reference)"),
        (tmp_path, "not a DCP checkpoint (no .metadata); give a checkpoint directory the target job saved"),
    ]
    for path, needle in cases:
        code, err = run(capsys, "hf-to-dcp", hf, str(tmp_path / "out"), "--reference", str(path))
        assert_one_line(code, err, f"--reference {path}: {needle}")
    for out, needle in ((ref, "itself"), (ref / "sub", "is inside --reference")):  # OUT is never an input
        code, err = run(capsys, "hf-to-dcp", hf, str(out), "--reference", str(ref), "--overwrite")
        assert_one_line(code, err, needle)
    assert sorted(p.name for p in ref.iterdir()) == sorted([".metadata", "__0_0.distcp"])
    code, err = run(capsys, "hf-to-dcp", hf, str(tmp_path / "o"), "--reference", "s3://bucket/ckpt")
    assert_one_line(code, err, "--reference")


@pytest.mark.slow
def test_one_and_two_ranks_write_the_same_bytes(job: Path, tmp_path: Path) -> None:
    args = ["--prefix", "model.", "--reference", str(job / "ref")]
    shas = []
    for nproc in (0, 2):
        out = tmp_path / f"out{nproc}"
        proc = ckptconv("hf-to-dcp", str(job / "hf"), str(out), *args, nproc=nproc, timeout=180)
        assert proc.returncode == 0, proc.stderr
        converted = tmp_path / f"hf{nproc}"  # the DCP's data files differ by rank count: its values do not
        proc = ckptconv("dcp-to-hf", str(out), str(converted), "--dtype", "keep", "--quiet")
        assert proc.returncode == 0, proc.stderr
        shas.append(tree_sha256(converted))
    assert shas[0] == shas[1]
    args = ["--reference", str(job / "ref")]  # no --prefix: every key differs
    proc = ckptconv("hf-to-dcp", str(job / "hf"), str(tmp_path / "bad"), *args, nproc=2)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ckptconv: error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr  # rank 0 reads .metadata for both, one line
    assert "OUT would not match the reference" in errors[0] and not (tmp_path / "bad").exists()
