"""Hugging Face checkpoints in object storage (moto's S3 server, started by the test): hf-to-dcp, inspect,
verify and load_hf read the safetensors objects in place (headers by two ranged GETs, tensors by range), and
give what they give from a local copy of the same files."""

from __future__ import annotations

import hashlib
import json
import subprocess
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import SECRET, WORKERS, ckptconv, s3_options, s3_requests, torchrun, tree_sha256
from families import tiny
from test_dcp_to_hf import load_dir

s3fs = pytest.importorskip("s3fs", reason="the [s3] extra (s3fs) is part of the test extras")
pytest.importorskip("moto", reason="moto's server is part of the test extras")

from ckptconv import load_hf  # noqa: E402
from ckptconv.remote import urls  # noqa: E402


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama saved by transformers' save_pretrained in shards (index, 3+ files, config.json)."""
    import transformers as tf

    path = tiny("llama", tmp_path_factory.mktemp("llama") / "model")
    model = tf.AutoModelForCausalLM.from_pretrained(path)
    model.save_pretrained(path, max_shard_size="40KB")
    for single in path.glob("model.safetensors"):
        single.unlink()
    assert len(list(path.glob("*.safetensors"))) >= 3 and (path / "model.safetensors.index.json").exists()
    return path


def _upload(s3: s3fs.S3FileSystem, local: Path, key: str) -> str:
    s3.put(str(local), f"ckpts/{key}", recursive=True)
    return f"s3://ckpts/{key}"


def _same_dcp(a: Path, b: Path) -> None:
    """The same data files, byte for byte, and the same tensors in `.metadata` (which also records the
    staging directory and a random save id)."""
    from torch.distributed.checkpoint import FileSystemReader

    files_a, files_b = tree_sha256(a), tree_sha256(b)
    assert files_a.pop(".metadata") and files_b.pop(".metadata")
    assert files_a == files_b
    meta_a, meta_b = (FileSystemReader(str(p)).read_metadata() for p in (a, b))
    assert meta_a.state_dict_metadata == meta_b.state_dict_metadata
    assert meta_a.storage_data == meta_b.storage_data


def _run(s3_endpoint: str, *args: str, nproc: int = 0) -> subprocess.CompletedProcess[str]:
    return ckptconv(*args, "--storage-options", json.dumps(s3_options(s3_endpoint)), nproc=nproc)


