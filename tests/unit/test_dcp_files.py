"""hf-to-dcp's data files: a rank's items cut into files of about --max-file-size, written a few at a time
(so an interrupted run has finished some), read back by torch's own `dcp.load`; a failure stops every
writer thread at its next slab and begins no other file."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ckptconv.errors import CkptconvError
from ckptconv.formats import dcp_writer
from ckptconv.formats.byte_views import byte_view


def _item(fqn: str, rows: int, cols: int = 1, dtype: torch.dtype = torch.float32) -> WriteItem:
    chunk = ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([rows, cols]))
    size, properties = torch.Size([rows, cols]), TensorProperties(dtype=dtype)
    data = TensorWriteData(chunk=chunk, properties=properties, size=size)
    return WriteItem(index=MetadataIndex(fqn, torch.Size([0, 0])), type=WriteItemType.SHARD, tensor_data=data)


def _bytes_item(fqn: str) -> WriteItem:
    return WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)


def test_bins_cut_a_ranks_items_into_files_of_about_the_size() -> None:
    """10 tensors of 100..1000 bytes (5,500 in all) at 1,000 bytes a file: 6 files, largest first onto the
    lightest, none over 1,000 plus its largest chunk; every item once; byte items spread round robin; never
    fewer files than writer threads, nor empty ones."""
    items = [_item(f"t{i}", 25 * (i + 1)) for i in range(10)] + [_bytes_item(f"b{i}") for i in range(3)]
    files = dcp_writer.bins(items, 2, 1000)
    assert len(files) == dcp_writer.file_count(5500, 10, 2, 1000) == 6
    assert sorted(i.index.fqn for f in files for i in f) == sorted(i.index.fqn for i in items)
    loads = [sum(dcp_writer._nbytes(i) for i in f if i.tensor_data is not None) for f in files]
    assert sum(loads) == 5500 and max(loads) <= 1000 + 1000
    assert [sum(i.tensor_data is None for i in f) for f in files] == [1, 1, 1, 0, 0, 0]
    assert len(dcp_writer.bins(items[:1], 4, 10**9)) == 1  # one item: one file, not 4 empty ones
    assert dcp_writer.file_count(5500, 10, 8, 1000) == 8
    assert dcp_writer.file_count(0, 0, 2, 1000) == 2
    assert dcp_writer.file_count(10**12, 10, 2, 1) == 10  # a file an item at most, however small the size
    assert len(dcp_writer.bins(items, 2, 1)) == 10  # the byte items spread over them


def _state(full: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {"model": {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in full.items()}}


def test_small_files_load_back_with_dcp_load(tmp_path: Path) -> None:
    """12 tensors of 4 KiB at 10,000 bytes a file: 5 files (2 threads writing them in turn) of 3, 3, 2, 2
    and 2 records (12 KiB of data at most: the size plus one chunk), and torch's dcp.load gets every value
    back bit for bit."""
    g = torch.Generator().manual_seed(1)
    full = {f"w{i}": torch.randn(32, 32, generator=g) for i in range(12)}

    def read_rows(fqn: str, lo: int, hi: int, scratch: torch.Tensor | None) -> torch.Tensor:
        return full[fqn.split(".", 1)[1]][lo:hi].clone()

    dcp_writer.write_dcp(tmp_path / "out", _state(full), read_rows, {}, file_bytes=10_000)
    files = sorted((tmp_path / "out").glob("*.distcp"))
    assert [f.name for f in files] == [f"__0_{k}.distcp" for k in range(5)]
    record = min(f.stat().st_size for f in files) // 2  # a file of 2 records: each record the same size
    assert [f.stat().st_size for f in files] == [3 * record] * 2 + [2 * record] * 3
    back = {"model": {k: torch.zeros_like(v) for k, v in full.items()}}
    dcp.load(back, checkpoint_id=str(tmp_path / "out"), no_dist=True)
    assert all(bytes(byte_view(back["model"][k])) == bytes(byte_view(v)) for k, v in full.items())


def _watched(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The writers `write_dcp` makes (a test waits on their `stop`), as they start writing."""
    writers: list[Any] = []
    real = dcp_writer._RecordWriter.write_data

    def write_data(self: Any, plan: Any, planner: Any) -> Any:
        writers.append(self)
        return real(self, plan, planner)

    monkeypatch.setattr(dcp_writer._RecordWriter, "write_data", write_data)
    return writers


def test_a_failing_file_stops_the_other_threads_and_begins_no_other_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """8 tensors of 4 MiB, one file each, 2 threads: the first file's read fails while the second file
    is being written slab by slab; the failure is raised, the second thread stops at its next slab (it
    reads no further), and the 6 files not begun are never made."""
    monkeypatch.setattr(dcp_writer, "SLAB_BYTES", 1 << 20)
    shape = (1024, 1024)
    full = {f"w{i}": torch.full(shape, float(i)) for i in range(8)}
    writers = _watched(monkeypatch)
    first: list[str] = []  # the tensor the first thread met: it fails once the other thread is reading
    reads: dict[str, int] = {}
    lock = threading.Lock()
    both = threading.Barrier(2)

    def read_rows(fqn: str, lo: int, hi: int, scratch: torch.Tensor | None) -> torch.Tensor:
        with lock:
            if not first:
                first.append(fqn)
            reads[fqn] = reads.get(fqn, 0) + 1
        if reads[fqn] == 1 and len(reads) <= 2:
            both.wait(30)  # each thread in its first file's first slab
        if fqn == first[0]:
            raise CkptconvError(f"{fqn}: cannot read (the test's failure)")
        assert writers[0].stop.wait(30), "the writer was never stopped"
        return full[fqn.split(".", 1)[1]][lo:hi].clone()

    with pytest.raises(CkptconvError, match="the test's failure"):
        dcp_writer.write_dcp(tmp_path / "out", _state(full), read_rows, {}, file_bytes=4 << 20)
    assert len(reads) == 2 and all(n == 1 for n in reads.values()), reads  # one slab each, no more
    assert len(list((tmp_path / "out").glob("*.distcp"))) <= 2  # the 6 others never begun


def test_the_failure_said_is_the_one_that_stopped_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """File 1's read fails while file 0's thread is in its first slab; file 0's thread, stopped, ends its
    future too (here before anything looks: every future waited for). The error raised is file 1's, one
    line, never the stop of a thread it caused."""
    import concurrent.futures

    monkeypatch.setattr(dcp_writer, "SLAB_BYTES", 1 << 20)
    monkeypatch.setattr(dcp_writer, "wait", lambda futures, return_when: concurrent.futures.wait(futures))
    full = {"w0": torch.zeros(2048, 1024), "w1": torch.zeros(1024, 1024)}  # file 0: w0, file 1: w1
    writers = _watched(monkeypatch)
    both = threading.Barrier(2)

    def read_rows(fqn: str, lo: int, hi: int, scratch: torch.Tensor | None) -> torch.Tensor:
        if lo == 0:
            both.wait(30)
        if fqn == "model.w1":
            raise CkptconvError(f"{fqn}: cannot read (the test's failure)")
        assert writers[0].stop.wait(30), "the writer was never stopped"
        return full[fqn.split(".", 1)[1]][lo:hi].clone()

    with pytest.raises(CkptconvError, match="the test's failure"):
        dcp_writer.write_dcp(tmp_path / "out", _state(full), read_rows, {}, file_bytes=4 << 20)
