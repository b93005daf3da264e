"""dcp-to-hf writing OUT to object storage (moto's S3 server): the bytes of a local conversion, the completing
object last, and nothing of a failed run left behind (objects or unfinished multipart uploads)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pytest
from conftest import WORKERS, ckptconv, random_dcp, s3_options, torchrun, tree_sha256
from test_bad_input import assert_one_line

s3fs = pytest.importorskip("s3fs", reason="the [s3] extra (s3fs) is part of the test extras")
pytest.importorskip("moto", reason="moto's server is part of the test extras")

from ckptconv.cli.app import main  # noqa: E402


def _objects(client: s3fs.S3FileSystem, key: str) -> dict[str, str]:
    client.invalidate_cache()
    return {
        path.rsplit("/", 1)[1]: hashlib.sha256(client.cat_file(path)).hexdigest()
        for path in client.find(f"ckpts/{key}")
    }


def _uploads_in_progress(client: s3fs.S3FileSystem) -> list[Any]:
    return list(client.list_multipart_uploads("ckpts"))


def _in_process(capsys: pytest.CaptureFixture[str], s3_endpoint: str, *argv: str) -> tuple[int, str]:
    try:
        main([*argv, "--storage-options", json.dumps(s3_options(s3_endpoint))])
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("nproc", [0, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("shards", ["5GB", "400"])
def test_out_in_s3_holds_the_local_bytes(
    nproc: int,
    shards: str,
    fsdp2_ckpt: Path,
    s3_endpoint: str,
    s3: s3fs.S3FileSystem,
    tmp_path: Path,
) -> None:
    local = tmp_path / "local"
    flags = ("--max-shard-size", shards, "--fp32", "A_log$")
    assert ckptconv("dcp-to-hf", str(fsdp2_ckpt), str(local), *flags, "-q").returncode == 0
    key = f"out-{nproc}-{shards}"
    options = json.dumps(s3_options(s3_endpoint))
    proc = ckptconv(
        "dcp-to-hf", str(fsdp2_ckpt), f"s3://ckpts/{key}", *flags, "--storage-options", options, nproc=nproc
    )
    assert proc.returncode == 0, proc.stderr
    assert _objects(s3, key) == tree_sha256(local)
    assert _uploads_in_progress(s3) == []


@pytest.fixture(scope="module")
def big_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 fp32 tensors of 47 MiB: bf16 files of 23 MiB, large enough for pieces of S3's 5 MiB parts."""
    return random_dcp(tmp_path_factory.mktemp("big") / "ckpt", 3)


@pytest.mark.slow
def test_ranks_upload_parts_of_one_object(
    big_ckpt: Path, s3_endpoint: str, s3: s3fs.S3FileSystem, tmp_path: Path
) -> None:
    """Tensor-level parallel writing in S3: the middle file is cut between the 2 ranks, each uploading its
    parts of the one multipart upload that rank 0 completes (its ETag counts 2 parts); the bytes are the
    local conversion's, and --verify reads them back on both ranks."""
    local = tmp_path / "local"
    assert ckptconv("dcp-to-hf", str(big_ckpt), str(local), "--max-shard-size", "30MB", "-q").returncode == 0
    options = json.dumps(s3_options(s3_endpoint))
    argv = (
        "dcp-to-hf",
        str(big_ckpt),
        "s3://ckpts/parallel",
        "--max-shard-size",
        "30MB",
        "--json",
        "--verify",
    )
    proc = ckptconv(*argv, "--storage-options", options, nproc=2)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["verified"] is True  # both ranks read the objects back
    written = [r["bytes_written"] for r in report["ranks"]]
    assert min(written) > 30 << 20 and sum(written) == sum(
        f.stat().st_size for f in local.glob("*.safetensors")
    )
    assert _objects(s3, "parallel") == tree_sha256(local)
    etags = {p.rsplit("/", 1)[1]: s3.info(p)["ETag"].strip('"') for p in s3.find("ckpts/parallel")}
    assert etags["model-00002-of-00003.safetensors"].endswith("-2")  # one part from each rank
    assert _uploads_in_progress(s3) == []


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_one_rank_refused_midway_leaves_nothing(
    rank: int, big_ckpt: Path, s3_endpoint: str, s3: s3fs.S3FileSystem
) -> None:
    """On 2 ranks uploading parts of the same objects, the store refuses one rank's writes after its first
    part: one error line for the job, no object and no unfinished multipart upload left."""
    options = json.dumps(s3_options(s3_endpoint))
    url = f"s3://ckpts/refused-{rank}"
    argv = ("dcp-to-hf", str(big_ckpt), url, "--max-shard-size", "30MB", "--storage-options", options)
    proc = torchrun(2, str(WORKERS / "failing_s3.py"), str(rank), "1", *argv, check=False)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ckptconv: error:")]
    assert len(errors) == 1 and url in errors[0] and "cannot write" in errors[0], proc.stderr
    assert not re.search(r'File ".*/ckptconv/(\w+/)?\w+\.py"', proc.stderr)  # torchrun's frames only
    assert _objects(s3, f"refused-{rank}") == {} and _uploads_in_progress(s3) == []