@pytest.mark.parametrize("nproc", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_hf_to_dcp_from_s3_matches_local(
    nproc: int, llama: Path, s3_endpoint: str, s3: s3fs.S3FileSystem, tmp_path: Path
) -> None:
    """A sharded transformers model (index, config.json) in S3: the DCP a local copy gives, with a preset that
    reads config.json (the config is kept beside .metadata), on 1 and 2 ranks; --verify reads it back from
    S3; every rank fetches only the rows it writes, and on 2 ranks no rank fetches the other's rows (before,
    a rank's rows of neighbouring tensors, the other's rows apart, were read across: twice the bytes)."""
    url = _upload(s3, llama, f"llama-{nproc}")
    flags = ("--mapping", "torchtitan-llama3")
    local = tmp_path / "local"
    assert ckptconv("hf-to-dcp", str(llama), str(local), *flags, "-q", nproc=nproc).returncode == 0
    requests = {}
    for gap in ("0", "1MB"):
        out = tmp_path / f"remote-{gap}"
        argv = ("hf-to-dcp", url, str(out), *flags, "--json", "--verify", "--coalesce-gap", gap)
        proc = _run(s3_endpoint, *argv, nproc=nproc)
        assert proc.returncode == 0, proc.stderr
        _same_dcp(out, local)
        assert "config.json" in tree_sha256(out)
        report = json.loads(proc.stdout)
        assert report["src"] == url and report["verified"] is True
        ranks = report["ranks"]
        assert [r["rank"] for r in ranks] == list(range(max(nproc, 1)))
        requests[gap] = sum(r["requests"] for r in ranks)
        # no byte but those read, each rank its rows only: with 0, and with 1MB too (a safetensors file's
        # tensors lie back to back: the only gaps are other ranks' rows, never read across)
        data = sum(p.stat().st_size for p in llama.glob("*.safetensors"))  # headers included
        assert all(0 < r["bytes_fetched"] == r["bytes_read"] for r in ranks)
        assert sum(r["bytes_fetched"] for r in ranks) < data
    # neighbours coalesced (touching ones at any gap): on 1 rank one GET per file, not one per tensor; on 2
    # ranks a rank's rows of neighbouring tensors are the other rank's rows apart: one GET per tensor
    files = len(list(llama.glob("*.safetensors")))
    tensors = len(load_dir(llama))
    assert requests["1MB"] <= requests["0"], requests
    assert requests["1MB"] <= (files if not nproc else nproc * tensors), requests
    if not nproc:
        assert requests["1MB"] < tensors, requests


@pytest.mark.slow
def test_only_rank_0_lists_a_source(
    llama: Path, fsdp2_ckpt: Path, s3_endpoint: str, s3: s3fs.S3FileSystem, tmp_path: Path
) -> None:
    """On 2 ranks, the source prefix is listed once for the whole job (the server's own request log), and
    the index, the headers and `.metadata` are fetched once: rank 0 shares what it found."""
    hf, dcp = _upload(s3, llama, "listed/hf"), _upload(s3, fsdp2_ckpt, "listed/dcp")
    for command, src in (("hf-to-dcp", hf), ("dcp-to-hf", dcp)):
        out = tmp_path / command
        proc, seen = s3_requests(s3_endpoint, partial(_run, s3_endpoint, command, src, str(out), nproc=2))
        assert proc.returncode == 0, proc.stderr
        listings = [r["url"] for r in seen if r["method"] == "GET" and "list-type=2" in r["url"]]
        assert len(listings) == 1, (command, listings)
        whole = [r["url"] for r in seen if r["method"] == "GET" and "Range" not in r["headers"]]
        assert all("list-type" in url for url in whole), whole  # every object read by range
        small = ("model.safetensors.index.json", ".metadata")
        for name in small:
            reads = [r for r in seen if r["method"] == "GET" and r["url"].split("?")[0].endswith("/" + name)]
            assert len(reads) <= 1, (command, name, len(reads))


def test_ckptconv_release_in_s3_round_trips_its_stash(
    fsdp2_ckpt: Path, s3_endpoint: str, s3: s3fs.S3FileSystem, tmp_path: Path
) -> None:
    """dcp-to-hf straight into S3, then hf-to-dcp straight from it: the stashed step/args come back, and the
    DCP equals the one made from a local release."""
    local_hf, local_dcp, remote_dcp = tmp_path / "hf", tmp_path / "dcp", tmp_path / "from-s3"
    assert ckptconv("dcp-to-hf", str(fsdp2_ckpt), str(local_hf), "--dtype", "fp32", "-q").returncode == 0
    assert ckptconv("hf-to-dcp", str(local_hf), str(local_dcp), "-q").returncode == 0
    url = "s3://ckpts/release"
    made = _run(s3_endpoint, "dcp-to-hf", str(fsdp2_ckpt), url, "--dtype", "fp32", "-q")
    assert made.returncode == 0, made.stderr
    proc = _run(s3_endpoint, "hf-to-dcp", url, str(remote_dcp), "-q")
    assert proc.returncode == 0, proc.stderr
    _same_dcp(remote_dcp, local_dcp)
    items = json.loads(ckptconv("inspect", str(remote_dcp), "--json").stdout)["non_tensor_items"]
    assert (
        "step" in items
        and items == json.loads(ckptconv("inspect", str(local_dcp), "--json").stdout)["non_tensor_items"]
    )


def test_single_object_inspect_and_verify(
    llama: Path, fsdp2_ckpt: Path, s3_endpoint: str, s3: s3fs.S3FileSystem, tmp_path: Path
) -> None:
    """One .safetensors object, and a sharded prefix: inspect as of the local files; verify a DCP against
    the HF prefix in S3 (and the S3 DCP against a local HF directory)."""
    hf = tmp_path / "hf"
    assert ckptconv("dcp-to-hf", str(fsdp2_ckpt), str(hf), "--dtype", "fp32", "-q").returncode == 0
    prefix = _upload(s3, hf, "verify/hf")
    one = f"{prefix}/model.safetensors"
    for url, local in ((one, hf / "model.safetensors"), (_upload(s3, llama, "inspect"), llama)):
        remote = _run(s3_endpoint, "inspect", url, "--json")
        assert remote.returncode == 0, remote.stderr
        doc = json.loads(remote.stdout)
        expected = json.loads(ckptconv("inspect", str(local), "--json").stdout)
        assert doc.pop("path") == url and expected.pop("path") == str(local)
        assert doc == expected
    same = _run(s3_endpoint, "verify", str(fsdp2_ckpt), prefix, "--prefix", "model.")
    assert same.returncode == 0, same.stderr
    dcp_url = _upload(s3, fsdp2_ckpt, "verify/dcp")
    same = _run(s3_endpoint, "verify", dcp_url, one, "--prefix", "model.")
    assert same.returncode == 0, same.stderr
    single = tmp_path / "from-one"
    assert _run(s3_endpoint, "hf-to-dcp", one, str(single), "-q").returncode == 0
    assert ckptconv("verify", str(single), str(hf)).returncode == 0


def _data_gets(seen: list[dict[str, Any]], suffix: str) -> int:
    """Ranged GETs of objects named `*suffix`."""
    return sum(1 for r in seen if r["method"] == "GET" and r["url"].split("?")[0].endswith(suffix))


def test_verify_and_load_hf_coalesce_their_reads(
    llama: Path, s3_endpoint: str, s3: s3fs.S3FileSystem, tmp_path: Path
) -> None:
    """verify of two S3 checkpoints and load_hf of an S3 model read each file's neighbouring tensors in one
    GET, not one GET per tensor or chunk (without it: 27 GETs of the 3 safetensors objects, 296 of the
    DCP's): a file's header, then its data."""
    import transformers as tf

    hf = _upload(s3, llama, "coalesce/hf")
    dcp = tmp_path / "dcp"
    assert ckptconv("hf-to-dcp", str(llama), str(dcp), "-q").returncode == 0
    dcp_url = _upload(s3, dcp, "coalesce/dcp")
    tensors, files = len(load_dir(llama)), len(list(llama.glob("*.safetensors")))
    proc, seen = s3_requests(s3_endpoint, partial(_run, s3_endpoint, "verify", hf, dcp_url))
    assert proc.returncode == 0, proc.stderr
    gets = (_data_gets(seen, ".safetensors"), _data_gets(seen, ".distcp"))
    assert gets[0] <= 3 * files < tensors and gets[1] <= 2 * len(list(dcp.glob("*.distcp"))), gets

    model = tf.AutoModelForCausalLM.from_pretrained(llama)
    want = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    try:
        report, seen = s3_requests(
            s3_endpoint, lambda: load_hf(want, hf, strict=False, storage_options=s3_options(s3_endpoint))
        )
    finally:
        urls.configure(None)
    assert report.loaded and _data_gets(seen, ".safetensors") <= 3 * files < tensors, len(seen)
    assert all(torch.equal(want[k], v) for k, v in model.state_dict().items() if k in report.loaded)


def test_load_hf_from_s3(llama: Path, s3_endpoint: str, s3: s3fs.S3FileSystem) -> None:
    """load_hf of a URL fills a state dict exactly as load_hf of the local directory."""
    url = _upload(s3, llama, "load")
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(llama)
    want = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    got = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    load_hf(want, llama, strict=False)
    try:
        load_hf(got, url, strict=False, storage_options=s3_options(s3_endpoint))
    finally:
        urls.configure(None)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items() if k in got and v.any())


