"""dcp-to-hf follows its reference model (issue #36 item 1): `--reference BASE` / `--copy-from BASE` make
BASE's way of writing a key family the output's (experts fused or per expert, copies and tied heads written
or not), BASE's dtype each key's unless `--dtype` / `--fp32` say otherwise, and with `--file-split reference`
BASE's file for each key. BASE is what transformers' `save_pretrained` writes (or safetensors' own
`save_file` of the same model's weights); the output is judged by transformers' `from_pretrained` and
safetensors' `load_file`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import ckptconv, tree_sha256
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_bad_input import assert_one_line, run
from test_dcp_to_hf import same_bits
from test_json_schema import report

TINY = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def seeded_moe() -> Any:
    """A tiny Qwen3MoeForCausalLM (4 experts of 8, hidden 16, untied head), float32, weights from seed 0."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        intermediate_size=24,
        moe_intermediate_size=8,
        num_experts=4,
        num_experts_per_tok=2,
        head_dim=4,
        tie_word_embeddings=False,
        **TINY,
    )
    return AutoModelForCausalLM.from_config(config)


def save_fused(model: Any, saved: Path, fused: Path) -> None:
    """fused/: the model's weights as it holds them (`gate_up_proj`, `down_proj`), one file by safetensors,
    with saved/'s config.json: a base that stores its experts fused."""
    fused.mkdir()
    shutil.copy(saved / "config.json", fused)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state  # transformers 5 holds them fused
    save_file(state, fused / "model.safetensors", metadata={"format": "pt"})


def weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory, from safetensors' own reader."""
    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


def file_keys(directory: Path) -> dict[str, list[str]]:
    """{file name: its keys in the order of their data}."""
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(f, "pt") as opened:
            keys = list(opened.keys())
        header = json.loads(f.read_bytes()[8 : 8 + int.from_bytes(f.read_bytes()[:8], "little")])
        out[f.name] = sorted(keys, key=lambda k: header[k]["data_offsets"][0])
    return out


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE: per_expert/ as `save_pretrained` writes it (one tensor per expert), fused/ the same
    weights as the model holds them (`gate_up_proj`, `down_proj`) written by safetensors, and dcp/ its
    torchtitan checkpoint (hf-to-dcp --mapping torchtitan-qwen3)."""

    root = tmp_path_factory.mktemp("moe")
    model = seeded_moe()
    model.save_pretrained(root / "per_expert")
    save_fused(model, root / "per_expert", root / "fused")
    proc = ckptconv("hf-to-dcp", str(root / "per_expert"), str(root / "dcp"), "--mapping", "torchtitan-qwen3")
    assert proc.returncode == 0, proc.stderr
    return root


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny fp32 Llama: hf/ as `save_pretrained` writes it in files of at most 8KB, bf16/ its weights in
    bf16 but for an fp32 `model.norm.weight` (a base with an fp32 carve-out), and dcp/ its weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("follow")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(intermediate_size=24, tie_word_embeddings=False, **TINY))
    model.save_pretrained(root / "hf", max_shard_size="8KB")
    assert len(list((root / "hf").glob("*.safetensors"))) >= 3
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    (root / "bf16").mkdir()
    shutil.copy(root / "hf" / "config.json", root / "bf16")
    carved = {k: v if k == "model.norm.weight" else v.to(torch.bfloat16) for k, v in state.items()}
    save_file(carved, root / "bf16" / "model.safetensors", metadata={"format": "pt"})
    dcp.save({"model": state}, checkpoint_id=str(root / "dcp"), no_dist=True)
    return root


# -- the experts: BASE's form ------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["per_expert", "fused"])
def test_experts_are_written_as_the_base_writes_them(
    moe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], form: str
) -> None:
    from transformers import AutoModelForCausalLM

    base, out = moe / form, tmp_path / "out"
    args = [
        "dcp-to-hf",
        str(moe / "dcp"),
        str(out),
        "--mapping",
        "torchtitan-qwen3",
        "--copy-from",
        str(base),
    ]
    code, err = run(capsys, *args)
    assert code == 0, err
    assert f"experts {form} as in --copy-from {base}" in err, err
    ours, theirs = weights(out), weights(base)
    assert ours.keys() == theirs.keys()
    assert [k for k in theirs if not same_bits(ours[k], theirs[k])] == []
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    want = AutoModelForCausalLM.from_pretrained(base).state_dict()
    assert [k for k, v in model.state_dict().items() if not same_bits(v, want[k])] == []
    doc = report(*args[:2], str(tmp_path / "o2"), *args[3:], "--dry-run")
    assert doc["reference"]["adopted"]["experts"] == form


def test_hf_experts_given_beats_the_base(
    moe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    args = ["dcp-to-hf", str(moe / "dcp"), str(out), "--mapping", "torchtitan-qwen3"]
    code, err = run(capsys, *args, "--reference", str(moe / "fused"), "--hf-experts", "per_expert")
    assert_one_line(code, err, "OUT would not match the reference", "experts.gate_up_proj")
    assert not out.exists()


# -- copies: written or not as BASE holds them ---------------------------------------------------------------


def test_a_copy_the_base_lacks_is_left_out(
    llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A mapping that writes the embedding twice (as DeepSeek-V3's writes its MTP copies): against a base
    holding it once, the copy is left out; without a reference both are written."""
    mapping = tmp_path / "copies.toml"
    mapping.write_text(
        '[mapping]\nname = "copies"\n\n[[rule]]\nruntime = "model.embed_tokens.weight"\n'
        'hf = ["model.embed_tokens.weight", "model.mtp.embed_tokens.weight"]\nduplicate = true\n'
    )
    args = ["dcp-to-hf", str(llama / "dcp"), "--mapping", str(mapping), "--allow-unmapped", "--dtype", "keep"]
    plain = report(*args[:2], str(tmp_path / "plain"), *args[2:])
    assert plain["num_tensors"] == 22 and plain["reference"] is None
    doc = report(*args[:2], str(tmp_path / "out"), *args[2:], "--reference", str(llama / "hf"))
    assert doc["reference"]["differences"] == []
    assert doc["reference"]["adopted"]["left_out"] == ["model.mtp.embed_tokens.weight"]
    assert weights(tmp_path / "out").keys() == weights(llama / "hf").keys()
    code, err = run(capsys, *args[:2], str(tmp_path / "o2"), *args[2:], "--reference", str(llama / "hf"))
    assert code == 0 and "1 copy(ies) left out (model.mtp.embed_tokens.weight) as in --reference" in err, err


