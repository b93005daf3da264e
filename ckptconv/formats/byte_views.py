"""Byte views: a CPU tensor's bytes as a memoryview, and a seekable window of a checkpoint file's bytes."""

from __future__ import annotations

import ctypes
import io
from collections.abc import Callable
from typing import Any

import torch

Pread = Callable[[str, int, memoryview], None]  # (file, offset, buffer to fill)


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable memoryview (bf16, bool and 0-d included).

    Built with ctypes rather than `.numpy()`, which would pin the storage's size for good (and so keep
    `write_dcp` from releasing a chunk once it is written). Valid while `tensor` is alive.
    """
    assert tensor.is_contiguous() and tensor.device.type == "cpu"
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


class Window(io.RawIOBase):
    """A read-only, seekable view of bytes [start, start+length) of a checkpoint file, read with
    `pread(rel, offset, out)` (a DcpReader's: local or in object storage)."""

    def __init__(self, pread: Pread, rel: str, start: int, length: int) -> None:
        self.pread, self.rel, self.start, self.length, self.pos = pread, rel, start, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self.length - self.pos))
        if n:
            self.pread(self.rel, self.start + self.pos, memoryview(buffer).cast("B")[:n])
            self.pos += n
        return n
