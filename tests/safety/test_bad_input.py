"""Every bad input: exit 2, one line naming the path or flag and the fix, no traceback, nothing written."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from conftest import ckptconv

from ckptconv.cli.app import main
from ckptconv.errors import CkptconvError
from ckptconv.formats.dcp import open_dcp
from ckptconv.formats.dcp_reader import DcpReader


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    try:
        main(list(argv))
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


def assert_one_line(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    lines = [line for line in err.strip().splitlines() if line.startswith("ckptconv: error: ")]
    assert len(lines) == 1 and err.strip().splitlines()[-1] == lines[0], err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, err)


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


class Payload:
    """Pickles into a call of os.system: loading it would create the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--dtype", "int4"], ["--dtype", "int4"]),
        (["--fp32", "A_log(["], ["--fp32", "A_log(["]),
        (["--max-shard-size", "5 parsecs"], ["--max-shard-size"]),
        (["--max-shard-size", "0"], ["--max-shard-size"]),
        (["--read", "teleport"], ["--read"]),
        (["--prefix", "nothing."], ["--prefix", "keys start with"]),
    ],
)
def test_bad_flags(
    fsdp2_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], args, needles
) -> None:
    out = tmp_path / "out"
    code, err = run(capsys, "dcp-to-hf", str(fsdp2_ckpt), str(out), *args)
    assert_one_line(code, err, *needles)
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_bad_sources(fsdp2_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    code, err = run(capsys, "dcp-to-hf", str(tmp_path / "missing"), str(out))
    assert_one_line(code, err, "missing", "no such file")
    empty = tmp_path / "empty"
    empty.mkdir()
    code, err = run(capsys, "dcp-to-hf", str(empty), str(out))
    assert_one_line(code, err, "empty", ".metadata")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors").write_bytes(b"x")
    code, err = run(capsys, "dcp-to-hf", str(hf), str(out))
    assert_one_line(code, err, "hf-to-dcp")
    assert not out.exists()


def test_truncated_distcp(fsdp2_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = copy_ckpt(fsdp2_ckpt, tmp_path / "ckpt")
    victim = ckpt / "__1_0.distcp"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    code, err = run(capsys, "dcp-to-hf", str(ckpt), str(tmp_path / "out"))
    assert_one_line(code, err, "__1_0.distcp", "truncated")
    assert not (tmp_path / "out").exists()


def test_corrupt_chunk_bytes(fsdp2_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = copy_ckpt(fsdp2_ckpt, tmp_path / "ckpt")
    victim = ckpt / "__0_0.distcp"
    victim.write_bytes(b"\0" * victim.stat().st_size)  # same size, no zip records left
    code, err = run(capsys, "dcp-to-hf", str(ckpt), str(tmp_path / "out"))
    assert_one_line(code, err, "__0_0.distcp")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


@pytest.mark.parametrize("read", ["direct", "gather"])
def test_flipped_data_byte_fails_the_crc_check(
    fsdp2_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], read: str
) -> None:
    ckpt = copy_ckpt(fsdp2_ckpt, tmp_path / "ckpt")
    spec = open_dcp(ckpt).tensors["model.embed.weight"]
    chunk = spec.chunks[0]
    with DcpReader(open_dcp(ckpt)) as reader:
        where = reader.locate(spec, chunk)
    assert where is not None
    raw = bytearray((ckpt / chunk.file).read_bytes())
    raw[where + 5] ^= 0x10  # one bit of one stored value
    (ckpt / chunk.file).write_bytes(bytes(raw))
    code, err = run(capsys, "dcp-to-hf", str(ckpt), str(tmp_path / "out"), "--read", read)
    assert_one_line(code, err, chunk.file, "'model.embed.weight'", "fails its CRC-32 check")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["junk", "truncated", "empty"])
def test_bad_metadata(
    fsdp2_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    ckpt = copy_ckpt(fsdp2_ckpt, tmp_path / "ckpt")
    md = ckpt / ".metadata"
    data = md.read_bytes()
    md.write_bytes(
        {"junk": b"not a pickle at all", "truncated": data[: len(data) // 2], "empty": b""}[damage]
    )
    for command in (["dcp-to-hf", str(ckpt), str(tmp_path / "out")], ["inspect", str(ckpt)]):
        code, err = run(capsys, *command)
        assert_one_line(code, err, ".metadata")
    assert not (tmp_path / "out").exists()


def test_pickle_payload_in_metadata_never_runs(fsdp2_ckpt: Path, tmp_path: Path) -> None:
    ckpt = copy_ckpt(fsdp2_ckpt, tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    (ckpt / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    for command in (
        ["dcp-to-hf", str(ckpt), str(tmp_path / "out")],
        ["inspect", str(ckpt)],
        ["verify", str(ckpt), str(fsdp2_ckpt)],
        ["verify", str(fsdp2_ckpt), str(ckpt)],
    ):
        proc = ckptconv(*command)  # a real process: nothing may run, no traceback
        assert_one_line(proc.returncode, proc.stderr, "posix.system", "refusing")
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_pickle_payload_in_a_non_tensor_item_never_runs(tmp_path: Path) -> None:
    """A saved item whose unpickling would run os.system: dcp-to-hf keeps its bytes without loading them,
    hf-to-dcp writes them back verbatim, inspect and verify never load them."""
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "pwned"
    ckpt = tmp_path / "ckpt"
    dcp.save({"model": {"w": torch.ones(3)}, "evil": Payload(marker)}, checkpoint_id=str(ckpt), no_dist=True)
    assert not marker.exists()
    for command in (
        ["dcp-to-hf", str(ckpt), str(tmp_path / "hf")],
        ["inspect", str(ckpt)],
        ["hf-to-dcp", str(tmp_path / "hf"), str(tmp_path / "back")],
        ["verify", str(ckpt), str(tmp_path / "back")],
        ["inspect", str(tmp_path / "back")],
    ):
        proc = ckptconv(*command)
        assert proc.returncode == 0, (command, proc.stderr)
        assert "Traceback" not in proc.stderr
    assert not marker.exists()
    stash = json.loads((tmp_path / "hf" / "ckptconv_state.json").read_text())["items"]
    assert [i["key"] for i in stash] == ["evil"] and "posix.system" in stash[0]["not_loaded"]
    original = open_dcp(ckpt)
    back = open_dcp(tmp_path / "back")
    with DcpReader(original) as a, DcpReader(back) as b:
        assert a.load_item(original.items["evil"])[0] == b.load_item(back.items["evil"])[0]
    assert not marker.exists()


def test_out_is_a_file_or_not_empty(
    fsdp2_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    as_file = tmp_path / "file"
    as_file.write_text("keep me")
    code, err = run(capsys, "dcp-to-hf", str(fsdp2_ckpt), str(as_file))
    assert_one_line(code, err, str(as_file), "not a directory")
    assert as_file.read_text() == "keep me"
    full = tmp_path / "full"
    full.mkdir()
    (full / "model-00001-of-00009.safetensors").write_text("old")
    code, err = run(capsys, "dcp-to-hf", str(fsdp2_ckpt), str(full))
    assert_one_line(code, err, str(full), "--overwrite")
    assert [p.name for p in full.iterdir()] == ["model-00001-of-00009.safetensors"]
    code, err = run(capsys, "dcp-to-hf", str(fsdp2_ckpt), str(full), "--overwrite", "--quiet")
    assert code == 0, err
    assert sorted(p.name for p in full.iterdir()) == ["ckptconv_state.json", "model.safetensors"]
    assert not list(tmp_path.glob(".full*"))


def test_hole_in_chunks_is_refused(
    fsdp2_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch.distributed.checkpoint as dcp_api
    from torch.distributed.checkpoint import FileSystemReader

    ckpt = copy_ckpt(fsdp2_ckpt, tmp_path / "ckpt")
    metadata = FileSystemReader(str(ckpt)).read_metadata()
    entry = metadata.state_dict_metadata["model.layers.0.up.weight"]
    assert isinstance(entry, dcp_api.metadata.TensorStorageMetadata)
    entry.chunks.pop()  # the last rows are no longer stored anywhere
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    code, err = run(capsys, "dcp-to-hf", str(ckpt), str(tmp_path / "out"))
    assert_one_line(code, err, "model.layers.0.up.weight", "hole")


@pytest.mark.parametrize("url", ["s3://bucket/ckpt", "gs://bucket/a/b", "hf://org/model", "abfs://c@a/x"])
def test_object_storage_urls_are_refused_by_name_and_never_written_locally(
    url: str,
    fsdp2_ckpt: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A URL is never taken for a local directory (`./s3:/bucket/ckpt`, then exit 0): where ckptconv does not
    take one yet, exit 2 naming it; where ckptconv reads or writes one (test_object_storage*) and the
    backend is not installed, exit 2 naming the extra that installs it."""
    monkeypatch.chdir(tmp_path)
    hf = tmp_path / "hf"
    assert run(capsys, "dcp-to-hf", str(fsdp2_ckpt), str(hf), "--quiet")[0] == 0
    cases = [
        (["dcp-to-hf", str(fsdp2_ckpt), "out", "--copy-from", url], f"--copy-from {url}", "object storage"),
        (["hf-to-dcp", str(hf), "out", "--config", url], f"--config {url}", "object storage"),
    ]
    extra = {"gs": ("gcsfs", "gcs"), "abfs": ("adlfs", "azure")}.get(url.split(":")[0])
    if extra and importlib.util.find_spec(extra[0]) is None:  # no network: only where it fails at once
        for argv in (
            ["dcp-to-hf", url, "out"],
            ["dcp-to-hf", str(fsdp2_ckpt), url],
            ["hf-to-dcp", str(hf), url],
            ["hf-to-dcp", url, "out"],
            ["inspect", url],
            ["verify", url, str(hf)],
        ):
            cases.append((argv, url, f"pip install 'ckptconv[{extra[1]}]'"))
    for argv, where, what in cases:
        code, err = run(capsys, *argv)
        assert_one_line(code, err, where, what)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no "s3:" directory, no "out"

    from ckptconv import save_hf

    with pytest.raises(CkptconvError, match="object storage"):
        save_hf({"w": torch.zeros(2)}, str(tmp_path / "out"), copy_from=url)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_metadata_claiming_a_huge_frame_is_one_line_without_allocating_it(
    fsdp2_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`.metadata` is streamed from the file: a pickle frame whose length field says 4 EiB in a 20-byte file
    is read no further than the file (the pickle is truncated), never allocated. A bytes object claiming as
    much is allocated by the C unpickler itself before it reads, which fails at once: one line too."""
    import struct

    ckpt = copy_ckpt(fsdp2_ckpt, tmp_path / "ckpt")
    md = ckpt / ".metadata"
    huge = struct.pack("<Q", 1 << 62)
    for payload, needle in (
        (b"\x80\x04\x95" + huge + b"}.", "pickle data was truncated"),
        (b"\x80\x04\x8e" + huge, "not a readable DCP metadata file"),
    ):
        md.write_bytes(payload)
        code, err = run(capsys, "inspect", str(ckpt))
        assert_one_line(code, err, ".metadata", needle)


def test_metadata_read_error_names_the_file_and_the_cause(
    fsdp2_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An I/O error while `.metadata` is streamed is a read error of that file, not "corrupt"."""
    import errno

    from ckptconv.formats import files

    def failing(self: object, n: int | None = -1) -> bytes:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(files.BoundedReader, "read", failing)
    code, err = run(capsys, "inspect", str(fsdp2_ckpt))
    assert_one_line(code, err, ".metadata", "cannot read (Input/output error)", "storage")