def test_fp8_release_in_s3(
    fsdp2_ckpt: Path,
    s3_endpoint: str,
    s3: s3fs.S3FileSystem,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    """--quantize fp8 into S3: each weight's scale lies before it in the file but is written after it
    (the part holding it goes up last); the bytes are the local release's."""
    flags = ("--max-shard-size", "400", "--quantize", "fp8", "-q")
    local = tmp_path / "local"
    assert ckptconv("dcp-to-hf", str(fsdp2_ckpt), str(local), *flags).returncode == 0
    assert any(
        "scale_inv" in k
        for k in json.loads((local / "model.safetensors.index.json").read_text())["weight_map"]
    )
    assert _in_process(capsys, s3_endpoint, "dcp-to-hf", str(fsdp2_ckpt), "s3://ckpts/fp8", *flags)[0] == 0
    assert _objects(s3, "fp8") == tree_sha256(local)


def test_completing_object_is_last(
    fsdp2_ckpt: Path,
    s3_endpoint: str,
    s3: s3fs.S3FileSystem,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Data objects, then ckptconv_state.json, then the index (sharded) or the single file: the order in
    which the store completes them, recorded at s3fs's boundary."""
    done: list[str] = []
    call, put_file = s3fs.S3FileSystem.call_s3, s3fs.S3FileSystem.put_file

    def record_call(self: Any, method: str, *args: Any, **kw: Any) -> Any:
        result = call(self, method, *args, **kw)
        if method == "complete_multipart_upload":
            done.append(kw["Key"].rsplit("/", 1)[1])
        return result

    def record_put(self: Any, lpath: str, rpath: str, **kw: Any) -> None:
        put_file(self, lpath, rpath, **kw)
        done.append(rpath.rsplit("/", 1)[1])

    monkeypatch.setattr(s3fs.S3FileSystem, "call_s3", record_call)
    monkeypatch.setattr(s3fs.S3FileSystem, "put_file", record_put)
    s3fs.S3FileSystem.clear_instance_cache()  # a new instance binds the recorder into its sync `put_file`
    for shards, last in (("400", "model.safetensors.index.json"), ("5GB", "model.safetensors")):
        done.clear()
        argv = ("dcp-to-hf", str(fsdp2_ckpt), f"s3://ckpts/order-{shards}", "--max-shard-size", shards)
        assert _in_process(capsys, s3_endpoint, *argv, "-q")[0] == 0
        done[:] = [n for i, n in enumerate(done) if i == 0 or done[i - 1] != n]  # put_file nests a put_file
        assert done[-1] == last and done.count(last) == 1
        assert done[-2] == "ckptconv_state.json"
        shards = {n for n in _objects(s3, f"order-{shards}") if n.startswith("model-")}
        assert set(done[:-2]) == shards


def _failing_parts(monkeypatch: pytest.MonkeyPatch, after: int) -> None:
    """The store refuses every write after the first `after` (parts, whole puts, completions): s3fs sees
    what a failing server gives it, an OSError for the request. Both of s3fs's request paths: its file
    objects' (sync) and its file system's (async)."""
    from workers.failing_s3 import failing_calls

    failing_sync, failing_async = failing_calls(after)
    monkeypatch.setattr(s3fs.S3FileSystem, "call_s3", failing_sync)
    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", failing_async)


@pytest.mark.parametrize("after", [0, 2, 4])  # 3 shards, the stash, the index
def test_store_failing_midway_leaves_nothing(
    after: int,
    fsdp2_ckpt: Path,
    s3_endpoint: str,
    s3: s3fs.S3FileSystem,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s3.pipe_file("ckpts/neighbour-v2/keep.txt", b"another prefix")
    _failing_parts(monkeypatch, after)
    argv = ("dcp-to-hf", str(fsdp2_ckpt), "s3://ckpts/neighbour", "--max-shard-size", "400", "-q")
    code, err = _in_process(capsys, s3_endpoint, *argv)
    assert_one_line(code, err, "s3://ckpts/neighbour", "cannot write")
    monkeypatch.undo()
    assert _objects(s3, "neighbour") == {}  # no completing object, nor any other of the run
    assert _uploads_in_progress(s3) == []
    assert s3.cat_file("ckpts/neighbour-v2/keep.txt") == b"another prefix"


def test_overwrite_removes_the_completing_object_first(
    fsdp2_ckpt: Path,
    s3_endpoint: str,
    s3: s3fs.S3FileSystem,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    argv = ("dcp-to-hf", str(fsdp2_ckpt), "s3://ckpts/release", "--max-shard-size", "400", "-q")
    assert _in_process(capsys, s3_endpoint, *argv)[0] == 0
    old = _objects(s3, "release")
    code, err = _in_process(capsys, s3_endpoint, *argv)
    assert_one_line(code, err, "s3://ckpts/release", "--overwrite")
    assert _objects(s3, "release") == old
    removed: list[str] = []
    rm = s3fs.S3FileSystem._rm  # the sync `rm` of each instance wraps it

    async def record_rm(self: Any, path: Any, *args: Any, **kw: Any) -> Any:
        paths = [path] if isinstance(path, str) else path
        removed.append(",".join(sorted(p.rsplit("/", 1)[1] for p in paths)))
        return await rm(self, path, *args, **kw)

    monkeypatch.setattr(s3fs.S3FileSystem, "_rm", record_rm)
    s3fs.S3FileSystem.clear_instance_cache()  # a new instance binds the recorder into its sync `rm`
    _failing_parts(monkeypatch, 1)
    code, err = _in_process(capsys, s3_endpoint, *argv, "--overwrite")
    assert_one_line(code, err, "cannot write", "no longer holds the previous result")
    assert removed[0] == "model.safetensors.index.json"  # the old result stops looking complete first
    monkeypatch.undo()
    assert "model.safetensors.index.json" not in _objects(s3, "release") and _uploads_in_progress(s3) == []
    assert _in_process(capsys, s3_endpoint, *argv, "--overwrite")[0] == 0
    assert _objects(s3, "release") == old


@pytest.mark.parametrize("shards", ["400", "5GB"])
def test_verify_reads_the_objects_back(
    shards: str,
    fsdp2_ckpt: Path,
    s3_endpoint: str,
    s3: s3fs.S3FileSystem,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--verify with OUT in S3 compares the written objects with the source: a sharded result before its
    index is put, a one-file result once complete. A writer bug that changes one element: exit 1 naming
    the tensor, and nothing of the run is left (objects or uploads)."""
    argv = ("dcp-to-hf", str(fsdp2_ckpt), f"s3://ckpts/verified-{shards}", "--max-shard-size", shards)
    code, err = _in_process(capsys, s3_endpoint, *argv, "--verify")
    assert code == 0 and "verified: " in err, err
    from test_verify import corrupt_one_element

    corrupt_one_element(monkeypatch, "layers.0.up.weight")
    bad = ("dcp-to-hf", str(fsdp2_ckpt), f"s3://ckpts/wrong-{shards}", "--max-shard-size", shards, "--verify")
    code, err = _in_process(capsys, s3_endpoint, *bad)
    assert code == 1 and "--verify: the output differs" in err and "layers.0.up.weight" in err, err
    assert _objects(s3, f"wrong-{shards}") == {} and _uploads_in_progress(s3) == []


def test_refused_before_any_work(
    fsdp2_ckpt: Path,
    s3_endpoint: str,
    s3: s3fs.S3FileSystem,
    capsys: pytest.CaptureFixture[str],
) -> None:
    s3.pipe_file("ckpts/data/train.jsonl", b"{}")
    cases = [
        (["s3://ckpts/data"], "not a checkpoint"),
        (["s3://ckpts/new", "--push-to-hub", "org/model"], "--push-to-hub"),
    ]
    for extra, words in cases:
        code, err = _in_process(capsys, s3_endpoint, "dcp-to-hf", str(fsdp2_ckpt), *extra)
        assert_one_line(code, err, words)
    assert _objects(s3, "new") == {}
    assert list(_objects(s3, "data")) == ["train.jsonl"]


@pytest.mark.parametrize("nproc", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_hf_to_dcp_out_in_s3_loads_with_torch(
    nproc: int,
    fsdp2_ckpt: Path,
    s3_endpoint: str,
    s3: s3fs.S3FileSystem,
    tmp_path: Path,
) -> None:
    """The data files of a local hf-to-dcp, `.metadata` last, and torch's own fsspec reader loads them."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    hf, local = tmp_path / "hf", tmp_path / "dcp"
    assert ckptconv("dcp-to-hf", str(fsdp2_ckpt), str(hf), "--dtype", "fp32", "-q").returncode == 0
    assert ckptconv("hf-to-dcp", str(hf), str(local), "-q", nproc=nproc).returncode == 0
    key = f"dcp-{nproc}"
    options = json.dumps(s3_options(s3_endpoint))
    argv = ("hf-to-dcp", str(hf), f"s3://ckpts/{key}", "--storage-options", options, "--json", "--verify")
    proc = ckptconv(*argv, nproc=nproc)
    assert proc.returncode == 0, proc.stderr
    remote, expected = _objects(s3, key), tree_sha256(local)
    report = json.loads(proc.stdout)
    assert report["out"] == f"s3://ckpts/{key}" and report["written_files"] == sorted(remote)
    assert report["verified"] is True  # read back from S3
    assert set(remote) == set(expected) and ".metadata" in remote
    assert {n: h for n, h in remote.items() if n != ".metadata"} == {
        n: h for n, h in expected.items() if n != ".metadata"
    }
    keys = json.loads(ckptconv("inspect", str(local), "--json").stdout)["tensors"]
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64, "bool": torch.bool}
    mine = {t["key"]: torch.empty(t["shape"], dtype=dtypes[t["dtype"]]) for t in keys}
    theirs = {k: torch.empty_like(v) for k, v in mine.items()}
    dcp.load(mine, storage_reader=FsspecReader(f"s3://ckpts/{key}", **s3_options(s3_endpoint)), no_dist=True)
    dcp.load(theirs, checkpoint_id=str(local), no_dist=True)
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert _uploads_in_progress(s3) == []


def test_hf_to_dcp_store_failing_leaves_nothing(
    fsdp2_ckpt: Path,
    s3_endpoint: str,
    s3: s3fs.S3FileSystem,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hf = tmp_path / "hf"
    assert ckptconv("dcp-to-hf", str(fsdp2_ckpt), str(hf), "-q").returncode == 0
    for after in (0, 2):  # a data file, then `.metadata` itself
        _failing_parts(monkeypatch, after)
        code, err = _in_process(capsys, s3_endpoint, "hf-to-dcp", str(hf), "s3://ckpts/dcp-fail", "-q")
        monkeypatch.undo()
        assert_one_line(code, err, "s3://ckpts/dcp-fail", "cannot write")
        assert _objects(s3, "dcp-fail") == {} and _uploads_in_progress(s3) == []
