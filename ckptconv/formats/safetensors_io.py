"""Tensor bytes in and out of safetensors files: a streaming writer and a row / block reader.

The writer lays out a file exactly as `safetensors.torch.save` does (same header, same data order, same
padding), but takes tensors (or row slabs of them) one at a time, in any order, each `pwrite` at its offset:
no process ever holds a whole output file, and several processes can write one file at once.
Call order: `SafetensorsWriter(path, entries, header=...)` opens the file (creating it, never truncating it:
other ranks may be writing it too) and, with `header=True` (one writer per file), writes the header;
`write(key, tensor, start)` per range of an entry's bytes (a quantized weight and its scale are written
together, though safetensors lays the fp32 scales out before the fp8 weights); `close()`, which fsyncs what
this writer wrote (or `close(syncer)`: `durable.Syncer` does, or not, on its own thread). Every byte of the
file is written by exactly one writer (`writes.plan_writes`), so the file is complete once all have closed.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ckptconv.core.crc32 import crc32
from ckptconv.core.dtypes import st_name
from ckptconv.core.specs import StoredTensor
from ckptconv.errors import CkptconvError
from ckptconv.formats.byte_views import byte_view
from ckptconv.formats.dequant import quantized_block
from ckptconv.formats.durable import Syncer, sync_fd
from ckptconv.formats.files import check_unchanged, open_regular, pread_exact
from ckptconv.formats.pieces import PIECE_BYTES
from ckptconv.formats.sinks import PositionedSink
from ckptconv.remote.files import RemoteFiles
from ckptconv.remote.urls import UrlPath


@dataclass(frozen=True)
class Entry:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


def header_bytes(entries: Sequence[Entry], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length and JSON header safetensors writes for `entries` laid out in the given order."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for e in entries:
        header[e.key] = {
            "dtype": st_name(e.dtype),
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


class SafetensorsWriter:
    def __init__(
        self,
        path: Path,
        entries: Sequence[Entry],
        *,
        header: bool = True,
        sink: PositionedSink | None = None,
        crc: bool = False,
    ) -> None:
        """`sink`: where the bytes go instead of the local file `path` (object storage); `crc`: keep the
        CRC-32 of what is written (`crcs`), computed from the bytes in memory, not read back."""
        self.path = path
        self.bytes_written = 0  # bytes taken (see `bytes_sent`)
        # (offset, length, CRC-32) of each run of bytes written, a write that continues the last run
        # extending it (zlib's CRC-32 continues a running one): one piece where writes come in order
        self.crcs: list[tuple[int, int, int]] | None = [] if crc else None
        self.entries = {e.key: e for e in entries}
        head = header_bytes(list(entries))
        self._offsets = dict(
            zip(
                self.entries,
                itertools.accumulate((e.nbytes for e in entries), initial=len(head)),
                strict=False,
            )
        )
        self._stream = sink
        if sink is None:
            try:
                self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as e:
                raise self._error(e) from None
        if header:
            self._pwrite(memoryview(head), 0)

    def write(self, key: str, tensor: torch.Tensor, start: int = 0) -> None:
        """`tensor`'s bytes at byte `start` of entry `key` (the whole entry: its shape; a slab: its rows)."""
        entry = self.entries[key]
        view = byte_view(tensor.contiguous())
        whole = start == 0 and tuple(tensor.shape) == entry.shape
        assert tensor.dtype == entry.dtype and (whole or start + len(view) <= entry.nbytes), key
        if len(view):
            self._pwrite(view, self._offsets[key] + start)

    def _pwrite(self, data: memoryview, offset: int) -> None:
        if self.crcs is not None and len(data):
            self._crc(data, offset)
        if self._stream is not None:
            self._stream.write_at(offset, data)
            self.bytes_written += len(data)
            return
        try:
            while data:
                n = os.pwrite(self._fd, data[:PIECE_BYTES], offset)  # see pieces.py
                data, offset = data[n:], offset + n
                self.bytes_written += n
        except OSError as e:
            raise self._error(e) from None

    def _crc(self, data: memoryview, offset: int) -> None:
        assert self.crcs is not None
        if self.crcs and sum(self.crcs[-1][:2]) == offset:
            start, length, crc = self.crcs[-1]
            self.crcs[-1] = (start, length + len(data), crc32(data, crc))
        else:
            self.crcs.append((offset, len(data), crc32(data)))

    def _error(self, e: OSError) -> CkptconvError:
        return CkptconvError(f"{self.path}: cannot write ({e.strerror}); check free space and permissions")

    @property
    def bytes_sent(self) -> int:
        """Bytes that went to the file or the sink: those an interrupted run sent already left out."""
        return self.bytes_written - (self._stream.skipped if self._stream is not None else 0)

    def close(self, syncer: Syncer | None = None) -> None:
        """Done writing: the file is closed by `syncer` (fsynced there first, while the caller writes on, or
        not, as it says), or without one fsynced and closed here. A URL's upload is completed or handed on
        (`remote.out`)."""
        if self._stream is not None:
            self._stream.close()
            return
        if syncer is not None:
            syncer.close(self._fd, self.path)
            return
        try:
            sync_fd(self._fd, self.path)
        finally:
            try:
                os.close(self._fd)
            except OSError as e:
                raise self._error(e) from None

    def abort(self) -> None:
        if self._stream is not None:
            self._stream.discard()
            return
        os.close(self._fd)


