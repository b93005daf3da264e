"""hf-to-dcp: rows [lo, hi) of a target (runtime) tensor, composed from the HF tensors its parts name.

DCP asks for each rank's `Shard(0)` rows of a tensor; every part whose target block meets those rows
reads only the source rows it needs (a stacked expert its one HF tensor, a split its row range, a
permuted tensor the rows of the heads involved; a part transposing dim 0 all rows of its block), a slab at a
time, and places them (`blocks.place`), casting as torch does. A quantized HF weight (`formats.hf_quant`) is
read dequantized straight into the target's dtype: the fp32 product rounded once, never twice.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from ckptconv.core.dtype_names import short_name
from ckptconv.core.specs import StoredTensor
from ckptconv.formats.safetensors_io import RowReader
from ckptconv.mapping.parts import Part, src_rows
from ckptconv.plan.types import DcpOutTensor, DcpSavePlan
from ckptconv.quant.schemes import READ, described
from ckptconv.remote.urls import UrlPath
from ckptconv.stream.blocks import place, shifted

SLAB_BYTES = 32 * 2**20  # source rows are read and placed this many bytes at a time


def target_rows(
    t: DcpOutTensor, lo: int, hi: int, reader: RowReader, scratch: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows [lo, hi) of `t` (all of a 0-d `t`) in `t.dtype`; in `scratch` (bytes) when they fit there.

    A caller that writes rows slab after slab passes the same `scratch` each time: no fresh allocation (and
    its page faults) per slab; the result is then only valid until the next call.
    """
    if not t.shape:
        stored, _ = t.parts[0]
        if t.offset is not None:
            return shifted(reader.rows(stored, 0, 1), t.offset, t.dtype).to(t.dtype)
        return reader.rows(stored, 0, 1, dtype=t.dtype)
    shape = (hi - lo, *t.shape[1:])
    if len(t.parts) == 1 and is_whole(*t.parts[0], t.shape) and t.offset is None:  # the rows as read
        stored = t.parts[0][0]
        if stored.dtype == t.dtype:
            return reader.rows(stored, lo, hi, out=_within(scratch, shape, t.dtype))
        return reader.rows(stored, lo, hi, dtype=t.dtype)
    out = _within(scratch, shape, t.dtype)
    out = torch.empty(shape, dtype=t.dtype) if out is None else out
    if t.padded:
        out.zero_()
    view = out.view(hi - lo, *t.layout[1:]) if t.layout else out
    for stored, part in t.parts:
        needed = src_rows(part, lo, hi)
        if needed is None:
            continue
        for a, b in _slabs(stored, *needed):
            box = (
                ((a, *(0,) * (len(stored.shape) - 1)), (b - a, *stored.shape[1:]))
                if stored.shape
                else ((), ())
            )
            dtype = t.dtype if stored.quant is not None else None  # others: cast by `place`
            place(view, part, box, reader.rows(stored, a, b, dtype=dtype), window=lo, shift=t.offset)
    return out


def block_of(
    t: DcpOutTensor, offsets: Sequence[int], sizes: Sequence[int], reader: RowReader
) -> torch.Tensor:
    """The block of `t` at `offsets` of `sizes` (a rank's shard, `load_hf`): only the block's bytes for a
    tensor stored as is (any shard dims), else the rows of the block composed from `t`'s parts, then cut."""
    if not t.shape:
        return target_rows(t, 0, 1, reader)
    if len(t.parts) == 1 and is_whole(t.parts[0][0], t.parts[0][1], t.shape) and t.offset is None:
        return reader.block(t.parts[0][0], offsets, sizes, dtype=t.dtype)
    rows = target_rows(t, offsets[0], offsets[0] + sizes[0], reader)
    for dim in range(1, len(t.shape)):
        rows = rows.narrow(dim, offsets[dim], sizes[dim])
    return rows