# -- dtypes: BASE's per key ----------------------------------------------------------------------------------


def test_dtypes_follow_the_base_unless_given(
    llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = llama / "bf16"
    src = str(llama / "dcp")
    code, err = run(capsys, "dcp-to-hf", src, str(tmp_path / "a"), "--reference", str(base))
    assert code == 0, err
    assert "1 tensor(s) kept float32 as in the reference (model.norm.weight)" in err, err
    assert "differ in dtype" not in err, err
    out = load_file(tmp_path / "a" / "model.safetensors")
    assert {k: v.dtype for k, v in out.items()} == {
        k: v.dtype for k, v in load_file(base / "model.safetensors").items()
    }
    doc = report("dcp-to-hf", src, str(tmp_path / "j"), "--reference", str(base), "--dry-run")
    assert doc["reference"]["adopted"]["dtypes"] == {"float32": ["model.norm.weight"]}
    # --dtype given wins over the reference; --fp32 beats both
    code, err = run(
        capsys, "dcp-to-hf", src, str(tmp_path / "b"), "--reference", str(base), "--dtype", "bf16"
    )
    assert code == 0 and "kept float32" not in err, err
    assert load_file(tmp_path / "b" / "model.safetensors")["model.norm.weight"].dtype == torch.bfloat16
    flags = ("--dtype", "fp16", "--fp32", r"^lm_head")
    code, err = run(capsys, "dcp-to-hf", src, str(tmp_path / "c"), "--reference", str(base), *flags)
    assert code == 0, err
    written = load_file(tmp_path / "c" / "model.safetensors")
    assert (
        written["lm_head.weight"].dtype == torch.float32
        and written["model.norm.weight"].dtype == torch.float16
    )


# -- --file-split reference ----------------------------------------------------------------------------------


def test_file_split_reference_writes_the_base_files(llama: Path, tmp_path: Path) -> None:
    base, out = llama / "hf", tmp_path / "out"
    args = ["dcp-to-hf", str(llama / "dcp"), str(out), "--reference", str(base), "--dtype", "keep"]
    doc = report(*args, "--file-split", "reference")
    assert doc["reference"]["adopted"]["file_split"] is True
    assert file_keys(out) == file_keys(base)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert (
        index["weight_map"] == json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]
    )
    # the same weights in the same files: the same bytes (what the Hub deduplicates)
    assert {n: h for n, h in tree_sha256(out).items() if n.endswith(".safetensors")} == {
        n: h for n, h in tree_sha256(base).items() if n.endswith(".safetensors")
    }