@pytest.mark.slow
def test_save_hf_into_s3_writes_what_it_writes_locally(
    s3_endpoint: str, s3: s3fs.S3FileSystem, tmp_path: Path
) -> None:
    """save_hf from an FSDP2 job on 2 ranks into a URL: the objects are the files it writes into a directory,
    the index last (as dcp-to-hf writes a URL OUT)."""
    options = json.dumps(s3_options(s3_endpoint))
    torchrun(2, str(WORKERS / "live.py"), "save-url", str(tmp_path), "fsdp2", "s3://ckpts/live", options)
    local = tree_sha256(tmp_path / "live")
    assert "model.safetensors.index.json" in local and "ckptconv_state.json" in local
    s3.invalidate_cache()
    remote = {p.rsplit("/", 1)[1]: hashlib.sha256(s3.cat_file(p)).hexdigest() for p in s3.find("ckpts/live")}
    assert remote == local
    assert list(s3.list_multipart_uploads("ckpts")) == []


def test_wrong_kind_and_broken_objects(
    llama: Path, fsdp2_ckpt: Path, s3_endpoint: str, s3: s3fs.S3FileSystem, tmp_path: Path
) -> None:
    """Each is one line, exit 2, nothing written, no secret in it."""
    from test_bad_input import assert_one_line

    hf = _upload(s3, llama, "wrong/hf")
    dcp = _upload(s3, fsdp2_ckpt, "wrong/dcp")
    shard = sorted(p.name for p in llama.glob("*.safetensors"))[0]
    s3.pipe("ckpts/wrong/cut/model.safetensors", (1 << 40).to_bytes(8, "little") + b"{}")
    s3.pipe("ckpts/wrong/bin/pytorch_model.bin", b"not read")
    index = json.loads((llama / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = "../elsewhere.safetensors"
    s3.put(str(llama), "ckpts/wrong/escape", recursive=True)
    s3.pipe("ckpts/wrong/escape/model.safetensors.index.json", json.dumps(index).encode())
    out = tmp_path / "out"
    cases = {
        "dcp into hf-to-dcp": (_run(s3_endpoint, "hf-to-dcp", dcp, str(out)), "use dcp-to-hf"),
        "hf into dcp-to-hf": (_run(s3_endpoint, "dcp-to-hf", hf, str(out)), "use hf-to-dcp"),
        "one object into dcp-to-hf": (
            _run(s3_endpoint, "dcp-to-hf", f"{hf}/{shard}", str(out)),
            "use hf-to-dcp",
        ),
        "revision": (_run(s3_endpoint, "hf-to-dcp", hf, str(out), "--revision", "main"), "--revision"),
        "header": (_run(s3_endpoint, "hf-to-dcp", "s3://ckpts/wrong/cut", str(out)), "header length"),
        "no safetensors": (_run(s3_endpoint, "hf-to-dcp", "s3://ckpts/wrong/bin", str(out)), "not .bin"),
        "escape": (_run(s3_endpoint, "hf-to-dcp", "s3://ckpts/wrong/escape", str(out)), "outside"),
        "nothing": (_run(s3_endpoint, "inspect", "s3://ckpts/wrong/none"), "no such object"),
        "out is src": (_run(s3_endpoint, "hf-to-dcp", hf, hf, "--overwrite"), "OUT must never be an input"),
        "out in src": (_run(s3_endpoint, "hf-to-dcp", hf, f"{hf}/dcp", "--overwrite"), "is inside SRC"),
        "out holds src": (
            _run(s3_endpoint, "dcp-to-hf", dcp, "s3://ckpts/wrong", "--overwrite"),
            "holds SRC",
        ),
    }
    for name, (proc, words) in cases.items():
        assert_one_line(proc.returncode, proc.stderr, words)
        assert SECRET not in proc.stderr + proc.stdout
        assert not out.exists(), name
    s3.invalidate_cache()  # the source is whole: no --overwrite removed it
    assert sorted(n.rsplit("/", 1)[1] for n in s3.find("ckpts/wrong/hf")) == sorted(
        p.name for p in llama.iterdir()
    )
