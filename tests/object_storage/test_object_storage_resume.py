"""`--resume` into S3 (moto's server): a dcp-to-hf run interrupted after its first part leaves its uploads,
their parts and its record under OUT and says so; a plain rerun is refused with one line naming --resume;
changed options are refused; `--resume` keeps the part and the objects already there (sends fewer bytes)
and publishes exactly the local conversion's bytes, with no upload left in progress and no record;
`--overwrite` over an interrupted run aborts its uploads. On 2 ranks (slow): rank 1 SIGKILLed once each
rank sent a part, resumed at 2 ranks and, from a second interrupted run, at 1."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import ckptconv, random_dcp, s3_options, tree_sha256
from test_bad_input import assert_one_line
from test_resume import _stopped

from ckptconv.cli.app import main
from ckptconv.publish import multipart
from ckptconv.publish.remote_resume import RECORD

s3fs = pytest.importorskip("s3fs", reason="the [s3] extra (s3fs) is part of the test extras")

ARGS = ("--max-shard-size", "30MB")


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 fp32 tensors of 47 MiB: 3 bf16 files of 23 MiB, one part each on one rank, cut between 2 ranks."""
    return random_dcp(tmp_path_factory.mktemp("resume-s3") / "ckpt", 3, seed=7)


@pytest.fixture(scope="module")
def local(src: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("resume-local") / "out"
    assert ckptconv("dcp-to-hf", str(src), str(out), *ARGS, "-q").returncode == 0
    return tree_sha256(out)


def _objects(s3: Any, key: str) -> dict[str, str]:
    import hashlib

    s3.invalidate_cache()
    return {
        p.rsplit("/", 1)[1]: hashlib.sha256(s3.cat_file(p)).hexdigest()
        for p in s3.find(f"ckpts/{key}")
        if not p.rsplit("/", 1)[1].startswith(".")
    }


def _uploads(s3: Any, key: str) -> list[Any]:
    reply = s3.call_s3("list_multipart_uploads", Bucket="ckpts", Prefix=f"{key}/")
    return reply.get("Uploads", [])


def _run(capsys: pytest.CaptureFixture[str], endpoint: str, *argv: str) -> tuple[int, str, str]:
    try:
        main([*argv, "--storage-options", json.dumps(s3_options(endpoint))])
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def _interrupted_after_one_part(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next run is interrupted (as by Ctrl-C) when it is about to send its second part."""
    send = multipart.PartStream._send
    sent: list[int] = []

    def once(self: multipart.PartStream, number: int, buf: bytearray) -> None:
        if sent:
            raise KeyboardInterrupt
        send(self, number, buf)
        sent.append(number)

    monkeypatch.setattr(multipart.PartStream, "_send", once)


@pytest.mark.parametrize("extra", [(), ("--write-granularity", "file"), ("--quantize", "fp8")])
def test_an_interrupted_run_resumes_in_s3_to_the_local_bytes(
    extra: tuple[str, ...],
    src: Path,
    tmp_path: Path,
    s3_endpoint: str,
    s3: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    args, key = (*ARGS, *extra), "resumed" + "".join(extra).replace("-", "")
    url = f"s3://ckpts/{key}"
    local = tmp_path / "local"
    assert ckptconv("dcp-to-hf", str(src), str(local), *args, "-q").returncode == 0
    with monkeypatch.context() as m:
        _interrupted_after_one_part(m)
        code, _, err = _run(capsys, s3_endpoint, "dcp-to-hf", str(src), url, *args)
    assert code != 0 and "rerun with --resume to send only the rest" in err, err
    s3.invalidate_cache()
    assert s3.exists(f"ckpts/{key}/{RECORD}")
    assert not s3.exists(f"ckpts/{key}/model.safetensors.index.json")
    uploads = _uploads(s3, key)
    assert len(uploads) == 3  # one per file, the first with its part
    sent = [s3.call_s3("list_parts", Bucket="ckpts", Key=u["Key"], UploadId=u["UploadId"]) for u in uploads]
    assert sum(len(p.get("Parts", [])) for p in sent) == 1

    # without --resume: one line naming it, nothing changed
    code, _, err = _run(capsys, s3_endpoint, "dcp-to-hf", str(src), url, *args)
    assert_one_line(code, err, url, "interrupted run", "--resume", "--overwrite")
    # another --dtype: the options changed; nothing changed
    code, _, err = _run(capsys, s3_endpoint, "dcp-to-hf", str(src), url, *args, "--resume", "--dtype", "fp16")
    assert_one_line(code, err, url, "the options changed", "--overwrite")
    assert len(_uploads(s3, key)) == 3

    full = sum(p.stat().st_size for p in local.glob("*.safetensors"))
    code, out, err = _run(capsys, s3_endpoint, "dcp-to-hf", str(src), url, *args, "--resume", "--json")
    assert code == 0, err
    report = json.loads(out)
    written = sum(r["bytes_written"] for r in report["ranks"])
    assert written <= full - (10 << 20)  # the part kept (a whole file's: 12 or 23 MiB) was not sent again
    assert _objects(s3, key) == tree_sha256(local)
    assert _uploads(s3, key) == [] and not s3.exists(f"ckpts/{key}/{RECORD}")

    # a complete result: --resume has nothing to resume (one line), and leaves it as it is
    code, _, err = _run(capsys, s3_endpoint, "dcp-to-hf", str(src), url, *args, "--resume")
    assert_one_line(code, err, url, "nothing to resume", "--overwrite")
    assert _objects(s3, key) == tree_sha256(local)


def test_overwrite_over_an_interrupted_run_aborts_its_uploads(
    src: Path,
    local: dict[str, str],
    s3_endpoint: str,
    s3: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = "s3://ckpts/restarted"
    with monkeypatch.context() as m:
        _interrupted_after_one_part(m)
        code, _, err = _run(capsys, s3_endpoint, "dcp-to-hf", str(src), url, *ARGS)
    assert code != 0 and len(_uploads(s3, "restarted")) == 3
    key = _uploads(s3, "restarted")[0]["Key"]
    s3.call_s3("create_multipart_upload", Bucket="ckpts", Key=key)  # a second one on that key: aborted too
    code, _, err = _run(capsys, s3_endpoint, "dcp-to-hf", str(src), url, *ARGS, "--overwrite")
    assert code == 0, err
    assert _objects(s3, "restarted") == local and _uploads(s3, "restarted") == []
    assert not s3.exists(f"ckpts/restarted/{RECORD}")


@pytest.mark.slow
def test_a_killed_rank_resumes_in_s3_at_2_ranks_and_at_1(
    src: Path, local: dict[str, str], s3_endpoint: str, s3: Any, tmp_path: Path
) -> None:
    """Rank 1 SIGKILLed once each of 2 ranks sent a part: the parts stay in S3; --resume at 2 ranks sends
    fewer bytes and publishes the local bytes. torchrun SIGTERMed the same way: --resume at 1 rank (parts
    are cut by ranks: its uploads are aborted and its files sent again, objects kept) publishes them too."""
    options = json.dumps(s3_options(s3_endpoint))
    full = 3 * 3000 * 4096 * 2
    for key, how, nproc in (("killed", "kill", 2), ("termed", "term", 0)):
        url = f"s3://ckpts/{key}"
        _stopped(src, url, tmp_path / f"pause-{key}", how, ("dcp-to-hf", *ARGS, "--storage-options", options))
        assert _uploads(s3, key) and s3.exists(f"ckpts/{key}/{RECORD}")
        argv = ("dcp-to-hf", str(src), url, *ARGS, "--resume", "--json", "--storage-options", options)
        proc = ckptconv(*argv, nproc=nproc)
        assert proc.returncode == 0, proc.stderr
        written = sum(r["bytes_written"] for r in json.loads(proc.stdout)["ranks"])
        assert written < full if nproc == 2 else written <= full + 1024, (written, proc.stderr)
        assert _objects(s3, key) == local
        assert _uploads(s3, key) == [] and not s3.exists(f"ckpts/{key}/{RECORD}")


@pytest.mark.slow
def test_a_killed_rank_resumes_a_quantized_release_written_by_file(
    s3_endpoint: str, s3: Any, tmp_path: Path
) -> None:
    """--quantize fp8 into S3 writes each file from one rank (a weight's scale lies apart from it): rank 1
    SIGKILLed once each rank sent a part of its file; --resume at 2 ranks keeps them and publishes the
    local bytes (3 weights quantized, each file a weight and its scale)."""
    import torch
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(3)
    state = {"model": {f"layers.{i}.proj.weight": torch.randn(3072, 4096, generator=g) for i in range(3)}}
    src = tmp_path / "src"
    dcp.save(state, checkpoint_id=str(src), no_dist=True)
    args = ("--max-shard-size", "15MB", "--quantize", "fp8")
    local = tmp_path / "local"
    assert ckptconv("dcp-to-hf", str(src), str(local), *args, "-q").returncode == 0
    weight_map = json.loads((local / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) == 3 and sum(k.endswith("_scale_inv") for k in weight_map) == 3
    options = json.dumps(s3_options(s3_endpoint))
    url = "s3://ckpts/quantized"
    _stopped(src, url, tmp_path / "pause", "kill", ("dcp-to-hf", *args, "--storage-options", options))
    uploads = _uploads(s3, "quantized")
    assert len(uploads) == 3 and s3.exists(f"ckpts/quantized/{RECORD}")
    argv = ("dcp-to-hf", str(src), url, *args, "--resume", "--json", "--storage-options", options)
    proc = ckptconv(*argv, nproc=2)
    assert proc.returncode == 0, proc.stderr
    written = sum(r["bytes_written"] for r in json.loads(proc.stdout)["ranks"])
    full = sum(p.stat().st_size for p in local.glob("*.safetensors"))
    assert written <= full - (20 << 20), (written, full)  # a whole file's part kept from each rank
    assert _objects(s3, "quantized") == tree_sha256(local)
    assert _uploads(s3, "quantized") == [] and not s3.exists(f"ckpts/quantized/{RECORD}")
