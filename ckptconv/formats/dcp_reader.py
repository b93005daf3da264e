"""Reading the stored chunks and non-tensor items of a DCP checkpoint `dcp.open_dcp` described.

Each `read_chunk_into` reads exactly one stored chunk into a caller-owned tensor: straight from the file
where the record stores the raw bytes (checked against the zip entry's CRC-32 when the chunk is the whole
entry), with `torch.load(weights_only=True)` otherwise. A chunk read in pieces (some rows at a time) is
checked by `check_pieces` from the pieces' CRC-32s, gathered from every rank that read some.
"""

from __future__ import annotations

import io
import os
import struct
import threading
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ckptconv.core.crc32 import crc32
from ckptconv.core.specs import ChunkSpec, DcpCheckpoint, NonTensorItem, StoredTensor, TensorSpec
from ckptconv.errors import CkptconvError
from ckptconv.formats import dcp_transforms as zt
from ckptconv.formats.byte_views import Window, byte_view
from ckptconv.formats.dcp_pieces import RowPiece, crc_error
from ckptconv.formats.files import check_unchanged, open_regular, pread_exact, read_error
from ckptconv.formats.hf import MAX_HEADER_BYTES, header_tensors, parse_header
from ckptconv.formats.items import load_item
from ckptconv.formats.torch_record import MAX_RECORD_PICKLE, TensorRecord, read_tensor_record
from ckptconv.formats.torch_zip import TorchZip
from ckptconv.job.limits import Budget, limit
from ckptconv.remote.files import RemoteFiles
from ckptconv.remote.urls import UrlPath

_CLOSE_WAIT = 60.0  # seconds close() waits for reads in flight before closing their files anyway


