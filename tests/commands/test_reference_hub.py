"""A hub repo id as the base model (issue #36 item 1): `dcp-to-hf --reference ORG/NAME` and
`--copy-from ORG/NAME`, `inspect --reference ORG/NAME` and `verify --layout ORG/NAME DIR` read the repo's
index, config.json and safetensors headers (`--copy-from` its side files too), never its weights, and do
exactly what the same model as a directory does. Offline (HF_HUB_OFFLINE=1) from a hub cache holding
transformers' own `save_pretrained` of a tiny model; online through huggingface_hub's own functions replaced
at their boundary. And config.json from `--reference`: a mapping's sizes from BASE's config when nothing
else gives one."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import ckptconv, tree_sha256
from hubcache import COMMIT, hub_cache, hub_client
from test_bad_input import assert_one_line, run
from test_dcp_to_hf import same_bits
from test_json_schema import report

REPO = "tiny-org/base"
TINY = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def files_of(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama: hf/ as `save_pretrained` writes it (files of at most 8KB, an index, config.json,
    generation_config.json) with a tokenizer `save_pretrained` wrote beside it; dcp/ its weights; home/ an
    HF_HOME whose hub cache holds hf/ as the snapshot of tiny-org/base."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("hubbase")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(intermediate_size=24, tie_word_embeddings=False, **TINY))
    model.save_pretrained(root / "hf", max_shard_size="8KB")
    words = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", eos_token="b")
    tokenizer.chat_template = "{{ messages }}"
    tokenizer.save_pretrained(root / "hf")
    assert {"tokenizer.json", "chat_template.jinja", "generation_config.json"} <= set(files_of(root / "hf"))
    assert len(list((root / "hf").glob("*.safetensors"))) >= 3
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dcp.save({"model": state}, checkpoint_id=str(root / "dcp"), no_dist=True)
    hub_cache(root / "home", REPO, files_of(root / "hf"))
    return root


@pytest.fixture
def offline(base: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_HOME", str(base / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return base


def converted(out: Path, src: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`dcp-to-hf SRC OUT ARGS`, which must succeed."""
    proc = ckptconv("dcp-to-hf", src, str(out), *args)
    assert proc.returncode == 0, proc.stderr
    return proc


# -- offline, from the hub cache ----------------------------------------------------------------------------


def test_reference_repo_id_follows_and_checks_as_the_directory(offline: Path, tmp_path: Path) -> None:
    src, hf = str(offline / "dcp"), str(offline / "hf")
    flags = ["--file-split", "reference", "--dtype", "keep"]
    by_dir = converted(tmp_path / "dir", src, "--reference", hf, *flags)
    by_repo = converted(tmp_path / "repo", src, "--reference", REPO, *flags)
    assert tree_sha256(tmp_path / "repo") == tree_sha256(tmp_path / "dir")
    weights = {p.name for p in (offline / "hf").glob("*.safetensors")}
    assert tree_sha256(tmp_path / "repo").keys() == weights | {"model.safetensors.index.json"}  # no copies
    said = [line for line in by_repo.stderr.splitlines() if REPO in line]  # what was adopted, and from where
    assert said and [line.replace(REPO, hf) for line in said] == [
        line for line in by_dir.stderr.splitlines() if hf in line
    ]
    doc = report("dcp-to-hf", src, str(tmp_path / "o"), "--reference", REPO, *flags, "--dry-run")
    assert doc["reference"]["path"] == REPO and doc["reference"]["differences"] == []
    assert doc["reference"]["adopted"]["file_split"] is True


def test_copy_from_repo_id_copies_the_side_files(offline: Path, tmp_path: Path) -> None:
    src = str(offline / "dcp")
    converted(tmp_path / "dir", src, "--copy-from", str(offline / "hf"))
    converted(tmp_path / "repo", src, "--copy-from", REPO)
    got = tree_sha256(tmp_path / "repo")
    assert got == tree_sha256(tmp_path / "dir")
    assert {"config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja"} <= got.keys()


def headless(base: Path, dst: Path) -> Path:
    """A DCP of the base's weights but its head."""
    from safetensors.torch import load_file

    state = {k: v for f in (base / "hf").glob("*.safetensors") for k, v in load_file(f).items()}
    del state["lm_head.weight"]
    dcp.save({"model": state}, checkpoint_id=str(dst), no_dist=True)
    return dst


