"""Rank 0 reads `.metadata`, the other ranks get the checkpoint from it (formats/dcp_share.py)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from conftest import WORKERS, ckptconv, torchrun

from ckptconv.formats.dcp import open_dcp
from ckptconv.source.share import pack, unpack


def test_pack_unpack_gives_the_same_checkpoint(fsdp2_ckpt: Path, mesh2d_ckpt: Path) -> None:
    for path in (fsdp2_ckpt, mesh2d_ckpt):  # torch_save and safetensors chunk records
        ckpt = open_dcp(path)
        back = unpack(pack(ckpt))
        assert back == ckpt
        assert [type(c) for t in back.tensors.values() for c in t.chunks] == [
            type(c) for t in ckpt.tensors.values() for c in t.chunks
        ]
        assert list(back.tensors) == list(ckpt.tensors)  # the saved order is kept
        # the chunk records are made when a tensor's are first read, not before
        fresh = unpack(pack(ckpt))
        first = next(iter(fresh.tensors.values()))
        assert all(t.chunks._raw is not None for t in fresh.tensors.values())  # type: ignore[attr-defined]
        assert tuple(first.chunks) == tuple(ckpt.tensors[first.fqn].chunks)
        assert first.chunks._raw is None  # type: ignore[attr-defined]
        assert sum(t.chunks._raw is None for t in fresh.tensors.values()) == 1  # type: ignore[attr-defined]


def test_only_rank_0_reads_the_metadata(fsdp2_ckpt: Path) -> None:
    proc = torchrun(3, str(WORKERS / "shared_open.py"), str(fsdp2_ckpt))
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"same": [True, True, True]}


def test_bad_metadata_on_rank_0_stops_every_rank_with_its_message(fsdp2_ckpt: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(fsdp2_ckpt, bad)
    data = (bad / ".metadata").read_bytes()
    (bad / ".metadata").write_bytes(data[: len(data) // 2])  # truncated
    out = tmp_path / "out"
    proc = ckptconv("dcp-to-hf", str(bad), str(out), nproc=2, timeout=120)
    assert proc.returncode != 0, proc.stderr  # torchrun exits 1 when its ranks exit 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ckptconv: error:")]
    assert len(errors) == 1 and "not a readable DCP metadata file" in errors[0], proc.stderr  # once, rank 0's
    assert not re.search(r'File ".*/ckptconv/(formats/)?\w+\.py"', proc.stderr)  # torchrun's frames only
    assert not out.exists()