class RowReader:
    """Reads rows [lo, hi) of stored tensors straight into a new tensor, one `preadv` a slice.

    The offsets come from the header `read_header` validated, so these are exactly the bytes safetensors'
    `safe_open(...).get_slice(key)[lo:hi]` returns (tested), without an mmap: a process's memory then holds
    the slice it is saving, not every page of every file it has read.
    """

    MIN_RUN_BYTES = 4096  # a block whose contiguous runs are shorter is read as whole rows and cut

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self._remote: dict[str, RemoteFiles] = {}  # prefix URL -> its objects, read by range
        self._lock = threading.Lock()  # hf-to-dcp's writer threads read through one reader
        self.bytes_read = 0

    def rows(
        self,
        t: StoredTensor,
        lo: int,
        hi: int,
        out: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Rows [lo, hi) of `t` (a 0-d `t` whole) in `dtype` (default `t.dtype`; a stored tensor is read as
        it is, then cast), read into `out` if given (contiguous, right shape, that dtype). A quantized `t`
        (`hf_quant`) is dequantized straight into `dtype`, as its format's own dequantizer computes it."""
        if t.quant is not None:
            sizes = (hi - lo, *t.shape[1:])
            want = dtype or (out.dtype if out is not None else t.dtype)
            return quantized_block(self, t, (lo, *(0,) * (len(t.shape) - 1)), sizes, want, out)
        if out is None:
            out = torch.empty((hi - lo, *t.shape[1:]) if t.shape else (), dtype=t.dtype)
        row_bytes = t.nbytes // t.shape[0] if t.shape and t.shape[0] else t.nbytes
        self._pread(t, t.data_offset + (lo * row_bytes if t.shape else 0), byte_view(out))
        return out if dtype is None else out.to(dtype)

    def block(
        self, t: StoredTensor, offsets: Sequence[int], sizes: Sequence[int], dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The block of `t` at `offsets` of `sizes` (a rank's shard on any dims) in `dtype` (as `rows`),
        reading only its bytes: one read per contiguous run of the block in the file, straight into place.
        When those runs are short (< MIN_RUN_BYTES: a column shard of a narrow tensor), its whole rows are
        read and cut instead (a view). A quantized `t` reads only the parts and scales the block covers."""
        if t.quant is not None:
            return quantized_block(self, t, offsets, sizes, dtype or t.dtype)
        block = self._stored_block(t, offsets, sizes)
        return block if dtype is None else block.to(dtype)

    def _stored_block(self, t: StoredTensor, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        k = max((d for d in range(len(sizes)) if sizes[d] != t.shape[d]), default=0)
        if k == 0:
            return self.rows(t, offsets[0], offsets[0] + sizes[0]) if sizes else self.rows(t, 0, 1)
        stride = [math.prod(t.shape[d + 1 :]) for d in range(len(sizes))]
        run = sizes[k] * stride[k] * t.dtype.itemsize
        if run < self.MIN_RUN_BYTES or not math.prod(sizes):
            rows = self.rows(t, offsets[0], offsets[0] + sizes[0])
            for d in range(1, len(sizes)):
                rows = rows.narrow(d, offsets[d], sizes[d])
            return rows  # a view of the rows: the caller copies it into place
        out = torch.empty(tuple(sizes), dtype=t.dtype)
        view = byte_view(out)
        runs = itertools.product(*(range(o, o + s) for o, s in zip(offsets[:k], sizes[:k], strict=True)))
        for i, index in enumerate(runs):
            element = sum(x * stride[d] for d, x in enumerate(index)) + offsets[k] * stride[k]
            self._pread(t, t.data_offset + element * t.dtype.itemsize, view[i * run : (i + 1) * run])
        return out

    def _pread(self, t: StoredTensor, start: int, view: memoryview) -> None:
        """Read `view` from `t.file` at `start`: a regular file, the one whose header was read (same inode,
        size and mtime), which must still hold every byte; otherwise a CkptconvError naming it. An object in
        object storage: one ranged GET, which must return every byte."""
        if isinstance(t.file, UrlPath):
            self._files(t.file).pread(t.file.name, start, view)
        else:
            pread_exact(self._fd(t), t.file, start, view, shrank=True)
        with self._lock:
            self.bytes_read += len(view)

    def _fd(self, t: StoredTensor) -> int:
        with self._lock:
            fd = self._fds.get(t.file)
            if fd is None:
                fd = open_regular(t.file)
                try:
                    check_unchanged(t.file, fd, t.stamp)
                except CkptconvError:
                    os.close(fd)
                    raise
                self._fds[t.file] = fd
            return fd

    def expect(self, t: StoredTensor, lo: int, hi: int) -> None:
        """This reader will read rows [lo, hi) of `t` soon: from object storage, neighbouring expected rows
        are then fetched together (`RemoteFiles.expect`); on a file system, nothing to do."""
        if isinstance(t.file, UrlPath) and hi > lo:
            self._files(t.file).expect(t.file.name, *_row_range(t, lo, hi))

    def elsewhere(self, t: StoredTensor, lo: int, hi: int) -> None:
        """Another rank reads rows [lo, hi) of `t`: from object storage, no request of this reader reads
        across them (`RemoteFiles.elsewhere`); on a file system, nothing to do."""
        if isinstance(t.file, UrlPath) and hi > lo:
            self._files(t.file).elsewhere(t.file.name, *_row_range(t, lo, hi))

    def _files(self, file: UrlPath) -> RemoteFiles:
        with self._lock:
            files = self._remote.get(str(file.parent))
            if files is None:
                files = self._remote[str(file.parent)] = RemoteFiles(file.parent)
            return files

    def fetched(self) -> tuple[int, int]:
        """(bytes, requests) fetched from object storage so far."""
        remote = self._remote.values()
        return sum(f.bytes_fetched for f in remote), sum(f.requests for f in remote)

    def close(self) -> None:
        """Close the files (a read error was raised where it happened: `dcp_writer` finds it inside torch's
        CheckpointException); called once the threads reading through it are done."""
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)


def _row_range(t: StoredTensor, lo: int, hi: int) -> tuple[int, int]:
    """(offset, length) of rows [lo, hi) of `t` in its file (a 0-d `t`: its bytes)."""
    row_bytes = t.nbytes // t.shape[0] if t.shape and t.shape[0] else t.nbytes
    return t.data_offset + (lo * row_bytes if t.shape else 0), (hi - lo) * row_bytes if t.shape else t.nbytes