def test_a_wrong_layout_against_a_repo_id_is_refused(offline: Path, tmp_path: Path) -> None:
    out, src = tmp_path / "out", headless(offline, tmp_path / "dcp")
    proc = ckptconv("dcp-to-hf", str(src), str(out), "--reference", REPO)
    assert_one_line(proc.returncode, proc.stderr, f"reference {REPO}:", "missing 'lm_head.weight'")
    assert not out.exists()
    proc = ckptconv("verify", REPO, str(src), "--layout")
    assert proc.returncode == 1 and "lm_head.weight" in proc.stdout, proc.stdout + proc.stderr


def test_inspect_and_verify_layout_take_a_repo_id(offline: Path, tmp_path: Path) -> None:
    hf = str(offline / "hf")
    by_repo = report("inspect", hf, "--reference", REPO)
    by_dir = report("inspect", hf, "--reference", hf)
    assert by_repo["reference"]["path"] == REPO and by_repo["reference"]["differences"] == []
    assert {**by_repo["reference"], "path": hf} == by_dir["reference"]
    by_repo = report("verify", hf, REPO, "--layout")
    by_dir = report("verify", hf, hf, "--layout")
    assert by_repo["b"] == REPO and by_repo["match"] is True
    assert {**by_repo, "b": hf, "seconds": 0} == {**by_dir, "seconds": 0}
    proc = ckptconv("verify", REPO, str(offline / "dcp"), "--layout")
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["dcp-to-hf", "{dcp}", "{out}", "--reference", "tiny-org/not-cached"],
        ["dcp-to-hf", "{dcp}", "{out}", "--copy-from", "tiny-org/not-cached"],
        ["inspect", "{dcp}", "--reference", "tiny-org/not-cached"],
        ["verify", "tiny-org/not-cached", "{dcp}", "--layout"],
    ],
)
def test_an_uncached_repo_id_offline_is_one_line(offline: Path, tmp_path: Path, args: list[str]) -> None:
    argv = [a.format(dcp=offline / "dcp", out=tmp_path / "out") for a in args]
    proc = ckptconv(*argv)
    flag = next((a for a in argv if a.startswith("--") and a != "--layout"), None)
    needles = [f"{flag} tiny-org/not-cached"] if flag else ["tiny-org/not-cached"]
    assert_one_line(proc.returncode, proc.stderr, *needles, "cache")
    assert not (tmp_path / "out").exists()


def test_a_repo_cached_without_its_weights_offline_is_one_line(
    base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What an online --reference run leaves in the cache (index and config.json): no headers offline."""
    small = {n: b for n, b in files_of(base / "hf").items() if not n.endswith(".safetensors")}
    hub_cache(tmp_path / "home", REPO, small)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    proc = ckptconv("dcp-to-hf", str(base / "dcp"), str(tmp_path / "out"), "--reference", REPO)
    said = "not in the local Hugging Face cache"
    assert_one_line(proc.returncode, proc.stderr, f"--reference {REPO}", said)
    assert not (tmp_path / "out").exists()


def test_headers_read_elsewhere_are_validated(tmp_path: Path) -> None:
    """The hub's parsed headers are held to what `open_hf` holds a file to: a gap in the data is refused."""
    from ckptconv.errors import CkptconvError
    from ckptconv.formats.hf import from_headers

    ok = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    assert from_headers(tmp_path, {"model.safetensors": ok}, None).tensors["a"].shape == (2,)
    gap = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}
    with pytest.raises(CkptconvError, match="belong to no tensor"):
        from_headers(tmp_path, {"model.safetensors": gap}, None)
    with pytest.raises(CkptconvError, match="which has no header"):
        from_headers(tmp_path, {"model.safetensors": ok}, {"a": "model-00001.safetensors"})


def test_out_inside_the_hub_cache_is_refused(offline: Path) -> None:
    inside = offline / "home" / "hub" / "models--tiny-org--base" / "out"
    proc = ckptconv("dcp-to-hf", str(offline / "dcp"), str(inside), "--copy-from", REPO)
    assert_one_line(proc.returncode, proc.stderr, "cache folder of --copy-from")
    assert not inside.exists()


# -- online: huggingface_hub's functions replaced at their boundary ------------------------------------------


