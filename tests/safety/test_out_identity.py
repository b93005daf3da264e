"""OUT against the inputs by identity (issue #34, item 1): URLs by the store fsspec resolves them to (s3
and s3a are one store), `file://` URLs as the local paths they name, a URL without a bucket refused before
anything is written, and every path a flag reads (the LoRA inputs, a hub snapshot of an adapter, a
hard-linked config) among the inputs OUT may not be, hold or lie inside."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import _env, s3_options
from safetensors.torch import save_file
from test_bad_input import assert_one_line, run
from test_output_safety import tree

from ckptconv.errors import CkptconvError
from ckptconv.remote.urls import url_path


def small_dcp(path: Path) -> Path:
    """A DCP checkpoint of two small tensors, written by torch's own dcp.save."""
    import torch.distributed.checkpoint as dcp

    state = {"model": {"a": torch.arange(12.0).view(3, 4), "b": torch.ones(5)}}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def small_hf(path: Path) -> Path:
    """An HF directory of one safetensors file, written by safetensors' own writer."""
    path.mkdir(parents=True)
    save_file({"a": torch.arange(12.0).view(3, 4), "b": torch.ones(5)}, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_dcp(tmp_path_factory.mktemp("dcp") / "ckpt")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_hf(tmp_path_factory.mktemp("hf") / "hf")


# --- URLs --------------------------------------------------------------------------------------------------


def test_identity_follows_the_store_fsspec_serves() -> None:
    """Protocols one fsspec file system serves are one store; the bucket is compared without case, `//`,
    trailing and leading slashes are dropped; a `file://` URL is the path fsspec's LocalFileSystem reads."""
    from fsspec.implementations.local import LocalFileSystem

    from ckptconv.remote.urls import file_path, identity, location

    same = [
        ("s3://b/x", "s3a://b/x"),
        ("s3://b/x", "S3A://B/x/"),
        ("s3://b/x", "s3:///b//x"),
        ("gs://b/x", "gcs://b/x"),
        ("az://c/x", "abfs://c/x"),
        ("az://c/x", "abfss://c@acct.dfs.core.windows.net/x"),
    ]
    for a, b in same:
        ua, ub = url_path(a), url_path(b)
        assert ua is not None and ub is not None
        assert identity(ua) == identity(ub), (a, b)
    for a, b in [("s3://b/x", "gs://b/x"), ("s3://b/x", "s3://b/X"), ("az://c/x", "adl://c/x")]:
        ua, ub = url_path(a), url_path(b)
        assert ua is not None and ub is not None
        assert identity(ua) != identity(ub), (a, b)
    for url in ["file:///abs/out", "file://rel/x", "file:/abs", "local:///a/b", "file://~/x"]:
        assert url_path(url) is None
        assert str(file_path(url)) == LocalFileSystem._strip_protocol(url), url
        assert location(url) == file_path(url)


def _s3_listing(s3: Any, key: str) -> list[str]:
    s3.invalidate_cache()
    return sorted(s3.find(f"ckpts/{key}"))


def _in_s3(
    capsys: pytest.CaptureFixture[str], endpoint: str, command: str, src: str, out: str, *flags: str
) -> tuple[int, str]:
    options = json.dumps(s3_options(endpoint))
    return run(capsys, command, src, out, *flags, "--storage-options", options, "-q")


def test_an_s3a_out_is_the_s3_source(
    dcp_dir: Path,
    hf_dir: Path,
    s3_endpoint: str,
    s3: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`dcp-to-hf s3://B/src s3a://B/src --overwrite` deleted every source object (then exit 2): s3a is the
    store s3 is. Every spelling of the source, of a prefix holding it or inside it is refused with nothing
    removed, in both directions."""
    s3.put(str(dcp_dir), "ckpts/id/dcp", recursive=True)
    s3.put(str(hf_dir), "ckpts/id/hf", recursive=True)
    before = {k: _s3_listing(s3, f"id/{k}") for k in ("dcp", "hf")}
    assert all(before.values())
    for command, key in (("dcp-to-hf", "dcp"), ("hf-to-dcp", "hf")):
        src = f"s3://ckpts/id/{key}"
        cases = {
            f"s3a://ckpts/id/{key}": "itself",
            f"S3A://ckpts/id/{key}/": "itself",
            f"s3a:///ckpts//id/{key}": "itself",
            f"s3a://CKPTS/id/{key}": "itself",
            "s3a://ckpts/id": "holds SRC",
            f"s3a://ckpts/id/{key}/sub": "is inside SRC",
        }
        for out, phrase in cases.items():
            code, err = _in_s3(capsys, s3_endpoint, command, src, out, "--overwrite")
            assert_one_line(code, err, str(url_path(out)), phrase)
            assert {k: _s3_listing(s3, f"id/{k}") for k in ("dcp", "hf")} == before, (command, out)


def test_an_s3a_out_is_the_s3_lora_adapter(
    peft_run: dict[str, Path], s3_endpoint: str, s3: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """hf-to-dcp's --lora-adapter in object storage is an input too, by the store it names."""
    s3.put(str(peft_run["adapter"]), "ckpts/ad/adapter", recursive=True)
    before = _s3_listing(s3, "ad")
    base, adapter = str(peft_run["base"]), "s3://ckpts/ad/adapter"
    code, err = _in_s3(
        capsys,
        s3_endpoint,
        "hf-to-dcp",
        base,
        "s3a://ckpts/ad/adapter",
        "--lora-adapter",
        adapter,
        "--overwrite",
    )
    assert_one_line(code, err, "is --lora-adapter", "itself")
    assert _s3_listing(s3, "ad") == before


BUCKETLESS = ["s3://", "s3:///", "S3://", "gs://", "s3://./", "file://", "file:///"]


def test_a_url_without_a_bucket_is_a_usage_error_before_anything_is_written(
    dcp_dir: Path,
    hf_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`dcp-to-hf SRC s3://` wrote a local directory `./s3:` and exited 0. A URL without a bucket or path,
    a chained one or one with `..`, as OUT, SRC, PATH, A/B or a flag's value: exit 2, one line, nothing
    written (the working directory is left as it was)."""
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    src = {"dcp-to-hf": str(dcp_dir), "hf-to-dcp": str(hf_dir)}
    for url in [*BUCKETLESS, "simplecache::s3://b/x", "s3://b/../x"]:
        for command in ("dcp-to-hf", "hf-to-dcp"):
            assert_one_line(*run(capsys, command, src[command], url, "-q"), url)
            assert_one_line(*run(capsys, command, url, str(tmp_path / "out"), "-q"), url)
        assert_one_line(*run(capsys, "inspect", url), url)
        assert_one_line(*run(capsys, "verify", url, str(dcp_dir)), url)
        assert_one_line(*run(capsys, "verify", str(hf_dir), url), url)
    for flag in ("--config", "--lora-config", "--mapping"):
        code, err = run(
            capsys, "dcp-to-hf", str(dcp_dir), str(tmp_path / "out"), flag, "s3://", "--lora", "drop"
        )
        assert_one_line(code, err, flag)
    code, err = run(capsys, "hf-to-dcp", str(hf_dir), str(tmp_path / "out"), "--lora-adapter", "s3://")
    assert_one_line(code, err, "--lora-adapter s3://", "without a bucket")
    assert list(work.iterdir()) == []
    assert not (tmp_path / "out").exists()


def test_a_local_directory_spelled_like_a_url_is_reached_by_its_path(
    dcp_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`./s3:/x` and an absolute path are local directories, as the bucketless error says."""
    monkeypatch.chdir(tmp_path)
    code, err = run(capsys, "dcp-to-hf", str(dcp_dir), "./s3:/x", "-q")
    assert code == 0, err
    assert (tmp_path / "s3:" / "x" / "model.safetensors").is_file()
    code, err = run(capsys, "dcp-to-hf", str(dcp_dir), str(tmp_path / "gs:"), "-q")
    assert code == 0, err
    assert (tmp_path / "gs:" / "model.safetensors").is_file()


def test_a_file_url_is_the_local_path_it_names(
    dcp_dir: Path,
    hf_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`dcp-to-hf SRC file://SRC --overwrite` wrote into the source; `file:///abs/out` wrote `./abs/out`. A
    file URL is the path fsspec reads: the source itself is refused; `file:///abs` writes /abs."""
    work = tmp_path / "cwd"
    work.mkdir()
    shutil.copytree(dcp_dir, work / "ckpt")
    shutil.copytree(hf_dir, work / "hf")
    monkeypatch.chdir(work)
    before = tree(work)
    for command, src in (("dcp-to-hf", "ckpt"), ("hf-to-dcp", "hf")):
        for out in (f"file://{src}", f"file://{work}/{src}", f"file://./x/../{src}"):
            code, err = run(capsys, command, src, out, "--overwrite", "-q")
            assert_one_line(code, err, "itself")
            assert tree(work) == before, (command, out)
        code, err = run(capsys, command, f"file://{src}", f"{src}/sub", "-q")
        assert_one_line(code, err, "is inside SRC")
    assert tree(work) == before
    code, err = run(capsys, "dcp-to-hf", f"file://{work}/ckpt", f"file://{tmp_path}/hf-out", "-q")
    assert code == 0, err
    code, err = run(capsys, "hf-to-dcp", f"file://{tmp_path}/hf-out", f"file://{tmp_path}/dcp-out", "-q")
    assert code == 0, err
    assert (tmp_path / "hf-out" / "model.safetensors").is_file()
    assert (tmp_path / "dcp-out" / ".metadata").is_file()
    assert tree(work) == before  # nothing under ./tmp/...
    code, err = run(capsys, "verify", f"file://{tmp_path}/dcp-out", f"file://{tmp_path}/hf-out")
    assert code == 0, err


# --- the LoRA inputs, the hub cache, aliases of a local input -----------------------------------------------


@pytest.fixture(scope="module")
def peft_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama (base), a PEFT LoRA of it saved by PEFT's `save_pretrained` (adapter), and the
    PEFT-wrapped model's state dict saved by dcp.save (dcp)."""
    from families import tiny
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("peft")
    base = tiny("llama", root / "base")
    torch.manual_seed(0)
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], init_lora_weights=False)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), config)
    model.save_pretrained(root / "adapter")
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": model.state_dict()}, checkpoint_id=str(root / "dcp"), no_dist=True)
    return {"base": base, "adapter": root / "adapter", "dcp": root / "dcp", "model": model}  # type: ignore[dict-item]


