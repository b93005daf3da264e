"""hf-to-dcp: rows [lo, hi) of a target (runtime) tensor, composed from the HF tensors its parts name.

DCP asks for each rank's `Shard(0)` rows of a tensor; every part whose target block meets those rows
reads only the source rows it needs (a stacked expert its one HF tensor, a split its row range, a
permuted tensor the rows of the heads involved) and copies them into place, casting as torch does.
"""

from __future__ import annotations

import torch

from .formats.hf import StoredTensor
from .formats.safetensors_io import RowReader
from .mapping.rules import Part
from .plan import DcpOutTensor


def _narrow(
    t: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...], first: int = 0
) -> torch.Tensor:
    for dim in range(first, len(sizes)):
        t = t.narrow(dim, offsets[dim], sizes[dim])
    return t


def target_rows(
    t: DcpOutTensor, lo: int, hi: int, reader: RowReader, scratch: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows [lo, hi) of `t` (all of a 0-d `t`) in `t.dtype`; in `scratch` (bytes) when they fit there.

    A caller that writes rows slab after slab passes the same `scratch` each time: no fresh allocation (and
    its page faults) per slab; the result is then only valid until the next call.
    """
    if not t.shape:
        stored, _ = t.parts[0]
        return reader.rows(stored, 0, 1).to(t.dtype)
    shape = (hi - lo, *t.shape[1:])
    if len(t.parts) == 1 and is_whole(*t.parts[0], t.shape):  # a plain rename: the rows as read
        stored = t.parts[0][0]
        if stored.dtype == t.dtype:
            return reader.rows(stored, lo, hi, out=_within(scratch, shape, t.dtype))
        return reader.rows(stored, lo, hi).to(t.dtype)
    out = _within(scratch, shape, t.dtype)
    out = torch.empty(shape, dtype=t.dtype) if out is None else out
    for stored, part in t.parts:
        a, b = max(lo, part.dst_offsets[0]), min(hi, part.dst_offsets[0] + part.dst_sizes[0])
        if a >= b:
            continue
        values = _source_rows(stored, part, a - part.dst_offsets[0], b - part.dst_offsets[0], reader)
        dst = _narrow(out.narrow(0, a - lo, b - a), part.dst_offsets, part.dst_sizes, first=1)
        dst.copy_(values)
    return out


def _within(scratch: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if scratch is None or nbytes > scratch.numel() or nbytes == 0:
        return None
    return scratch[:nbytes].view(dtype).view(shape)


def is_whole(stored: StoredTensor, part: Part, shape: tuple[int, ...]) -> bool:
    """All of the stored tensor, unpermuted, is all of the target."""
    return part.perm is None and stored.shape == part.src_sizes == part.dst_sizes == shape


def _source_rows(stored: StoredTensor, part: Part, ra: int, rb: int, reader: RowReader) -> torch.Tensor:
    """Target block rows [ra, rb) of `part`, shaped like them."""
    off, sizes = part.src_offsets, part.src_sizes
    if len(sizes) != len(part.dst_sizes) and part.dst_sizes[0] == 1:
        # stacked along dim 0: the target row is the whole source block
        block = (
            _narrow(reader.rows(stored, off[0], off[0] + sizes[0]), off, sizes, first=1)
            if sizes
            else (reader.rows(stored, 0, 1))
        )
        return block.reshape(part.dst_sizes)
    if part.perm is None:
        block = _narrow(reader.rows(stored, off[0] + ra, off[0] + rb), off, sizes, first=1)
        return block.reshape((rb - ra, *part.dst_sizes[1:]))
    wanted = part.perm[ra:rb]
    r0, r1 = min(wanted), max(wanted) + 1
    block = _narrow(reader.rows(stored, off[0] + r0, off[0] + r1), off, sizes, first=1)
    return block[[r - r0 for r in wanted]].reshape((rb - ra, *part.dst_sizes[1:]))