class DcpReader:
    """Reads stored chunks of one DCP checkpoint into caller-owned tensors. Safe for concurrent threads."""

    def __init__(self, ckpt: DcpCheckpoint, cache_bytes: int = 256 << 20) -> None:
        self.ckpt = ckpt
        self._remote = (
            RemoteFiles(ckpt.path, cache_bytes=cache_bytes, sizes={r: s[2] for r, s in ckpt.stamps.items()})
            if isinstance(ckpt.path, UrlPath)
            else None
        )
        self._located: dict[tuple[str, int, str, tuple[int, ...]], int | None] = {}  # chunk -> data offset
        self._fds: dict[str, int] = {}
        self._st_headers: dict[tuple[str, int], dict[str, StoredTensor]] = {}
        self._crcs: dict[tuple[str, int], int] = {}  # (file, data offset) -> CRC-32 of a whole zip entry
        self._pieces: list[RowPiece] = []  # parts of checkable chunks read in pieces, checked at the end
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when a thread leaves the files
        self._using = 0  # threads between taking a descriptor and the end of its use
        self._closed = False
        self.bytes_read = 0  # every byte read from the checkpoint's files, by every thread

    def close(self) -> None:
        """Close the files once no thread is using them: after an error, reads already started in other
        threads finish on their own (`unshard.direct_tensors`), and a descriptor closed under one of them
        could be reused by the next file opened. Later reads are refused."""
        with self._idle:
            self._closed = True
            self._idle.wait_for(lambda: self._using == 0, timeout=_CLOSE_WAIT)
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)

    def __enter__(self) -> DcpReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _file(self, rel: str) -> Iterator[int]:
        """The open descriptor of `rel` (`_fd`), held open until the block ends."""
        with self._lock:
            if self._closed:
                raise CkptconvError(f"{self.ckpt.path / rel}: read after the reader was closed")
            self._using += 1
        try:
            yield self._fd(rel)
        finally:
            with self._idle:
                self._using -= 1
                self._idle.notify_all()

    def _fd(self, rel: str) -> int:
        """The open descriptor of `rel`: a regular file inside the checkpoint, the very file `open_dcp`
        measured (same inode, size and mtime)."""
        with self._lock:
            fd = self._fds.get(rel)
            if fd is None:
                path = self.ckpt.path / rel
                fd = open_regular(path, self.ckpt.path)
                try:
                    check_unchanged(path, fd, self.ckpt.stamps.get(rel))
                except CkptconvError:
                    os.close(fd)
                    raise
                self._fds[rel] = fd
            return fd

    def pread(self, rel: str, offset: int, out: memoryview) -> None:
        """Fill `out` with the bytes of `rel` at `offset`, or raise naming the file and what is wrong."""
        if self._remote is not None:
            self._remote.pread(rel, offset, out)
        else:
            with self._file(rel) as fd:
                pread_exact(fd, self.ckpt.path / rel, offset, out)
        with self._lock:
            self.bytes_read += len(out)

    @property
    def remote(self) -> bool:
        return self._remote is not None

    def expect(self, spec: TensorSpec, chunk: ChunkSpec, r0: int, r1: int) -> None:
        """This reader will read rows [r0, r1) of `chunk` soon. From object storage, those bytes are then
        fetched with their expected neighbours in one request (`RemoteFiles.expect`): a whole torch.save
        record (its zip entries and data), or else exactly the rows' bytes once the data is located. On a
        file system, nothing to do."""
        if self._remote is None or not chunk.numel:
            return
        rows = chunk.sizes[0] if chunk.sizes else 1
        if self.ckpt.transforms or (chunk.fmt == "torch_save" and r0 == 0 and r1 == rows):  # a whole record
            self._remote.expect(chunk.file, chunk.byte_offset, chunk.byte_length)
            return
        where = self.locate(spec, chunk)
        if where is not None:
            row_bytes = chunk.numel * spec.dtype.itemsize // rows
            self._remote.expect(chunk.file, where + r0 * row_bytes, (r1 - r0) * row_bytes)

    def elsewhere(self, spec: TensorSpec, chunk: ChunkSpec, r0: int, r1: int) -> None:
        """Another rank reads rows [r0, r1) of `chunk`: from object storage, no request of this reader reads
        across them (`RemoteFiles.elsewhere`): the rows' bytes where the data lies in place at the record's
        start, else the whole record (where rows lie inside a torch.save record is not read for this)."""
        if self._remote is None or not chunk.numel:
            return
        start, length = chunk.byte_offset, chunk.byte_length
        if chunk.fmt == "torch_entry" and not self.ckpt.transforms:
            row_bytes = chunk.numel * spec.dtype.itemsize // (chunk.sizes[0] if chunk.sizes else 1)
            start, length = start + r0 * row_bytes, (r1 - r0) * row_bytes
        self._remote.elsewhere(chunk.file, start, length)

    def fetched(self) -> tuple[int, int]:
        """(bytes fetched, requests) from object storage; (0, 0) on a file system."""
        remote = self._remote
        return (remote.bytes_fetched, remote.requests) if remote is not None else (0, 0)

    def read_bytes(self, rel: str, offset: int, length: int) -> bytes:
        buf = bytearray(length)
        self.pread(rel, offset, memoryview(buf))
        return bytes(buf)

    def read_chunk_into(self, spec: TensorSpec, chunk: ChunkSpec, out: torch.Tensor) -> None:
        """Fill `out` (contiguous, `spec.dtype`, `chunk.sizes`) with the stored chunk."""
        assert out.is_contiguous() and out.dtype == spec.dtype and tuple(out.shape) == chunk.sizes
        if chunk.numel == 0:
            return
        where = self.locate(spec, chunk)
        if where is None:
            out.copy_(self.torch_load_chunk(spec, chunk))
        else:
            view = byte_view(out)
            self.pread(chunk.file, where, view)
            self.check(spec, chunk, where, crc32(view))

    def check(self, spec: TensorSpec, chunk: ChunkSpec, where: int, crc: int) -> None:
        """Compare the CRC-32 of the whole chunk read at `where` with the one its torch.save record stores
        (chunks that are a part of their record, and the safetensors serialization, have none to check)."""
        expected = self._crcs.get((chunk.file, where))
        if expected is not None and expected != crc:
            raise crc_error(self.ckpt, chunk.file, spec.fqn, chunk.byte_offset)

    def note_piece(
        self, spec: TensorSpec, chunk: ChunkSpec, where: int, start: int, piece: memoryview
    ) -> None:
        """Remember the CRC-32 of `piece`, the bytes from `start` of a chunk read in pieces (some rows of it,
        as a mapping that splits stacked experts or fused projections reads it), to check the whole chunk
        once every piece is read: `check_pieces`, possibly with other ranks' pieces. Chunks without a
        stored CRC-32 cost nothing."""
        expected = self._crcs.get((chunk.file, where))
        if expected is None:
            return
        nbytes = chunk.numel * spec.dtype.itemsize
        noted = RowPiece(
            chunk.file,
            where,
            spec.fqn,
            chunk.byte_offset,
            expected,
            nbytes,
            start,
            len(piece),
            crc32(piece),
        )
        with self._lock:
            self._pieces.append(noted)

    def pieces(self) -> list[RowPiece]:
        with self._lock:
            return list(self._pieces)

    def read_chunk(self, spec: TensorSpec, chunk: ChunkSpec) -> torch.Tensor:
        out = torch.empty(chunk.sizes, dtype=spec.dtype)
        self.read_chunk_into(spec, chunk, out)
        return out

    def locate(self, spec: TensorSpec, chunk: ChunkSpec) -> int | None:
        """File offset of the chunk's raw bytes (C order, in `spec.dtype`), None if only torch.load can (or
        `torch_load_chunk` decompresses the record: compressed records cannot be read by offset)."""
        if self.ckpt.transforms:
            return None
        key = (chunk.file, chunk.byte_offset, spec.fqn, chunk.offsets)  # one blob holds many (safetensors)
        if key not in self._located:
            found = self._locate(spec, chunk)
            with self._lock:
                self._located[key] = found
            if self._remote is not None and found is not None and chunk.fmt == "torch_save":
                end, data_end = (
                    chunk.byte_offset + chunk.byte_length,
                    found + chunk.numel * spec.dtype.itemsize,
                )
                self._remote.forgo(chunk.file, chunk.byte_offset, found)  # the record's zip entries: read
                self._remote.forgo(chunk.file, data_end, end)
        return self._located[key]

    def _locate(self, spec: TensorSpec, chunk: ChunkSpec) -> int | None:
        nbytes = chunk.numel * spec.dtype.itemsize
        if chunk.fmt == "torch_entry":  # bytes in place in a torch.save zip (rank files, DeepSpeed)
            if chunk.byte_length != nbytes:
                raise self._corrupt(
                    chunk, f"holds {chunk.byte_length} bytes for {spec.fqn!r}, expected {nbytes}"
                )
            return chunk.byte_offset
        if chunk.fmt == "safetensors":
            stored = self._st_header(chunk.file, chunk.byte_offset).get(spec.fqn)
            if stored is None or stored.shape != chunk.sizes:
                raise self._corrupt(chunk, f"has no stored tensor {spec.fqn!r} of shape {list(chunk.sizes)}")
            if stored.nbytes != nbytes:
                what = f"stores {stored.nbytes} bytes for {spec.fqn!r}, expected {nbytes}"
                raise self._corrupt(chunk, what)
            return stored.data_offset
        return self._locate_in_zip(spec, chunk, nbytes)

    def _locate_in_zip(self, spec: TensorSpec, chunk: ChunkSpec, nbytes: int) -> int | None:
        window = Window(self.pread, chunk.file, chunk.byte_offset, chunk.byte_length)
        found = self._in_record(
            spec,
            chunk,
            window,
            lambda at: self.read_bytes(chunk.file, chunk.byte_offset + at, 30),
            chunk.byte_length,
        )
        if found is None:
            return None
        start, crc = found
        if crc is not None:
            self._crcs[(chunk.file, chunk.byte_offset + start)] = crc
        return chunk.byte_offset + start

    def _in_record(
        self, spec: TensorSpec, chunk: ChunkSpec, data: Any, local_header: Any, length: int
    ) -> tuple[int, int | None] | None:
        """(where the chunk's bytes start in its torch.save record, the zip entry's CRC-32 when they are all
        of it, else None), or None when only torch.load can read the record. `data`: the record, `length`
        bytes; `local_header(at)`: its 30 bytes at `at`."""
        nbytes = chunk.numel * spec.dtype.itemsize
        try:
            archive, record = self._record(chunk, data, length)
            if archive.read("byteorder", 16) != b"little":
                return None
            if record.dtype != spec.dtype or not record.is_contiguous:
                return None
            if record.size != chunk.sizes:
                raise self._corrupt(chunk, f"stores shape {list(record.size)}, expected {list(chunk.sizes)}")
            info = archive.entries[f"data/{record.storage_key}"]
        except (zipfile.BadZipFile, KeyError, EOFError, ValueError) as e:
            raise self._corrupt(chunk, f"is not a readable torch.save record ({str(e)[:200]})") from None
        if info.compress_type != zipfile.ZIP_STORED:
            return None
        local = local_header(info.header_offset)
        if len(local) < 30 or local[:4] != b"PK\x03\x04":
            raise self._corrupt(chunk, "has a broken zip entry")
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        data_start = info.header_offset + 30 + name_len + extra_len
        start = data_start + record.storage_offset * spec.dtype.itemsize
        if start + nbytes > data_start + info.file_size or data_start + info.file_size > length:
            raise self._corrupt(chunk, "stores fewer bytes than its shape needs")
        whole = start == data_start and nbytes == info.file_size  # the chunk is the whole entry: checkable
        return start, info.CRC if whole else None

    def _record(self, chunk: ChunkSpec, data: Any, length: int) -> tuple[TorchZip, TensorRecord]:
        """The zip of a chunk's torch.save record (`data`: its bytes or a window on them) and the tensor its
        data.pkl describes, read within the read limits; a record of anything but one plain tensor (which
        only torch's unbounded unpickler would read) is refused."""
        budget = Budget(self.ckpt.path / chunk.file)
        archive = TorchZip(data, budget.where, budget)
        archive.check_declared(length + budget.bytes_left())  # what torch.load would inflate
        record = read_tensor_record(archive.read("data.pkl", MAX_RECORD_PICKLE), budget)
        if record is None:
            raise self._corrupt(chunk, "holds something else than one plain tensor")
        return archive, record

    def torch_load_chunk(self, spec: TensorSpec, chunk: ChunkSpec) -> torch.Tensor:
        """The stored chunk, loaded whole: by torch.load(weights_only=True), or decompressed
        (`_unpack`)."""
        if self.ckpt.transforms:
            return self._unpack(spec, chunk)
        return self.load_record(
            spec, chunk, self.read_bytes(chunk.file, chunk.byte_offset, chunk.byte_length)
        )

    def _unpack(self, spec: TensorSpec, chunk: ChunkSpec) -> torch.Tensor:
        """A compressed chunk: its record decompressed whole (dcp_transforms), the tensor a view of its
        bytes there (no copy), checked against the zip entry's CRC-32 when it is the whole entry."""
        nbytes = chunk.numel * spec.dtype.itemsize
        where = f"{self.ckpt.path / chunk.file}: the chunk of {spec.fqn!r} at byte {chunk.byte_offset}"
        data = zt.record(
            lambda at, n: self.read_bytes(chunk.file, chunk.byte_offset + at, n),
            chunk.byte_length,
            nbytes + zt.RECORD_SLACK,
            where,
        )
        found = self._in_record(
            spec, chunk, zt.BufferFile(data), lambda at: bytes(data[at : at + 30]), len(data)
        )
        if found is None:  # big-endian, strided or deflated: as torch.load reads it
            return self.load_record(spec, chunk, bytes(data))
        start, crc = found
        if crc is not None and crc32(data[start : start + nbytes]) != crc:
            raise crc_error(self.ckpt, chunk.file, spec.fqn, chunk.byte_offset)
        return torch.frombuffer(data, dtype=spec.dtype, count=chunk.numel, offset=start).view(chunk.sizes)

    def load_record(self, spec: TensorSpec, chunk: ChunkSpec, data: Any) -> torch.Tensor:
        """The chunk `data` (its torch.save record's bytes) holds, by torch.load(weights_only=True)."""
        try:
            self._record(chunk, data, len(data))
        except (zipfile.BadZipFile, KeyError, EOFError, ValueError) as e:
            raise self._corrupt(chunk, f"is not a readable torch.save record ({str(e)[:200]})") from None
        try:
            tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:
            raise self._corrupt(chunk, f"could not be loaded safely ({type(e).__name__})") from None
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != chunk.sizes:
            raise self._corrupt(chunk, f"does not hold a tensor of shape {list(chunk.sizes)}")
        return tensor

    def _st_header(self, rel: str, offset: int) -> dict[str, StoredTensor]:
        """The tensors of the safetensors file at `offset` of `rel` (DCP's safetensors serialization: the
        whole .distcp file), validated as `hf.read_header` validates an HF file."""
        key = (rel, offset)
        if key not in self._st_headers:
            path = self.ckpt.path / rel
            (length,) = struct.unpack("<Q", self.read_bytes(rel, offset, 8))
            if length > MAX_HEADER_BYTES:
                raise CkptconvError(f"{path}: safetensors header of {length} bytes is too large")
            header = parse_header(self.read_bytes(rel, offset + 8, length), path)
            size = self._size(rel)
            self._st_headers[key] = header_tensors(header, path, offset + 8 + length, size)[0]
        return self._st_headers[key]

    def _size(self, rel: str) -> int:
        if self._remote is not None:
            return self._remote.sizes()[rel]
        try:
            with self._file(rel) as fd:
                return os.fstat(fd).st_size
        except OSError as e:
            raise read_error(self.ckpt.path / rel, e) from None

    def _corrupt(self, chunk: ChunkSpec, what: str) -> CkptconvError:
        return CkptconvError(
            f"{self.ckpt.path / chunk.file}: the chunk at byte {chunk.byte_offset} {what}; "
            "the checkpoint is corrupt, re-save or re-copy it"
        )

    def load_item(self, item: NonTensorItem) -> tuple[bytes, Any, str | None]:
        """(raw torch.save bytes, the value loaded with weights_only=True, why it was not loaded or None):
        formats/items, within the read limits."""
        raw = self.read_bytes(item.file, item.byte_offset, item.byte_length)
        if self.ckpt.transforms:
            where = f"{self.ckpt.path / item.file}: {item.fqn!r}"
            raw = bytes(zt.record(_from(raw), len(raw), limit("bytes"), where))  # grown as it arrives
        return (raw, *load_item(raw, item.fqn, f"{self.ckpt.path / item.file}: {item.fqn!r}"))


def _from(raw: bytes) -> zt.Reader:
    return lambda at, n: raw[at : at + n]
