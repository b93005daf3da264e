"""`--resume` into S3 against a hostile or unlucky OUT (moto's server, in process, a tiny checkpoint): a
record naming keys outside OUT or another prefix's upload touches nothing there; a planted part or an
object copied onto another name of the same size is not kept (the result is still the local conversion's
bytes); a malformed record is one line; a signal while the record is removed leaves the complete result; a
resumed run failing with an ordinary error stays resumable; `--overwrite` says so when it cannot abort an
upload; S3 listings that do not go on are read a bounded number of times."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from conftest import ckptconv, tree_sha256
from test_bad_input import assert_one_line
from test_object_storage_resume import _interrupted_after_one_part, _objects, _run

from ckptconv.errors import CkptconvError
from ckptconv.publish import multipart, remote_out
from ckptconv.publish import remote_resume as rr

s3fs = pytest.importorskip("s3fs", reason="the [s3] extra (s3fs) is part of the test extras")

ARGS = ("--max-shard-size", "40KB")


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 tensors of 64 x 256 fp32: 3 bf16 files of 32 KB, one part each."""
    import torch
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(3)
    path = tmp_path_factory.mktemp("hostile") / "ckpt"
    dcp.save(
        {"model": {f"layers.{i}.w": torch.randn(64, 256, generator=g) for i in range(3)}},
        checkpoint_id=str(path),
        no_dist=True,
    )
    return path


@pytest.fixture(scope="module")
def local(src: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("hostile-local") / "out"
    assert ckptconv("dcp-to-hf", str(src), str(out), *ARGS, "-q").returncode == 0
    return tree_sha256(out)


def _interrupted(m: pytest.MonkeyPatch, what: str = "complete") -> None:
    """The next run is stopped (as by Ctrl-C) when it would complete its first object ("complete"), or
    after sending its first part ("part")."""
    if what == "part":
        _interrupted_after_one_part(m)
        return

    def stop(*a: Any, **k: Any) -> None:
        raise KeyboardInterrupt

    m.setattr(multipart, "complete", stop)


def _upload(s3: Any, bucket: str, key: str) -> str:
    s3.invalidate_cache()
    if not s3.exists(bucket):
        s3.mkdir(bucket)
    up = s3.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
    s3.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=up, PartNumber=1, Body=b"x" * 100)
    return up


def _alive(s3: Any, bucket: str, key: str, up: str) -> bool:
    try:
        s3.call_s3("list_parts", Bucket=bucket, Key=key, UploadId=up)
        return True
    except FileNotFoundError:
        return False


def _edit_record(s3: Any, key: str, edit: Any) -> None:
    s3.invalidate_cache()
    record = json.loads(s3.cat_file(f"ckpts/{key}/{rr.RECORD}"))
    edit(record)
    s3.pipe_file(f"ckpts/{key}/{rr.RECORD}", json.dumps(record).encode())


def test_a_record_reaching_outside_out_touches_nothing_there(
    src: Path, local: dict[str, str], s3_endpoint: str, s3: Any, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    url = "s3://ckpts/esc"
    with monkeypatch.context() as m:
        _interrupted(m)
        assert _run(capsys, s3_endpoint, "dcp-to-hf", str(src), url, *ARGS)[0] != 0
    other = _upload(s3, "victim", "prod/model.safetensors")
    neighbour = _upload(s3, "ckpts", "esc-v2/model-00001-of-00003.safetensors")

    # names that are paths: the record is refused with one line, nothing changed
    _edit_record(s3, "esc", lambda r: r["uploads"].update({"../esc-v2/model.safetensors": neighbour}))
    code, _, err = _run(capsys, s3_endpoint, "dcp-to-hf", str(src), url, *ARGS, "--resume")
    assert_one_line(code, err, rr.RECORD, "not a record", "--overwrite")
    # a planned name with another prefix's upload id: not S3's upload of that key, so not gone on with
    _edit_record(s3, "esc", lambda r: r["uploads"].pop("../esc-v2/model.safetensors"))
    _edit_record(s3, "esc", lambda r: r["uploads"].update({"model-00001-of-00003.safetensors": neighbour}))
    code, _, err = _run(capsys, s3_endpoint, "dcp-to-hf", str(src), url, *ARGS, "--resume")
    assert code == 0, err
    assert _objects(s3, "esc") == local
    assert _alive(s3, "ckpts", "esc-v2/model-00001-of-00003.safetensors", neighbour)
    assert _alive(s3, "victim", "prod/model.safetensors", other)
    assert not s3.exists("ckpts/esc-v2/model-00001-of-00003.safetensors")


@pytest.mark.parametrize("how", ["planted part", "swapped object"])
def test_what_does_not_hold_the_planned_bytes_is_not_kept(
    how: str,
    src: Path,
    local: dict[str, str],
    s3_endpoint: str,
    s3: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: Any,
) -> None:
    key = "planted" if how == "planted part" else "swapped"
    url = f"s3://ckpts/{key}"
    with monkeypatch.context() as m:
        if how == "planted part":  # the first part sent, then replaced by zeros of its size
            _interrupted(m, "part")
        else:  # every object completed, then the first copied onto the second (same size, its metadata)
            monkeypatch.setattr(
                remote_out, "_upload_small", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt)
            )
        assert _run(capsys, s3_endpoint, "dcp-to-hf", str(src), url, *ARGS)[0] != 0
    monkeypatch.undo()
    s3.invalidate_cache()
    if how == "planted part":
        uploads = s3.call_s3("list_multipart_uploads", Bucket="ckpts", Prefix=f"{key}/")["Uploads"]
        for u in uploads:
            parts = s3.call_s3("list_parts", Bucket="ckpts", Key=u["Key"], UploadId=u["UploadId"]).get(
                "Parts", []
            )
            for p in parts:
                body = bytes(p["Size"])
                s3.call_s3(
                    "upload_part",
                    Bucket="ckpts",
                    Key=u["Key"],
                    UploadId=u["UploadId"],
                    PartNumber=p["PartNumber"],
                    Body=body,
                )
    else:
        names = sorted(n for n in s3.ls(f"ckpts/{key}") if n.endswith(".safetensors"))
        assert len(names) == 3
        s3.copy(names[0], names[1])
    code, _, err = _run(capsys, s3_endpoint, "dcp-to-hf", str(src), url, *ARGS, "--resume")
    assert code == 0, err
    assert _objects(s3, key) == local


