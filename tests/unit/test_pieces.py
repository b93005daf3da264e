"""Tensor bytes reach local files in calls of at most `PIECE_BYTES`, and the files are the same bytes."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckptconv.formats import safetensors_io
from ckptconv.formats.byte_views import byte_view
from ckptconv.formats.pieces import PIECE_BYTES, write_pieces
from ckptconv.formats.safetensors_io import Entry, SafetensorsWriter
from ckptconv.formats.torch_record import write_tensor_record


class Recording(io.BytesIO):
    """A file that notes the length of every `write` call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []

    def write(self, data: bytes | memoryview) -> int:  # type: ignore[override]
        n = super().write(data)
        self.calls.append(n)
        return n


@pytest.mark.parametrize("nbytes", [0, 5, PIECE_BYTES, PIECE_BYTES + 1, 2 * PIECE_BYTES + PIECE_BYTES // 2])
def test_write_pieces_splits_at_piece_bytes_and_keeps_the_bytes(nbytes: int) -> None:
    data = os.urandom(nbytes)
    for given in (data, memoryview(data)):
        out = Recording()
        write_pieces(out, given)
        assert out.getvalue() == data
        assert all(n <= PIECE_BYTES for n in out.calls)
        assert len(out.calls) == -(-nbytes // PIECE_BYTES)


def test_write_pieces_takes_a_typed_view_as_its_bytes() -> None:
    t = torch.arange(PIECE_BYTES // 2, dtype=torch.float64)  # 4 MiB of doubles
    out = Recording()
    write_pieces(out, memoryview(t.numpy()))  # type: ignore[arg-type]
    assert out.getvalue() == t.numpy().tobytes() and out.calls == [PIECE_BYTES] * 4


def test_torch_record_of_a_large_tensor_is_written_in_pieces() -> None:
    t = torch.randn(3 * PIECE_BYTES // 4 + 3, dtype=torch.float32)  # 3 MiB and 12 bytes
    out = Recording()
    write_tensor_record(out, t.dtype, tuple(t.shape), [byte_view(t)])
    assert max(out.calls) == PIECE_BYTES
    back = torch.load(io.BytesIO(out.getvalue()), weights_only=True)
    assert torch.equal(back, t)


def test_safetensors_writer_pwrites_pieces_that_safetensors_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    big = torch.randn(1000, 700, dtype=torch.float32)  # 2.8 MB: three pieces
    small = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    calls: list[int] = []
    real = os.pwrite

    def pwrite(fd: int, data: memoryview, offset: int) -> int:
        calls.append(len(data))
        return real(fd, data, offset)

    monkeypatch.setattr(safetensors_io.os, "pwrite", pwrite)
    path = tmp_path / "ours.safetensors"
    entries = [Entry("big", big.dtype, tuple(big.shape)), Entry("small", small.dtype, tuple(small.shape))]
    writer = SafetensorsWriter(path, entries)
    writer.write("small", small)
    writer.write("big", big[:400], 0)  # a slab of rows, then the rest
    writer.write("big", big[400:], 400 * 700 * 4)
    writer.close()
    monkeypatch.undo()

    assert calls and max(calls) == PIECE_BYTES
    assert writer.bytes_written == path.stat().st_size
    back = load_file(path)  # safetensors' own reader
    assert torch.equal(back["big"], big) and torch.equal(back["small"], small)
    data = path.read_bytes()
    assert data.endswith(byte_view(big).tobytes() + byte_view(small).tobytes())  # in the order of entries
