"""The torch.save records hf-to-dcp writes: byte-identical to torch.save, valid zips, loaded by dcp.load."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptconv.formats import dcp_writer
from ckptconv.formats.byte_views import byte_view
from ckptconv.formats.torch_record import data_pkl, record_size, write_tensor_record

DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.uint16,
    torch.uint32,
    torch.uint64,
]
SHAPES = [(), (0,), (1,), (5,), (3, 4), (2, 0, 3), (2, 3, 4, 5), (70, 3)]


def _values(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(shape) + dtype.itemsize)
    raw = torch.randint(0, 256, (torch.Size(shape).numel() * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def _slabs(t: torch.Tensor, n: int) -> list[memoryview]:
    view = byte_view(t)
    if not len(view):
        return []
    step = max(1, len(view) // n)
    return [view[i : i + step] for i in range(0, len(view), step)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_record_is_torch_save_byte_for_byte(dtype: torch.dtype) -> None:
    for shape in SHAPES:
        t = _values(shape, dtype)
        buf = io.BytesIO()
        torch.save(t, buf)
        expected = buf.getvalue()
        sid = zipfile.ZipFile(io.BytesIO(expected)).read("archive/.data/serialization_id")
        for pieces in (1, 3):  # however the bytes arrive, the record is the same
            out = io.BytesIO()
            out.write(b"x" * 7)  # records start anywhere in a .distcp file
            n = write_tensor_record(out, dtype, shape, _slabs(t, pieces), serialization_id=sid)
            assert n == len(expected) and out.getvalue()[7:] == expected, (dtype, shape, pieces)


def test_default_serialization_id_is_deterministic_and_crcs_check() -> None:
    t = _values((33, 5), torch.bfloat16)
    a, b = io.BytesIO(), io.BytesIO()
    write_tensor_record(a, t.dtype, tuple(t.shape), _slabs(t, 4))
    write_tensor_record(b, t.dtype, tuple(t.shape), _slabs(t, 1))
    assert a.getvalue() == b.getvalue()
    archive = zipfile.ZipFile(io.BytesIO(a.getvalue()))
    assert archive.testzip() is None  # every entry's CRC-32 is right
    back = torch.load(io.BytesIO(a.getvalue()), weights_only=True)
    assert back.dtype == t.dtype and torch.equal(back.view(torch.int16), t.view(torch.int16))


def test_wrong_byte_count_is_refused() -> None:
    with pytest.raises(ValueError, match="got 20 bytes, expected 24"):
        write_tensor_record(io.BytesIO(), torch.float32, (2, 3), [b"\0" * 20])


def test_data_pkl_matches_torch_for_views_of_new_tensors() -> None:
    t = torch.arange(12.0).reshape(3, 4)
    buf = io.BytesIO()
    torch.save(t, buf)
    assert zipfile.ZipFile(io.BytesIO(buf.getvalue())).read("archive/data.pkl") == data_pkl(t.dtype, (3, 4))


def test_write_dcp_loads_with_dcp_load_both_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One process: small tensors through the streamed records, one through torch.save (the >= 4 GiB path),
    in slabs of a few rows; dcp.load gets every value back bit for bit, and the non-tensor items too."""
    full = {
        "emb": _values((37, 8), torch.bfloat16),
        "big": _values((9, 4), torch.float32),
        "scalar": _values((), torch.float32),
        "empty": _values((0, 3), torch.float16),
        "ids": _values((5,), torch.int64),
        "mask": _values((6,), torch.bool),
    }
    monkeypatch.setattr(dcp_writer, "SLAB_BYTES", 40)
    monkeypatch.setattr(dcp_writer, "fast_path", lambda nbytes: nbytes != full["big"].numel() * 4)
    state = {"model": {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in full.items()}}
    state["step"] = 7  # type: ignore[assignment]
    raw = io.BytesIO()
    torch.save({"lr": 0.5}, raw)
    state["args"] = raw.getvalue()  # type: ignore[assignment]  # a stashed item restored byte for byte
    reads: list[tuple[str, int, int]] = []

    def read_rows(fqn: str, lo: int, hi: int, scratch: torch.Tensor | None) -> torch.Tensor:
        reads.append((fqn, lo, hi))
        key = fqn.split(".", 1)[1]
        return full[key].clone() if not full[key].shape else full[key][lo:hi].clone()

    dcp_writer.write_dcp(tmp_path / "out", state, read_rows, {"args": raw.getvalue()})
    assert max(hi - lo for fqn, lo, hi in reads if fqn == "model.emb") == 2  # 40-byte slabs of 16-byte rows
    back = {"model": {k: torch.zeros_like(v) for k, v in full.items()}, "step": 0, "args": None}
    dcp.load(back, checkpoint_id=str(tmp_path / "out"), no_dist=True)
    for key, value in full.items():
        assert bytes(byte_view(back["model"][key])) == bytes(byte_view(value)), key
    assert back["step"] == 7 and back["args"] == {"lr": 0.5}
    for f in (tmp_path / "out").glob("*.distcp"):
        assert f.stat().st_size > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_record_size_is_the_written_length(dtype: torch.dtype) -> None:
    """What --resume in object storage computes a kept file's layout from: the length of a tensor's record
    without its bytes, for every dtype and shape, equal to the record written from any values."""
    for shape in SHAPES:
        t = _values(shape, dtype)
        out = io.BytesIO()
        written = write_tensor_record(out, dtype, shape, _slabs(t, 3))
        assert record_size(dtype, shape) == written == len(out.getvalue()), shape
