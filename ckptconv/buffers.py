"""Output tensors made in reused memory: `BufferPool.take` / `give`.

A conversion makes one output tensor after another, most of them of a few sizes (a layer's weights), each
written and dropped. Allocated fresh, every one is a new mapping whose pages fault in as they are filled and
are unmapped when it is dropped: measured on a 4 GB dcp-to-hf, `munmap` alone was 10% of the samples. The
pool keeps dropped buffers (up to `keep_bytes`) and hands them out again, so the pages stay mapped.
"""

from __future__ import annotations

import math
import threading

import torch


class BufferPool:
    """Buffers for tensors, reused once given back. Thread-safe (tensors are assembled in reader threads)."""

    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes = keep_bytes
        self._free: list[torch.Tensor] = []  # uint8 buffers, smallest first
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr -> the whole buffer of a tensor handed out
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, zeroed: bool = False) -> torch.Tensor:
        """An uninitialised (or `zeroed`) tensor of `shape` and `dtype`: in the smallest free buffer that
        holds it and is at most twice its size, else in a new one."""
        nbytes = math.prod(shape) * dtype.itemsize
        buf = None
        with self._lock:
            for i, free in enumerate(self._free):
                if nbytes <= free.numel() <= 2 * nbytes:
                    buf = self._free.pop(i)
                    break
        if buf is None:
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        out = buf[:nbytes].view(dtype).view(shape) if nbytes else torch.empty(shape, dtype=dtype)
        if zeroed:
            out.zero_()
        if nbytes:
            with self._lock:
                self._lent[out.data_ptr()] = buf
        return out

    def give(self, tensor: torch.Tensor) -> None:
        """Take back a tensor `take` made, once nothing uses it any more; any other tensor is ignored. Kept
        while the free buffers stay under `keep_bytes`, else dropped (the largest first)."""
        with self._lock:
            buf = self._lent.pop(tensor.data_ptr(), None)
            if buf is None:
                return
            self._free.append(buf)
            self._free.sort(key=torch.Tensor.numel)
            while sum(b.numel() for b in self._free) > self.keep_bytes:
                self._free.pop()
