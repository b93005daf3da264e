"""torch's distributed HF writer (`HuggingFaceStorageWriter(save_distributed=True)`, as NeMo Automodel
saves) as a dcp-to-hf source: per-rank shard files read through their DCP_SHARDING_INFO, at any number of
ranks, integer tensors included; inspect and verify read it; hf-to-dcp refuses a shard file instead of
writing its blocks as whole tensors; a missing rank's file is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import WORKERS, ckptconv, torchrun, tree_sha256
from safetensors.torch import load_file
from test_bad_input import assert_one_line, run
from test_dcp_to_hf import same_bits


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "model.embed_tokens.weight": torch.randn(7, 4, generator=g).to(torch.bfloat16),  # 7 rows over 3 ranks
        "model.layers.0.mlp.experts.gate_up_proj": torch.randn(5, 6, 3, generator=g),
        "model.norm.weight": torch.randn(3, generator=g),
        "model.layers.0.mlp.gate.e_score_correction_bias": torch.randn(5, generator=g).double(),
        "token_counts": torch.arange(11, dtype=torch.int64)
        * 1_000_003,  # torch's consolidation breaks on ints
        "flags": torch.tensor([True, False, True, True]),
    }


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hfdist")
    torch.save(state(), root / "state.pt")
    torchrun(3, str(WORKERS / "save_hf_distributed.py"), str(root / "state.pt"), str(root / "shards"))
    return root / "shards"


@pytest.mark.slow
def test_dcp_to_hf_reads_the_shards_at_any_rank_count(shards: Path, tmp_path: Path) -> None:
    assert sorted(p.name for p in shards.iterdir()) == [
        f"shard-0000{r}-model-00001-of-00001.safetensors" for r in (1, 2, 3)
    ]
    digests = []
    for n in (1, 2):
        out = tmp_path / f"hf{n}"
        proc = ckptconv(
            "dcp-to-hf",
            str(shards),
            str(out),
            "--dtype",
            "keep",
            "--max-shard-size",
            "200",
            "--verify",
            nproc=n,
        )
        assert proc.returncode == 0, proc.stderr
        digests.append(tree_sha256(out))
    assert digests[0] == digests[1]
    got = {k: v for f in sorted((tmp_path / "hf1").glob("*.safetensors")) for k, v in load_file(f).items()}
    want = state()
    assert got.keys() == want.keys() and all(same_bits(got[k], want[k]) for k in want)
    proc = ckptconv("verify", str(shards), str(tmp_path / "hf1"))
    assert proc.returncode == 0 and proc.stdout.startswith("match: 6 tensors"), proc.stdout + proc.stderr
    proc = ckptconv("inspect", str(shards), "--json")
    info = json.loads(proc.stdout)
    shapes = {t["key"]: t["shape"] for t in info["tensors"]}
    assert shapes["model.embed_tokens.weight"] == [7, 4] and len(info["tensors"][0]["chunks"]) >= 1


@pytest.mark.slow
def test_a_shard_is_never_read_as_whole_tensors_and_a_missing_rank_is_named(
    shards: Path, tmp_path: Path, capsys
) -> None:
    code, err = run(capsys, "hf-to-dcp", str(shards), str(tmp_path / "a"))
    assert_one_line(code, err, "torch's distributed HF writer output", "use dcp-to-hf")
    one = shards / "shard-00002-model-00001-of-00001.safetensors"
    code, err = run(capsys, "hf-to-dcp", str(one), str(tmp_path / "b"))
    assert_one_line(
        code, err, "is one rank's shard", "DCP_SHARDING_INFO", "convert its directory with dcp-to-hf"
    )
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in shards.iterdir():
        if f != one:
            (broken / f.name).write_bytes(f.read_bytes())
    code, err = run(capsys, "dcp-to-hf", str(broken), str(tmp_path / "c"))
    assert_one_line(code, err, "no shard file of rank 2", "incomplete")
    (broken / one.name).write_bytes(one.read_bytes())
    (broken / "shard-00001-model-00001-of-00001.safetensors").unlink()
    code, err = run(capsys, "dcp-to-hf", str(broken), str(tmp_path / "d"))
    assert_one_line(code, err, "no shard file of rank 1")


SPLIT = {k: 1 if k.startswith("model.") else 2 for k in state()}


@pytest.fixture(scope="module")
def split_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two ranks, the keys in two files as the writer's `fqn_to_index_mapping` says, and NeMo Automodel's
    `.hf_metadata/` beside them."""
    root = tmp_path_factory.mktemp("hfsplit")
    torch.save(state(), root / "state.pt")
    layout = {"split": SPLIT, "config": {"model_type": "llama", "vocab_size": 7}}
    (root / "layout.json").write_text(json.dumps(layout))
    out = root / "shards"
    torchrun(
        2,
        str(WORKERS / "save_hf_distributed.py"),
        str(root / "state.pt"),
        str(out),
        str(root / "layout.json"),
    )
    return out


@pytest.mark.slow
def test_keep_file_split_writes_the_files_the_writer_was_given(
    split_shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    names = sorted(p.name for p in split_shards.glob("*.safetensors"))
    assert names == [f"shard-0000{r}-model-0000{i}-of-00002.safetensors" for r in (1, 2) for i in (1, 2)]
    out = tmp_path / "kept"
    code, err = run(capsys, "dcp-to-hf", str(split_shards), str(out), "--dtype", "keep", "--keep-file-split")
    assert code == 0, err
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = {f"model-0000{i}-of-00002.safetensors" for i in (1, 2)}
    assert index["weight_map"] == {k: f"model-0000{i}-of-00002.safetensors" for k, i in SPLIT.items()}
    got = {k: v for name in files for k, v in load_file(out / name).items()}
    assert got.keys() == state().keys() and all(same_bits(got[k], v) for k, v in state().items())
    # the model's config.json comes from .hf_metadata, said so
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert ".hf_metadata (--copy-from DIR takes them from elsewhere)" in err
    # without the flag: split by --max-shard-size, one file here
    code, err = run(capsys, "dcp-to-hf", str(split_shards), str(tmp_path / "sized"), "--dtype", "keep")
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "sized").glob("*.safetensors")) == ["model.safetensors"]


@pytest.mark.slow
def test_hf_metadata_split_wins_over_the_file_names(
    split_shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    src = tmp_path / "src"
    shutil.copytree(split_shards, src)
    moved = {**SPLIT, "flags": 1, "token_counts": 3}  # file 2 unused: 1 and 3 of 3
    (src / ".hf_metadata" / "fqn_to_file_index_mapping.json").write_text(json.dumps(moved))
    out = tmp_path / "out"
    code, err = run(capsys, "dcp-to-hf", str(src), str(out), "--keep-file-split")
    assert code == 0, err
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert weight_map["flags"] == "model-00001-of-00003.safetensors"
    assert weight_map["token_counts"] == "model-00003-of-00003.safetensors"
    (src / ".hf_metadata" / "fqn_to_file_index_mapping.json").write_text('{"flags": 0}')
    code, err = run(capsys, "dcp-to-hf", str(src), str(tmp_path / "bad"), "--keep-file-split")
    assert_one_line(code, err, "fqn_to_file_index_mapping.json: unreadable", "fix or remove it")


def test_keep_file_split_needs_a_source_that_records_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    code, err = run(capsys, "dcp-to-hf", str(tmp_path / "c"), str(tmp_path / "o"), "--keep-file-split")
    assert_one_line(code, err, "--keep-file-split", "records no file split", "--max-shard-size")
    assert not (tmp_path / "o").exists()