class FakeHub:
    """huggingface_hub's `snapshot_download` (the files its patterns select, from `model`) and its HTTP
    client (`hub_client`: ranged reads of `model`'s files, each read's repo and revision in `metadata_calls`);
    anything else that downloads fails the test."""

    def __init__(self, model: Path, cache: Path) -> None:
        self.model, self.cache = model, cache
        self.fetched: list[str] = []
        self.metadata_calls: list[tuple[str, str | None]] = []

    def snapshot_download(self, repo_id: str, *, revision: str | None = None, **kw: Any) -> str:
        from huggingface_hub.utils import filter_repo_objects

        names = sorted(p.name for p in self.model.iterdir())
        allow, ignore = kw.get("allow_patterns"), kw.get("ignore_patterns")
        chosen = list(filter_repo_objects(names, allow_patterns=allow, ignore_patterns=ignore))
        snap = self.cache / ("models--" + repo_id.replace("/", "--")) / "snapshots" / COMMIT
        snap.mkdir(parents=True, exist_ok=True)
        for name in chosen:
            shutil.copy(self.model / name, snap / name)
        self.fetched += chosen
        return str(snap)


@pytest.fixture
def online(base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.utils import _http

    fake = FakeHub(base / "hf", tmp_path / "cache")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake.snapshot_download)
    files = {p.name: p.read_bytes() for p in fake.model.iterdir() if p.is_file()}
    monkeypatch.setattr(_http, "_GLOBAL_CLIENT_FACTORY", hub_client(files, fake.metadata_calls))
    monkeypatch.setattr(_http, "_GLOBAL_CLIENT", None)  # made by the factory above; the old one comes back

    def no_download(*args: Any, **kw: Any) -> None:
        raise AssertionError(f"downloaded {args} {kw}")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_download)
    return fake


def test_online_reads_headers_and_fetches_no_weights(
    online: FakeHub, base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = str(base / "dcp")
    local = str(base / "hf")
    code, err = run(capsys, "dcp-to-hf", src, str(tmp_path / "dir"), "--copy-from", local, "--quiet")
    assert code == 0, err
    code, err = run(capsys, "dcp-to-hf", src, str(tmp_path / "repo"), "--copy-from", REPO, "--quiet")
    assert code == 0, err
    assert tree_sha256(tmp_path / "repo") == tree_sha256(tmp_path / "dir")
    assert online.fetched and not [n for n in online.fetched if n.endswith(".safetensors")], online.fetched
    assert "tokenizer.json" in online.fetched and "model.safetensors.index.json" in online.fetched
    assert set(online.metadata_calls) == {(REPO, COMMIT)}  # at the commit its index was fetched from
    online.fetched.clear()
    code, err = run(capsys, "dcp-to-hf", src, str(tmp_path / "ref"), "--reference", REPO, "--quiet")
    assert code == 0, err
    assert sorted(online.fetched) == ["config.json", "model.safetensors.index.json"]
    code, err = run(capsys, "verify", REPO, str(base / "hf"), "--layout")
    assert code == 0, err


# -- config.json from --reference ---------------------------------------------------------------------------


def test_reference_config_is_the_mapping_config(offline: Path, tmp_path: Path) -> None:
    """torchtitan's wq/wk are permuted by head: the mapping needs num_attention_heads, which only BASE's
    config.json gives once the DCP's kept config is gone."""
    titan = tmp_path / "titan"
    proc = ckptconv("hf-to-dcp", str(offline / "hf"), str(titan), "--mapping", "torchtitan-llama3")
    assert proc.returncode == 0, proc.stderr
    (titan / "config.json").unlink()
    mapping = ["--mapping", "torchtitan-llama3", "--dtype", "keep"]
    proc = ckptconv("dcp-to-hf", str(titan), str(tmp_path / "none"), *mapping)
    assert_one_line(proc.returncode, proc.stderr, "--config")
    for name, given in (("dir", str(offline / "hf")), ("repo", REPO)):
        converted(tmp_path / name, str(titan), *mapping, "--reference", given)
    from safetensors.torch import load_file

    want = {k: v for f in (offline / "hf").glob("*.safetensors") for k, v in load_file(f).items()}
    got = {k: v for f in (tmp_path / "repo").glob("*.safetensors") for k, v in load_file(f).items()}
    assert got.keys() == want.keys() and [k for k in want if not same_bits(got[k], want[k])] == []
    assert tree_sha256(tmp_path / "repo") == tree_sha256(tmp_path / "dir")


@pytest.mark.slow
def test_two_ranks_write_the_same_bytes_from_a_repo_id(offline: Path, tmp_path: Path) -> None:
    """Rank 0 fetches the repo's files and headers for both ranks: the bytes of one rank's run."""
    args = ["--copy-from", REPO, "--file-split", "reference"]
    converted(tmp_path / "one", str(offline / "dcp"), *args)
    proc = ckptconv("dcp-to-hf", str(offline / "dcp"), str(tmp_path / "two"), *args, nproc=2, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert tree_sha256(tmp_path / "two") == tree_sha256(tmp_path / "one")
