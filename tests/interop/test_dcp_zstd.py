"""DCP checkpoints saved through torch's ZStandard extension (`FileSystemWriter(_extensions=[ZStandard()])`)
read as torch's own `dcp.load` reads them: each record's zstd frame decompressed, within its chunk's bytes.

The oracle is torch: `dcp.save` writes the compressed checkpoint (and an uncompressed twin of the same
state), `dcp.load` reads it back; a tiny transformers Llama's state dict (bf16 and fp32), an integer buffer
and non-tensor items. Crafted frames (a bomb, a cut one) and a descriptor torch never registers are refused,
and so are records under two frames; memory follows what a record holds, never what `.metadata` claims.
"""

from __future__ import annotations

import io
import json
import pickle
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import zstandard
from conftest import _env, _forked, _forkserver, ckptconv, make_dcp, on_path, reference, tree_sha256
from families import config
from safetensors.torch import load_file
from test_bad_input import assert_one_line, copy_ckpt, run
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from ckptconv.formats.dcp import open_dcp
from ckptconv.formats.dcp_reader import DcpReader
from ckptconv.formats.dcp_transforms import RECORD_SLACK
from ckptconv.job.limits import limit


def _state() -> dict[str, object]:
    import transformers as tf

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config("llama")).to(torch.float32)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    weights = {k: v if "norm" in k else v.to(torch.bfloat16) for k, v in weights.items()}  # bf16 and fp32
    weights["position_ids"] = torch.arange(16, dtype=torch.int64)  # an integer buffer, untouched
    return {"model": weights, "train_state": {"step": 7, "note": "tiny"}}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, object]]:
    """(the ZStandard checkpoint, its uncompressed twin, the state both hold)."""
    root = tmp_path_factory.mktemp("zstd")
    state = _state()
    dcp.save(state, storage_writer=FileSystemWriter(root / "zstd", _extensions=[ZStandard()]), no_dist=True)
    dcp.save(state, storage_writer=FileSystemWriter(root / "plain"), no_dist=True)
    return root / "zstd", root / "plain", state


def _info(ckpt: Path, fqn: str) -> tuple[dict, object]:
    """(.metadata's storage index, as torch loads it, and the key of `fqn`'s entry)."""
    md = pickle.loads((ckpt / ".metadata").read_bytes())
    key = next(k for k in md.storage_data if k.fqn == fqn)
    return md, key