def expect_block(reader: RowReader, t: DcpOutTensor, offsets: Sequence[int], sizes: Sequence[int]) -> None:
    """Tell `reader` the stored rows `block_of` will read, when they are whole rows (a block cut on a later
    dim reads only its runs: announcing whole rows would fetch other ranks' bytes)."""
    if tuple(sizes[1:]) != tuple(t.shape[1:]):
        return
    lo, hi = (offsets[0], offsets[0] + sizes[0]) if t.shape else (0, 1)
    for stored, a, b in source_rows(t, lo, hi):
        reader.expect(stored, a, b)


def expect_elsewhere(reader: RowReader, plan: DcpSavePlan, rank: int) -> None:
    """From object storage, tell `reader` the stored rows every rank but `rank` reads (`elsewhere`: the plan
    says which, no collective), so that the requests of `rank`, coalesced across small gaps, never fetch
    another rank's rows (on 2 ranks, a rank's rows of neighbouring tensors are the other's rows apart)."""
    if not any(isinstance(stored.file, UrlPath) for t in plan.tensors for stored, _ in t.parts):
        return
    for t in plan.tensors:
        for r in range(plan.world_size):
            lo, hi = plan.rows_of(t, r)
            if r != rank and hi > lo:
                for stored, a, b in source_rows(t, lo, hi):
                    reader.elsewhere(stored, a, b)


def source_rows(t: DcpOutTensor, lo: int, hi: int) -> list[tuple[StoredTensor, int, int]]:
    """The stored rows [a, b) `target_rows(t, lo, hi, ...)` reads, per stored tensor (a quantized one
    left out: its parts and scales are read by block)."""
    if not t.shape:
        return [(t.parts[0][0], 0, 1)] if t.parts[0][0].quant is None else []
    if len(t.parts) == 1 and is_whole(*t.parts[0], t.shape):
        return [(t.parts[0][0], lo, hi)] if t.parts[0][0].quant is None else []
    found = ((stored, src_rows(part, lo, hi)) for stored, part in t.parts if stored.quant is None)
    return [(stored, *needed) for stored, needed in found if needed is not None]


def _slabs(stored: StoredTensor, r0: int, r1: int) -> list[tuple[int, int]]:
    """Rows [r0, r1) of a stored tensor in runs of at most SLAB_BYTES (one row at least)."""
    if not stored.shape:
        return [(0, 1)]
    row = math.prod(stored.shape[1:]) * stored.dtype.itemsize
    step = max(1, SLAB_BYTES // max(row, 1))
    return [(a, min(a + step, r1)) for a in range(r0, r1, step)]


def _within(scratch: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if scratch is None or nbytes > scratch.numel() or nbytes == 0:
        return None
    return scratch[:nbytes].view(dtype).view(shape)


def is_whole(stored: StoredTensor, part: Part, shape: tuple[int, ...]) -> bool:
    """All of the stored tensor, as it is, is all of the target."""
    return part.plain and stored.shape == part.src_sizes == part.dst_sizes == shape


def dequantized_note(tensors: Iterable[DcpOutTensor]) -> str | None:
    """hf-to-dcp's one line about the quantized HF weights its tensors read (None when there are none):
    "dequantized 120 block-FP8 weights (128x128 blocks, *_scale_inv) and 4 MXFP4 expert tensors (*_blocks,
    *_scales) to bf16 (the fp32 product rounded once); their scales are not written"."""
    read: dict[str, set[str]] = {}
    blocks: dict[str, set[str]] = {}
    dtypes: set[str] = set()
    for t in tensors:
        for stored, _ in t.parts:
            if stored.quant is not None:
                read.setdefault(stored.quant.scheme, set()).add(stored.key)
                dtypes.add(short_name(t.dtype))
                size = stored.quant.block_size
                shown = "x".join(map(str, size)) if isinstance(size, list) else ""
                blocks.setdefault(stored.quant.scheme, set()).add(shown)
    if not read:
        return None
    what = [described(s, len(keys), ", ".join(sorted(b for b in blocks[s] if b))) for s, keys in read.items()]
    how = sorted({READ[s].product for s in read})
    return (
        f"dequantized {' and '.join(what)} to {', '.join(sorted(dtypes))} ({'; '.join(how)}); "
        "their scales are not written"
    )
