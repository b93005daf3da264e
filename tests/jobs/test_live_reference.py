"""save_hf follows and checks its reference model as dcp-to-hf does (`reference=`, or `copy_from=` holding
weights): BASE's HF expert form, dtypes and files, the planned output compared with BASE before anything is
written. BASE is a tiny Qwen3-MoE as transformers' `save_pretrained` writes it (per expert), or the same
weights as the model holds them (fused); the runtime state dict is what torchtitan's own Qwen3 adapter makes
of BASE (`from_hf`), and dcp-to-hf converts its `dcp.save`: the two must write the same bytes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import WORKERS, ckptconv, torchrun, tree_sha256
from safetensors.torch import load_file
from test_dcp_to_hf import same_bits
from test_reference_follow import file_keys, save_fused, seeded_moe, weights
from test_reference_follow import tied as tied  # a fixture
from titan import run_adapter

import ckptconv as lib
from ckptconv.errors import CkptconvError

MAPPING = "torchtitan-qwen3"


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """per_expert/: a tiny Qwen3-MoE as `save_pretrained` writes it in files of at most 8KB; fused/: the
    same weights as the model holds them (`gate_up_proj`, `down_proj`), one file by safetensors; titan.st:
    torchtitan 0.3.0's `Qwen3StateDictAdapter.from_hf` of per_expert/; dcp/: `dcp.save` of those tensors."""

    root = tmp_path_factory.mktemp("live-moe")
    model = seeded_moe()
    model.save_pretrained(root / "per_expert", max_shard_size="8KB")
    assert len(list((root / "per_expert").glob("*.safetensors"))) >= 3
    save_fused(model, root / "per_expert", root / "fused")
    hf_config = json.loads((root / "per_expert" / "config.json").read_text())
    run_adapter("qwen3", "from_hf", hf_config, root / "per_expert", root / "titan.st")
    runtime = load_file(root / "titan.st")
    assert "layers.0.moe.routed_experts.inner_experts.w1_EFD" in runtime
    dcp.save(runtime, checkpoint_id=str(root / "dcp"), no_dist=True)
    return root


def _config(moe: Path) -> dict:
    return json.loads((moe / "per_expert" / "config.json").read_text())


def _dcp_to_hf(moe: Path, out: Path, *flags: str, nproc: int = 0) -> Path:
    proc = ckptconv("dcp-to-hf", str(moe / "dcp"), str(out), "--mapping", MAPPING, *flags, nproc=nproc)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.parametrize("form", ["per_expert", "fused"])
def test_save_hf_follows_the_base_as_dcp_to_hf_does(moe: Path, tmp_path: Path, form: str) -> None:
    base, out = moe / form, tmp_path / "lib"
    state = load_file(moe / "titan.st")
    report = lib.save_hf(state, out, mapping=MAPPING, copy_from=base, config=_config(moe))
    assert report.reference is not None
    assert report.reference["path"] == str(base) and report.reference["differences"] == []
    assert report.reference["adopted"]["experts"] == form
    # BASE's form and dtypes (fp32: no dtype given), its values bit for bit
    ours, theirs = weights(out), weights(base)
    assert ours.keys() == theirs.keys()
    assert [k for k in theirs if not same_bits(ours[k], theirs[k])] == []
    cli = _dcp_to_hf(moe, tmp_path / "cli", "--copy-from", str(base))
    assert tree_sha256(out) == tree_sha256(cli)


def test_save_hf_reference_alone_with_a_dtype_given(moe: Path, tmp_path: Path) -> None:
    """`reference=` copies nothing; a dtype given beats the base's, and the differences are only told."""
    base, out = moe / "fused", tmp_path / "lib"
    report = lib.save_hf(load_file(moe / "titan.st"), out, mapping=MAPPING, reference=base, dtype="bf16")
    assert report.reference is not None and report.reference["adopted"]["experts"] == "fused"
    differences = report.reference["differences"]
    assert differences and {d["kind"] for d in differences} == {"dtype"}
    assert not (out / "config.json").exists()
    ours, theirs = weights(out), weights(base)
    assert {k: v.dtype for k, v in ours.items()} == dict.fromkeys(theirs, torch.bfloat16)
    assert [k for k in theirs if not same_bits(ours[k], theirs[k].to(torch.bfloat16))] == []
    cli = _dcp_to_hf(moe, tmp_path / "cli", "--reference", str(base), "--dtype", "bf16")
    assert tree_sha256(out) == tree_sha256(cli)


def test_save_hf_file_split_reference(moe: Path, tmp_path: Path) -> None:
    base, out = moe / "per_expert", tmp_path / "lib"
    kw = {"mapping": MAPPING, "copy_from": base, "config": _config(moe), "file_split": "reference"}
    report = lib.save_hf(load_file(moe / "titan.st"), out, **kw)
    assert report.reference is not None and report.reference["adopted"]["file_split"] is True
    assert report.files == sorted(file_keys(base))
    assert file_keys(out) == file_keys(base)
    # the same weights in the same files: the same bytes as transformers' own files
    assert {n: h for n, h in tree_sha256(out).items() if n.endswith(".safetensors")} == {
        n: h for n, h in tree_sha256(base).items() if n.endswith(".safetensors")
    }
    cli = _dcp_to_hf(moe, tmp_path / "cli", "--copy-from", str(base), "--file-split", "reference")
    assert tree_sha256(out) == tree_sha256(cli)