def test_a_signal_while_the_record_goes_leaves_the_complete_result(
    src: Path, local: dict[str, str], s3_endpoint: str, s3: Any, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    from fsspec.asyn import sync_wrapper

    from ckptconv.job import signals

    real, sent = s3fs.S3FileSystem._call_s3, []

    async def late(self: Any, name: str, *args: object, **kwargs: object) -> object:
        if name == "delete_object" and rr.RECORD in str(kwargs.get("Key")) and not sent:
            sent.append(name)
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(0.5)
        return await real(self, name, *args, **kwargs)

    url = "s3://ckpts/dropcut"
    with monkeypatch.context() as m:
        m.setattr(s3fs.S3FileSystem, "_call_s3", late)
        m.setattr(s3fs.S3FileSystem, "call_s3", sync_wrapper(late))
        m.setattr(signals, "_received", [])
        code, _, err = _run(capsys, s3_endpoint, "dcp-to-hf", str(src), url, *ARGS)
    assert sent and code == 143 and "rerun with --resume" not in err, err
    assert _objects(s3, "dropcut") == local and not s3.exists(f"ckpts/dropcut/{rr.RECORD}")


def test_a_resumed_run_failing_stays_resumable(
    src: Path, local: dict[str, str], s3_endpoint: str, s3: Any, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    url = "s3://ckpts/ordfail"

    def stop(*a: Any) -> None:
        raise KeyboardInterrupt

    def refuse(*a: Any) -> None:
        raise CkptconvError("s3://ckpts/ordfail/config.json: cannot write (AccessDenied)")

    for broken in (stop, refuse):  # interrupted once every object is complete; then resumed, and failing
        with monkeypatch.context() as m:
            m.setattr(remote_out, "_upload_small", broken)
            flags = ("--resume",) if broken is refuse else ()
            assert _run(capsys, s3_endpoint, "dcp-to-hf", str(src), url, *ARGS, *flags)[0] != 0
        assert s3.exists(f"ckpts/ordfail/{rr.RECORD}")
    code, _, err = _run(capsys, s3_endpoint, "dcp-to-hf", str(src), url, *ARGS, "--resume")
    assert code == 0, err
    assert _objects(s3, "ordfail") == local


def test_overwrite_says_when_it_cannot_abort_an_upload(
    src: Path, s3_endpoint: str, s3: Any, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    url = "s3://ckpts/noabort"
    with monkeypatch.context() as m:
        _interrupted(m)
        assert _run(capsys, s3_endpoint, "dcp-to-hf", str(src), url, *ARGS)[0] != 0
    with monkeypatch.context() as m:
        m.setattr(
            multipart,
            "abort_all",
            lambda url, ids: [f"{url / n} (an unfinished multipart upload)" for n, _ in ids],
        )
        code, _, err = _run(capsys, s3_endpoint, "dcp-to-hf", str(src), url, *ARGS, "--overwrite")
    assert_one_line(code, err, "cannot abort", "abort them yourself")
    assert s3.exists(f"ckpts/noabort/{rr.RECORD}")


def test_overwrite_aborts_uploads_left_without_any_object(
    src: Path, local: dict[str, str], s3_endpoint: str, s3: Any, capsys: Any
) -> None:
    """A run killed between starting its uploads and putting its record leaves uploads and no object:
    --overwrite aborts them too."""
    orphan = _upload(s3, "ckpts", "orphaned/model-00001-of-00003.safetensors")
    argv = ("dcp-to-hf", str(src), "s3://ckpts/orphaned", *ARGS, "--overwrite")
    code, _, err = _run(capsys, s3_endpoint, *argv)
    assert code == 0, err
    assert not _alive(s3, "ckpts", "orphaned/model-00001-of-00003.safetensors", orphan)
    assert _objects(s3, "orphaned") == local


class _Stuck:
    """An S3 whose listings say there is more, without going on."""

    calls = 0

    def split_path(self, key: str) -> tuple[str, str, None]:
        bucket, _, rest = key.partition("/")
        return bucket, rest, None

    def call_s3(self, method: str, **kwargs: Any) -> dict[str, Any]:
        self.calls += 1
        if method == "list_parts":
            part = {"PartNumber": 1, "Size": 5, "ETag": '"x"'}
            return {"Parts": [part], "IsTruncated": True, "NextPartNumberMarker": kwargs["PartNumberMarker"]}
        upload = {"Key": "out/model.safetensors", "UploadId": "u"}
        return {"Uploads": [upload], "IsTruncated": True, "NextKeyMarker": "k", "NextUploadIdMarker": "u"}


def test_listings_that_do_not_go_on_are_read_a_bounded_number_of_times(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ckptconv.remote.urls import url_path

    stuck = _Stuck()
    monkeypatch.setattr(rr, "filesystem", lambda url: stuck)
    url = url_path("s3://b/out")
    assert url is not None
    assert rr._parts(url / "model.safetensors", "u") == {1: (5, '"x"')}
    assert rr.in_progress(url) == {"model.safetensors": {"u"}}
    assert stuck.calls <= 3
