"""Output tensors made in reused memory: `BufferPool.take` / `give`.

A conversion makes one output tensor after another, most of them of a few sizes (a layer's weights), each
written and dropped. Allocated fresh, every one is a new mapping whose pages fault in as they are filled and
are unmapped when it is dropped: measured on a 4 GB dcp-to-hf, `munmap` alone was 10% of the samples. The
pool keeps dropped buffers (up to `keep_bytes`) and hands them out again, so the pages stay mapped.

`BufferPool.for_bucket` sizes it for a reader that works up to one bucket ahead: two buckets of free buffers.
With one, a model whose large weights each take most of a bucket lost them at every layer: an 8 GB model's
92 MB MLP weights against the default 128 MB bucket made 3.3 GB of new buffers for 4.1 GB written (837k page
faults). With two: 231k page faults, the whole run 7.0-8.5 s against 8.3-11.7 s in five paired runs, its
peak RSS unchanged (0.53 GB: its largest tensors in flight set it). Smaller models keep more than before
(2 and 4 GB: 0.52 GiB, was 0.41), so the peak is now about flat from 2 to 8 GB.
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
        self.allocated = 0  # bytes of the buffers made new (not reused)

    @classmethod
    def for_bucket(cls, bucket_bytes: int) -> BufferPool:
        """The pool of a reader that makes tensors up to `bucket_bytes` ahead of the one being written: it
        keeps two buckets of free buffers, so each tensor of the next bucket finds one of its size."""
        return cls(keep_bytes=2 * bucket_bytes)

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
            with self._lock:
                self.allocated += buf.numel()
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