def test_save_hf_refuses_a_mismatching_reference(moe: Path, tmp_path: Path) -> None:
    state, out = load_file(moe / "titan.st"), tmp_path / "out"
    kw = {"mapping": MAPPING, "reference": moe / "fused", "hf_experts": "per_expert"}
    with pytest.raises(CkptconvError) as raised:
        lib.save_hf(state, out, **kw)
    message = str(raised.value)
    assert message.startswith("save_hf: the output would not match the reference"), message
    assert "experts.gate_up_proj" in message and "allow_layout_change=True" in message, message
    assert "\n" not in message and not out.exists()
    report = lib.save_hf(state, out, allow_layout_change=True, **kw)
    assert report.reference is not None
    kinds = {d["kind"] for d in report.reference["differences"]}
    assert {"missing", "extra"} <= kinds and report.reference["adopted"]["experts"] is None
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in weights(out)


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        (
            {"file_split": "reference"},
            "save_hf: file_split='reference': names no reference; pass reference=BASE (or copy_from=BASE",
        ),
        ({"file_split": "source"}, "save_hf: file_split='source' is not one of 'size', 'reference'"),
        ({"hf_experts": "stacked"}, "save_hf: hf_experts='stacked' is not one of 'per_expert', 'fused'"),
        ({"reference": "nowhere"}, "save_hf: reference=nowhere: not a directory"),
    ],
)
def test_save_hf_bad_reference_keywords(moe: Path, tmp_path: Path, kw: dict, needle: str) -> None:
    out = tmp_path / "out"
    with pytest.raises(CkptconvError, match="^" + needle.replace("(", r"\(")) as raised:
        lib.save_hf(load_file(moe / "titan.st"), out, mapping=MAPPING, **kw)
    assert "\n" not in str(raised.value) and not out.exists()


def test_save_hf_copy_from_without_weights_is_no_reference(moe: Path, tmp_path: Path) -> None:
    files = tmp_path / "files"
    files.mkdir()
    shutil.copy(moe / "per_expert" / "config.json", files)
    report = lib.save_hf(load_file(moe / "titan.st"), tmp_path / "out", mapping=MAPPING, copy_from=files)
    assert report.reference is None
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in weights(tmp_path / "out")  # the mapping's own


@pytest.mark.slow
def test_save_hf_with_a_reference_under_fsdp2_is_the_same_bytes_at_two_ranks(
    moe: Path, tmp_path: Path
) -> None:
    kw = {"mapping": MAPPING, "copy_from": str(moe / "fused"), "config": _config(moe)}
    docs = []
    for nproc in (1, 2):
        out = tmp_path / f"ranks{nproc}"
        args = (str(moe / "titan.st"), str(out), json.dumps(kw))
        proc = torchrun(nproc, str(WORKERS / "save_reference.py"), *args)
        docs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert docs[0] == docs[1] and docs[0]["adopted"]["experts"] == "fused" and docs[0]["differences"] == []
    assert tree_sha256(tmp_path / "ranks1") == tree_sha256(tmp_path / "ranks2")
    cli = _dcp_to_hf(moe, tmp_path / "cli", "--copy-from", str(moe / "fused"))
    assert tree_sha256(tmp_path / "ranks2") == tree_sha256(cli)


# -- the base's config.json and a hub repo id as the reference ----------------------------------------------


def _dcp_state(path: Path) -> dict[str, torch.Tensor]:
    """A DCP checkpoint's tensors, read by torch's own dcp.load into tensors shaped from its metadata."""
    meta = dcp.FileSystemReader(str(path)).read_metadata()
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


@pytest.mark.parametrize("form", ["with_head", "plain"])
def test_save_hf_reads_the_config_of_a_hub_reference(
    tied: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    """No `config`: the mapping's `tie_word_embeddings` comes from the reference's config.json, here a hub
    repo id read from an offline cache (its index, config and headers only), and the head follows the base:
    the same bytes as dcp-to-hf with the base's directory."""
    from hubcache import hub_cache

    base = tied / form
    hub_cache(tmp_path / "hf", f"tiny-org/{form}", {p.name: p.read_bytes() for p in base.iterdir()})
    from huggingface_hub import constants  # read when called, not at import: this process's hub cache

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    out = tmp_path / "out"
    report = lib.save_hf(
        _dcp_state(tied / "dcp"), out, mapping="torchtitan-llama3", reference=f"tiny-org/{form}"
    )
    assert report.reference is not None and report.reference["differences"] == []
    assert report.reference["adopted"]["written"] == (["lm_head.weight"] if form == "with_head" else [])
    cli = ckptconv(
        "dcp-to-hf",
        str(tied / "dcp"),
        str(tmp_path / "cli"),
        "--mapping",
        "torchtitan-llama3",
        "--reference",
        str(base),
    )
    assert cli.returncode == 0, cli.stderr
    assert tree_sha256(out) == tree_sha256(tmp_path / "cli")
    assert ("lm_head.weight" in load_file(out / "model.safetensors")) == (form == "with_head")