def test_file_split_reference_extra_keys_and_refusals(
    llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = str(llama / "dcp")
    code, err = run(capsys, "dcp-to-hf", src, str(tmp_path / "a"), "--file-split", "reference")
    assert_one_line(code, err, "--file-split reference: names no reference", "--reference BASE")
    code, err = run(capsys, "dcp-to-hf", src, str(tmp_path / "a"), "--file-split", "sizes")
    assert_one_line(code, err, "--file-split 'sizes' is not one of size, source, reference")
    assert not (tmp_path / "a").exists()
    # a base lacking the head: the head is extra, allowed into one file of its own
    base = shutil.copytree(llama / "bf16", tmp_path / "base")
    tensors = load_file(base / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, base / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    args = ["dcp-to-hf", src, str(out), "--reference", str(base), "--file-split", "reference"]
    code, err = run(capsys, *args)
    assert_one_line(code, err, "OUT would not match the reference", "extra 'lm_head.weight'")
    code, err = run(capsys, *args, "--allow-layout-change")
    assert code == 0, err
    assert file_keys(out) == {
        "model.safetensors": file_keys(base)["model.safetensors"],
        "model-not-in-reference.safetensors": ["lm_head.weight"],
    }
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["lm_head.weight"] == "model-not-in-reference.safetensors"


@pytest.mark.slow
def test_file_split_reference_is_the_same_bytes_at_two_ranks(llama: Path, tmp_path: Path) -> None:
    args = ["--reference", str(llama / "hf"), "--file-split", "reference", "--dtype", "bf16"]
    one = ckptconv("dcp-to-hf", str(llama / "dcp"), str(tmp_path / "one"), *args, timeout=180)
    assert one.returncode == 0, one.stderr
    two = ckptconv("dcp-to-hf", str(llama / "dcp"), str(tmp_path / "two"), *args, nproc=2, timeout=180)
    assert two.returncode == 0, two.stderr
    assert len(list((tmp_path / "one").glob("*.safetensors"))) >= 3
    assert tree_sha256(tmp_path / "one") == tree_sha256(tmp_path / "two")


# -- a tied head: written when BASE holds it -----------------------------------------------------------------


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with `tie_word_embeddings: true`: plain/ as `save_pretrained` writes it (no
    `lm_head.weight`), with_head/ the same file with the head added by safetensors (config.json unchanged:
    a base that stores its tied head), and dcp/ its torchtitan checkpoint (hf-to-dcp --mapping
    torchtitan-llama3, which gives the runtime its own copy of the head)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("tied")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(intermediate_size=24, tie_word_embeddings=True, **TINY))
    model.save_pretrained(root / "plain")
    assert json.loads((root / "plain" / "config.json").read_text())["tie_word_embeddings"] is True
    plain = load_file(root / "plain" / "model.safetensors")
    assert "lm_head.weight" not in plain
    head = shutil.copytree(root / "plain", root / "with_head")
    plain["lm_head.weight"] = model.lm_head.weight.detach().clone()
    save_file(plain, head / "model.safetensors", metadata={"format": "pt"})
    args = ("hf-to-dcp", str(root / "plain"), str(root / "dcp"), "--mapping", "torchtitan-llama3")
    proc = ckptconv(*args)
    assert proc.returncode == 0, proc.stderr
    return root


@pytest.mark.parametrize("form", ["with_head", "plain"])
def test_a_tied_head_is_written_when_the_base_holds_it(
    tied: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], form: str
) -> None:
    from transformers import AutoModelForCausalLM

    base, out = tied / form, tmp_path / "out"
    args = ["dcp-to-hf", str(tied / "dcp"), str(out), "--mapping", "torchtitan-llama3"]
    args += ["--copy-from", str(base)]
    code, err = run(capsys, *args)
    assert code == 0, err
    ours, theirs = weights(out), weights(base)
    assert ("lm_head.weight" in ours) == (form == "with_head")
    assert ours.keys() == theirs.keys()
    assert [k for k in theirs if not same_bits(ours[k], theirs[k])] == []
    said = f"1 tied head(s) written (lm_head.weight) as in --copy-from {base}"
    assert (said in err) == (form == "with_head"), err
    doc = report(*args[:2], str(tmp_path / "json"), *args[3:], "--dry-run")
    assert doc["reference"]["differences"] == []
    assert doc["reference"]["adopted"]["written"] == (["lm_head.weight"] if form == "with_head" else [])
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert same_bits(model.lm_head.weight.detach(), theirs["model.embed_tokens.weight"])