def test_release_is_the_uncompressed_release_and_what_dcp_load_reads(
    saved: tuple[Path, Path, dict[str, object]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    zstd, plain, state = saved
    for src, out in ((zstd, tmp_path / "a"), (plain, tmp_path / "b")):
        code, err = run(capsys, "dcp-to-hf", str(src), str(out), "--dtype", "keep")
        assert code == 0, err
    assert tree_sha256(tmp_path / "a") == tree_sha256(tmp_path / "b")
    # torch's own reader of the compressed checkpoint is the oracle of every value, bit for bit
    model = state["model"]
    assert isinstance(model, dict)
    loaded = {"model": {k: torch.empty_like(v) for k, v in model.items()}}
    dcp.load(loaded, checkpoint_id=str(zstd), no_dist=True)
    got = load_file(tmp_path / "a" / "model.safetensors")
    assert set(got) == set(model)
    for key, value in loaded["model"].items():
        assert got[key].dtype == value.dtype and torch.equal(
            got[key].view(-1).view(torch.uint8), value.view(-1).view(torch.uint8)
        )
    stash = json.loads((tmp_path / "a" / "ckptconv_state.json").read_text())
    assert {e["key"]: e.get("value") for e in stash["items"]} == {
        "train_state.step": 7,
        "train_state.note": "tiny",
    }


def test_inspect_says_compressed_and_verify_reads_it(
    saved: tuple[Path, Path, dict[str, object]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    zstd = saved[0]
    proc = ckptconv("inspect", str(zstd), "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["transforms"] == ["stream.zstd/1"] and report["serialization"] == ["torch_save"]
    text = ckptconv("inspect", str(zstd))
    assert "ZStandard-compressed (stream.zstd/1)" in text.stdout, text.stdout + text.stderr
    release = tmp_path / "rel"
    code, err = run(capsys, "dcp-to-hf", str(zstd), str(release), "--dtype", "keep")
    assert code == 0, err
    code, err = run(capsys, "verify", str(zstd), str(release))
    assert code == 0, err


def _point(ckpt: Path, fqn: str, frame: bytes) -> None:
    """Append `frame` to `fqn`'s file and point its storage entry at it."""
    md, key = _info(ckpt, fqn)
    info = md.storage_data[key]
    path = ckpt / info.relative_path
    info.offset, info.length = path.stat().st_size, len(frame)
    with path.open("ab") as f:
        f.write(frame)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))


FQN = "model.model.embed_tokens.weight"


def test_a_bomb_and_a_cut_frame_are_refused_naming_the_file(
    saved: tuple[Path, Path, dict[str, object]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    zstd, plain, state = saved
    model = state["model"]
    assert isinstance(model, dict)
    nbytes = model["model.embed_tokens.weight"].nbytes
    bomb = copy_ckpt(zstd, tmp_path / "bomb")
    _point(bomb, FQN, zstandard.ZstdCompressor().compress(bytes(nbytes + RECORD_SLACK + (64 << 20))))
    cut = copy_ckpt(zstd, tmp_path / "cut")
    md, key = _info(cut, FQN)
    info = md.storage_data[key]
    whole = (cut / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
    _point(cut, FQN, whole[: len(whole) // 2])
    for ckpt, needle in ((bomb, "decompression bomb"), (cut, "truncated")):
        out = tmp_path / f"out-{ckpt.name}"
        code, err = run(capsys, "dcp-to-hf", str(ckpt), str(out))
        assert_one_line(code, err, needle, str(ckpt / info.relative_path))
        assert not out.exists()
        code, err = run(capsys, "verify", str(ckpt), str(plain))
        assert_one_line(code, err, needle, str(ckpt / info.relative_path))


@pytest.mark.parametrize("descriptor", ["stream.xor/1", "stream.zstd/2"])
def test_an_extension_ckptconv_does_not_read_is_refused_by_name(
    saved: tuple[Path, Path, dict[str, object]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    descriptor: str,
) -> None:
    ckpt = copy_ckpt(saved[0], tmp_path / "ckpt")
    md = pickle.loads((ckpt / ".metadata").read_bytes())
    for info in md.storage_data.values():
        info.transform_descriptors = [descriptor]
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    for argv in (["dcp-to-hf", str(ckpt), str(tmp_path / "out")], ["inspect", str(ckpt)]):
        code, err = run(capsys, *argv)
        assert_one_line(code, err, repr(descriptor), str(ckpt / ".metadata"))
    assert not (tmp_path / "out").exists()


def test_two_zstd_layers_are_refused_by_name(
    saved: tuple[Path, Path, dict[str, object]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each frame would multiply what a stored byte may make: one (all torch's writer makes) is read."""
    ckpt = copy_ckpt(saved[0], tmp_path / "ckpt")
    md = pickle.loads((ckpt / ".metadata").read_bytes())
    for info in md.storage_data.values():
        info.transform_descriptors = ["stream.zstd/1", "stream.zstd/1"]
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    for argv in (["dcp-to-hf", str(ckpt), str(tmp_path / "out")], ["inspect", str(ckpt)]):
        code, err = run(capsys, *argv)
        assert_one_line(code, err, "2 DCP extensions", "'stream.zstd/1'", str(ckpt / ".metadata"))
    assert not (tmp_path / "out").exists()


def _peak_growth(*args: str) -> tuple[subprocess.CompletedProcess[str], int]:
    """(ckptconv ARGS run in a fresh process, how far its peak RSS rose above its RSS at the start):
    `python -m peak_rss ARGS`, through the fork server where the tests use it (no torch import to pay)."""
    environ = _env()
    if _forked():
        proc = _forkserver[0].run("peak_rss", list(args), environ, 120)
    else:
        cmd = [sys.executable, "-m", "peak_rss", *args]
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=on_path(environ), timeout=120, stdin=subprocess.DEVNULL
        )
    assert proc.stdout.strip(), proc.stderr
    return proc, int(proc.stdout.split()[-1])


def test_a_chunk_claiming_1_gib_is_refused_without_allocating_it(
    saved: tuple[Path, Path, dict[str, object]], tmp_path: Path
) -> None:
    """.metadata claims a 1 GiB chunk whose record (within zstd's densest ratio of its stored bytes, so the
    plan lets it through) holds 128 KiB: refused by what the record holds, the process's RSS rising far
    less than the claim (by the claim, 1.3 GB in all, when the buffer was allocated at the claimed size)."""
    ckpt = copy_ckpt(saved[0], tmp_path / "ckpt")
    record = io.BytesIO()
    torch.save(torch.randn(1 << 16).to(torch.bfloat16), record)  # incompressible: ~128 KiB stored
    _point(ckpt, FQN, zstandard.ZstdCompressor(write_content_size=False).compress(record.getvalue()))
    md, key = _info(ckpt, FQN)
    claim = 1 << 29  # bf16 elements: 1 GiB
    entry = md.state_dict_metadata[FQN]
    entry.size = torch.Size([claim])
    entry.chunks = [ChunkStorageMetadata(torch.Size([0]), torch.Size([claim]))]
    md.storage_data[type(key)(FQN, torch.Size([0]), key.index)] = md.storage_data.pop(key)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    out = tmp_path / "out"
    proc, growth = _peak_growth("dcp-to-hf", str(ckpt), str(out))
    assert_one_line(proc.returncode, proc.stderr, "expected [536870912]", str(ckpt))
    assert not out.exists()
    assert growth < 128 << 20, f"peak RSS rose {growth >> 20} MiB reading a record of 128 KiB"


def test_a_non_tensor_item_is_read_without_allocating_its_limit(
    saved: tuple[Path, Path, dict[str, object]],
) -> None:
    """A compressed item may inflate to the read limit on bytes (256 MiB): what is allocated is what it
    holds (traced: a buffer of the limit, allocated and zeroed per item, was once 256 MiB of RSS each)."""
    ckpt = open_dcp(saved[0])
    item = ckpt.items["train_state.step"]
    assert limit("bytes") >= 256 << 20
    with DcpReader(ckpt) as reader:
        tracemalloc.start()
        try:
            raw, value, _ = reader.load_item(item)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert value == 7 and raw.startswith(b"PK")
    assert peak < 4 << 20, f"{peak} bytes traced reading a {len(raw)}-byte item"


@pytest.mark.slow
def test_fsdp2_zstd_release_at_1_and_2_ranks(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A 2-rank FSDP2 save through ZStandard (uneven shards, int and bool buffers, optimizer state, items):
    dcp-to-hf at 1 and 2 ranks, both read paths, writes what the uncompressed twin's release holds."""
    root = tmp_path_factory.mktemp("fsdp2zstd")
    ckpt = make_dcp(root / "ckpt", 2, "fsdp2", "zstd")
    plain = Path(str(ckpt) + ".plain")
    outs = {}
    for name, src, nproc, read in [
        ("plain", plain, 0, "direct"),
        ("1", ckpt, 0, "direct"),
        ("2", ckpt, 2, "direct"),
        ("2g", ckpt, 2, "gather"),
    ]:
        out = root / f"out-{name}"
        proc = ckptconv(
            "dcp-to-hf", str(src), str(out), "--max-shard-size", "700", "--read", read, nproc=nproc
        )
        assert proc.returncode == 0, proc.stderr
        outs[name] = tree_sha256(out)
    assert outs["1"] == outs["2"] == outs["2g"] == outs["plain"]
    ref = reference(ckpt)
    got = {}
    for f in sorted((root / "out-2").glob("*.safetensors")):
        got.update(load_file(f))
    assert set(got) == set(ref)
    assert torch.equal(got["position_ids"], ref["position_ids"]) and torch.equal(got["mask"], ref["mask"])