def test_the_lora_inputs_are_inputs(
    peft_run: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`hf-to-dcp BASE ADAPTER --lora-adapter ADAPTER --overwrite` exited 0 with the adapter replaced by the
    DCP; `dcp-to-hf CKPT RUN --lora merge --lora-config RUN/adapter_config.json --overwrite` wiped RUN. Both:
    exit 2, nothing touched."""
    adapter = shutil.copytree(peft_run["adapter"], tmp_path / "adapter")
    run_dir = tmp_path / "run"  # a previous adapter release, holding the config the trainer wrote
    config = str(peft_run["adapter"] / "adapter_config.json")
    flags = ("--lora", "adapter", "--lora-config", config, "-q")
    assert run(capsys, "dcp-to-hf", str(peft_run["dcp"]), str(run_dir), *flags)[0] == 0
    before = tree(tmp_path)
    code, err = run(
        capsys,
        "hf-to-dcp",
        str(peft_run["base"]),
        str(adapter),
        "--lora-adapter",
        str(adapter),
        "--overwrite",
    )
    assert_one_line(code, err, "is --lora-adapter", "itself")
    code, err = run(
        capsys, "hf-to-dcp", str(peft_run["base"]), str(adapter / "sub"), "--lora-adapter", str(adapter)
    )
    assert_one_line(code, err, "is inside --lora-adapter")
    merge = ["--lora", "merge", "--lora-config", str(run_dir / "adapter_config.json"), "--overwrite"]
    code, err = run(capsys, "dcp-to-hf", str(peft_run["dcp"]), str(run_dir), *merge)
    assert_one_line(code, err, "contains --lora-config")
    code, err = run(capsys, "dcp-to-hf", str(peft_run["dcp"]), str(tmp_path), *merge)
    assert_one_line(code, err, "contains")
    assert tree(tmp_path) == before


def test_save_hf_keeps_clear_of_its_lora_config(peft_run: dict[str, Any], tmp_path: Path) -> None:
    """save_hf (overwrite=True by default) into the directory holding its `lora_config` wiped it."""
    import ckptconv

    run_dir = tmp_path / "run"
    state = peft_run["model"].state_dict()
    ckptconv.save_hf(state, run_dir, lora="adapter", lora_config=peft_run["adapter"] / "adapter_config.json")
    before = tree(tmp_path)
    with pytest.raises(CkptconvError, match="contains lora_config"):
        ckptconv.save_hf(state, run_dir, lora="merge", lora_config=run_dir / "adapter_config.json")
    with pytest.raises(CkptconvError, match="without a bucket"):
        ckptconv.save_hf(state, "s3://", lora="drop")
    assert tree(tmp_path) == before


def _hub_cache(cache: Path, repo: str, files: Path) -> Path:
    """huggingface_hub's cache layout for `repo`: blobs, a snapshot whose entries link to them, refs/main."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    snapshot = folder / "snapshots" / ("0" * 40)
    (folder / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in files.iterdir():
        shutil.copy(f, folder / "blobs" / f.name)
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / f.name)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("0" * 40)
    return folder


def test_a_hub_adapter_is_an_input_with_its_cache_folder(peft_run: dict[str, Path], tmp_path: Path) -> None:
    """`--lora-adapter org/adapter` resolves to a snapshot in the hub cache: OUT may not be inside that
    repo's folder (it was written there, exit 0), nor hold it."""
    cache = tmp_path / "hub"
    folder = _hub_cache(cache, "org/adapter", peft_run["adapter"])
    env = {**_env(), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    before = tree(tmp_path)
    command = [sys.executable, "-m", "ckptconv", "hf-to-dcp", str(peft_run["base"])]
    for out, phrase in (
        (folder / "blobs" / "new", "inside the cache folder of --lora-adapter"),
        (cache, "contains"),
    ):
        proc = subprocess.run(
            [*command, str(out), "--overwrite", "--lora-adapter", "org/adapter"],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert_one_line(proc.returncode, proc.stderr, phrase)
        assert tree(tmp_path) == before


def test_local_aliases_of_an_input(dcp_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """By device and inode: a --config hard-linked into OUT (OUT holds it under another name), OUT a symlink
    to SRC's parent, OUT spelled with `..` through a symlink into SRC."""
    src = shutil.copytree(dcp_dir, tmp_path / "data" / "ckpt")
    out = tmp_path / "out"
    assert run(capsys, "dcp-to-hf", str(src), str(out), "-q")[0] == 0
    (out / "config.json").write_text("{}")
    os.link(out / "config.json", tmp_path / "config.json")
    (tmp_path / "parent").symlink_to(src.parent)
    before = tree(tmp_path)
    flags = ["--overwrite", "-q"]
    code, err = run(
        capsys, "dcp-to-hf", str(src), str(out), "--config", str(tmp_path / "config.json"), *flags
    )
    assert_one_line(code, err, "hard link of --config")
    assert_one_line(*run(capsys, "dcp-to-hf", str(src), str(tmp_path / "parent"), *flags), "contains SRC")
    spelled = f"{tmp_path}/parent/ckpt/../ckpt/./sub/.."
    assert_one_line(*run(capsys, "dcp-to-hf", str(src), spelled, *flags), "itself")
    assert tree(tmp_path) == before
