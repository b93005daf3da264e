"""Checkpoints in object storage: a real S3 server (moto's standalone server, as s3fs's own tests use) started
by the test, checkpoints written by FSDP2 jobs and uploaded to it, read by ckptconv with ranged GETs."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import SECRET, ckptconv, s3_options, tree_sha256

s3fs = pytest.importorskip("s3fs", reason="the [s3] extra (s3fs) is part of the test extras")
pytest.importorskip("moto", reason="moto's server is part of the test extras")

from ckptconv.formats.dcp import open_dcp  # noqa: E402
from ckptconv.remote import urls  # noqa: E402
from ckptconv.remote.files import RemoteFiles  # noqa: E402


def _upload(s3: s3fs.S3FileSystem, local: Path, key: str) -> str:
    s3.put(str(local), f"ckpts/{key}", recursive=True)
    return f"s3://ckpts/{key}"


def _run(s3_endpoint: str, *args: str, nproc: int = 0, **kw: str) -> subprocess.CompletedProcess[str]:
    options = json.dumps(s3_options(s3_endpoint, **kw))
    return ckptconv(*args, "--storage-options", options, nproc=nproc)


def _needed(ckpt: Path) -> int:
    """Bytes dcp-to-hf needs: the model's chunks, the stashed items, and the safetensors serialization's
    headers (its chunks are the tensors' data only)."""
    local = open_dcp(ckpt)
    model = [c for t in local.tensors.values() if t.fqn.startswith("model.") for c in t.chunks]
    headers = sum(
        8 + int.from_bytes((ckpt / name).read_bytes()[:8], "little")
        for name in {c.file for c in model if c.fmt == "safetensors"}
    )
    return sum(c.byte_length for c in model) + sum(i.byte_length for i in local.items.values()) + headers


def _files(ckpt: Path) -> int:
    return len(list(ckpt.glob("*.distcp")))


@pytest.mark.parametrize("fixture", ["fsdp2_ckpt", "mesh2d_ckpt"])
def test_dcp_to_hf_from_s3_matches_local_bytes(
    fixture: str, request: pytest.FixtureRequest, s3_endpoint: str, s3: s3fs.S3FileSystem, tmp_path: Path
) -> None:
    """torch_save and safetensors serializations: the same files as from a local copy, and every byte
    fetched is a byte needed (gaps of at most --coalesce-gap read across; 0: none)."""
    ckpt: Path = request.getfixturevalue(fixture)
    url = _upload(s3, ckpt, fixture)
    local = tmp_path / "local"
    assert ckptconv("dcp-to-hf", str(ckpt), str(local), "--fp32", "A_log$", "-q").returncode == 0
    requests = {}
    for gap in ("0", "1MB"):
        out = tmp_path / f"remote-{gap}"
        proc = _run(
            s3_endpoint, "dcp-to-hf", url, str(out), "--fp32", "A_log$", "--json", "--coalesce-gap", gap
        )
        assert proc.returncode == 0, proc.stderr
        assert tree_sha256(out) == tree_sha256(local)
        report = json.loads(proc.stdout)
        assert report["src"] == url
        (rank,) = report["ranks"]
        requests[gap] = rank["requests"]
        if gap == "0":  # not a byte more than needed
            assert rank["bytes_fetched"] <= _needed(ckpt)
    # neighbours coalesced: at most a header read and one GET per file, and one per stashed item
    assert requests["1MB"] <= min(requests["0"], 2 * _files(ckpt) + len(open_dcp(ckpt).items))


@pytest.mark.slow
def test_two_ranks_from_s3_byte_identical(
    fsdp2_ckpt: Path, s3_endpoint: str, s3: s3fs.S3FileSystem, tmp_path: Path
) -> None:
    url = _upload(s3, fsdp2_ckpt, "two-ranks")
    local = tmp_path / "local"
    assert ckptconv("dcp-to-hf", str(fsdp2_ckpt), str(local), "-q").returncode == 0
    out = tmp_path / "remote"
    proc = _run(s3_endpoint, "dcp-to-hf", url, str(out), "--json", "--coalesce-gap", "0", nproc=2)
    assert proc.returncode == 0, proc.stderr
    assert tree_sha256(out) == tree_sha256(local)
    ranks = json.loads(proc.stdout)["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["requests"] > 0 for r in ranks)
    assert sum(r["bytes_fetched"] for r in ranks) <= _needed(fsdp2_ckpt)


@pytest.mark.slow
def test_two_ranks_fetch_each_needed_byte_once(
    s3_endpoint: str, s3: s3fs.S3FileSystem, tmp_path: Path
) -> None:
    """The model part of a checkpoint that also holds optimizer state, 21 small layers: the HF file lists
    them in name order (0, 1, 10, ..., 19, 2, 20, 3, ...), so in the DCP file the records each rank reads
    alternate in runs a few records apart, and the layer the ranks' shares meet in is read as rows by both.
    With the default --coalesce-gap, each rank's requests coalesce its own records but never read across
    the other's: together they fetch at most 1.05x the bytes needed (1.8x before), and write what one rank
    does."""
    import torch
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    model = {f"layers.{i}.w": torch.randn(64, 64, generator=g) for i in range(21)}
    optim = {k: {"exp_avg": torch.randn(64, 64, generator=g)} for k in model}
    dcp.save({"model": model, "optim": optim}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    url = _upload(s3, tmp_path / "ckpt", "shared-out")
    outs, ranks = {}, {}
    for nproc in (0, 2):
        outs[nproc] = tmp_path / f"out-{nproc}"
        proc = _run(s3_endpoint, "dcp-to-hf", url, str(outs[nproc]), "--json", nproc=nproc)
        assert proc.returncode == 0, proc.stderr
        ranks[nproc] = json.loads(proc.stdout)["ranks"]
    assert tree_sha256(outs[2]) == tree_sha256(outs[0])
    needed = _needed(tmp_path / "ckpt")
    assert [r["rank"] for r in ranks[2]] == [0, 1] and all(r["requests"] > 0 for r in ranks[2])
    assert sum(r["bytes_fetched"] for r in ranks[2]) <= 1.05 * needed, (ranks[2], needed)
    assert ranks[0][0]["bytes_fetched"] <= 1.05 * needed


def test_no_byte_fetched_twice_under_a_small_bucket(
    s3_endpoint: str, s3: s3fs.S3FileSystem, tmp_path: Path
) -> None:
    """30 records of 1.2 MB with --bucket-size 2MB (fetched spans kept within 2 MB): a span waits only for
    the bytes still to be read (a record's zip entries are read when it is located), so none is pushed out
    before its data is read and fetched again (before: 1.04x the bytes, 69 GETs instead of 60)."""
    import torch
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    state = {"model": {f"layers.{i}.w": torch.randn(300, 1000, generator=g) for i in range(30)}}
    dcp.save(state, checkpoint_id=str(tmp_path / "many"), no_dist=True)
    url = _upload(s3, tmp_path / "many", "many")
    proc = _run(s3_endpoint, "dcp-to-hf", url, str(tmp_path / "out"), "--bucket-size", "2MB", "--json")
    assert proc.returncode == 0, proc.stderr
    (rank,) = json.loads(proc.stdout)["ranks"]
    assert rank["bytes_fetched"] <= _needed(tmp_path / "many") and rank["requests"] <= 60, rank


def test_inspect_and_verify_take_urls(
    fsdp2_ckpt: Path, s3_endpoint: str, s3: s3fs.S3FileSystem, tmp_path: Path
) -> None:
    url = _upload(s3, fsdp2_ckpt, "run/step-10")
    remote = _run(s3_endpoint, "inspect", "s3://ckpts/run", "--json")  # the one checkpoint inside
    local = ckptconv("inspect", str(fsdp2_ckpt), "--json")
    assert remote.returncode == 0, remote.stderr
    doc, expected = json.loads(remote.stdout), json.loads(local.stdout)
    assert doc["path"] == url
    assert {k: v for k, v in doc.items() if k != "path"} == {k: v for k, v in expected.items() if k != "path"}
    out = tmp_path / "hf"
    assert ckptconv("dcp-to-hf", str(fsdp2_ckpt), str(out), "--dtype", "fp32", "-q").returncode == 0
    same = _run(s3_endpoint, "verify", url, str(out), "--prefix", "model.")
    assert same.returncode == 0, same.stderr
    assert "match" in same.stdout


def test_bad_credentials_missing_objects_and_extras(
    fsdp2_ckpt: Path, s3_endpoint: str, s3: s3fs.S3FileSystem, tmp_path: Path
) -> None:
    """Each is one line, exit 2, no OUT; the secret of --storage-options is in no message."""
    url = _upload(s3, fsdp2_ckpt, "broken")
    out = tmp_path / "out"
    cases = {
        "wrong s3_endpoint": (_run("http://127.0.0.1:9", "dcp-to-hf", url, str(out)), "cannot read"),
        "no prefix": (_run(s3_endpoint, "dcp-to-hf", "s3://ckpts/nothing", str(out)), "no such object"),
        "no bucket": (_run(s3_endpoint, "dcp-to-hf", "s3://no-bucket/x", str(out)), "s3://no-bucket/x"),
        "bad json": (ckptconv("dcp-to-hf", url, str(out), "--storage-options", "{"), "--storage-options"),
    }
    s3.rm(f"ckpts/broken/{next(n for n in s3.ls('ckpts/broken') if n.endswith('.distcp')).split('/')[-1]}")
    cases["object removed"] = (_run(s3_endpoint, "dcp-to-hf", url, str(out)), "missing")
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        cases["missing extra"] = (ckptconv("dcp-to-hf", "gs://b/x", str(out)), "pip install 'ckptconv[gcs]'")
    for name, (proc, words) in cases.items():
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, (name, proc.stderr)
        assert len(lines) == 1 and lines[0].startswith("ckptconv: error:"), (name, lines)
        assert words in lines[0], (name, lines)
        assert "Traceback" not in proc.stderr and SECRET not in proc.stderr + proc.stdout
        assert not out.exists()


def test_object_removed_while_reading(fsdp2_ckpt: Path, s3_endpoint: str, s3: s3fs.S3FileSystem) -> None:
    """Listed, then gone: the ranged GET's failure is one error naming the object."""
    url = _upload(s3, fsdp2_ckpt, "vanishing")
    urls.configure(json.dumps(s3_options(s3_endpoint)))
    try:
        root = urls.url_path(url)
        assert root is not None
        files = RemoteFiles(root)
        name = next(n for n in files.sizes() if n.endswith(".distcp"))
        assert files.read(name, 0, 4) == b"PK\x03\x04"
        s3.rm(f"ckpts/vanishing/{name}")
        with pytest.raises(Exception, match=r"vanishing/.*no such object \(removed while being read\?\)"):
            files.read(name, 4, 4)
    finally:
        urls.configure(None)


def test_storage_options_win_over_the_environment(
    fsdp2_ckpt: Path, s3_endpoint: str, s3: s3fs.S3FileSystem, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = _upload(s3, fsdp2_ckpt, "env")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "env-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)  # the environment alone reaches the server
    assert ckptconv("dcp-to-hf", url, str(tmp_path / "a"), "-q").returncode == 0
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # wrong, but --storage-options wins
    options = json.dumps({"endpoint_url": s3_endpoint})
    proc = ckptconv("dcp-to-hf", url, str(tmp_path / "b"), "-q", "--storage-options", options)
    assert proc.returncode == 0, proc.stderr
    assert tree_sha256(tmp_path / "a") == tree_sha256(tmp_path / "b")
