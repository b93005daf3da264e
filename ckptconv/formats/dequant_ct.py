"""Reading a block of a compressed-tensors weight (`quant_ct`'s logical [O, I]) as dequantized values.

For logical rows [r0, r1) x columns [c0, c1), a slab of rows at a time, only what the block covers is read:

    values       ct-fp8: the same block of `weight`; ct-int: the 32-value groups of `weight_packed` words the
                 columns fall in (bits words a group); ct-nvfp4 / ct-mxfp4: bytes [c0 // 2, ceil(c1 / 2))
    scales       the scale rows / columns whose (rows, cols) `grid` cell covers the block
    zero points  ct-int: the 32-row groups of the row-packed zero-point words, those scale columns

The values are `quant.ct`'s, bit-identical to compressed-tensors 0.20.0's decompress then `.to(dtype)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from ckptconv.core.specs import Quantized, StoredTensor
from ckptconv.quant import ct


class RowReader(Protocol):
    """What dequantizing reads through (`dequant.RowReader`, which registers `ct_block` in its SCHEMES)."""

    def block(
        self, t: StoredTensor, offsets: Sequence[int], sizes: Sequence[int], dtype: torch.dtype | None = None
    ) -> torch.Tensor: ...


SLAB_VALUES = 2**20  # logical values dequantized at a time (temporaries of a few MiB)
GROUP = 32  # int values packed per group of `bits` words


def ct_block(
    reader: RowReader, t: StoredTensor, offsets: Sequence[int], sizes: Sequence[int], out: torch.Tensor
) -> None:
    """Any compressed-tensors scheme: the block of logical `t` at `offsets` of `sizes` into `out`."""
    q = t.quant
    assert q is not None
    (r0, c0), (nr, nc) = offsets, sizes
    step = max(1, SLAB_VALUES // max(nc, 1))
    for lo in range(r0, r0 + nr, step):
        hi = min(lo + step, r0 + nr)
        out[lo - r0 : hi - r0] = _slab(reader, q, lo, hi, c0, c0 + nc, out.dtype)


def _slab(
    reader: RowReader, q: Quantized, lo: int, hi: int, c0: int, c1: int, dtype: torch.dtype
) -> torch.Tensor:
    """Rows [lo, hi) x columns [c0, c1) dequantized."""
    values = _values(reader, q, lo, hi, c0, c1)
    scale = _spread(reader, q.parts[1], q.arg("grid"), lo, hi, c0, c1)
    if q.scheme == "ct-nvfp4":
        gs = q.parts[2]
        return ct.nvfp4(values, scale, reader.block(gs, (0,) * len(gs.shape), gs.shape), dtype)
    if q.scheme == "ct-mxfp4":
        return ct.mxfp4_pack(values, scale, dtype)
    zero = _zero(reader, q, lo, hi, c0, c1) if q.arg("zero") else None
    return ct.scaled(values, scale, zero, dtype)


def _values(reader: RowReader, q: Quantized, lo: int, hi: int, c0: int, c1: int) -> torch.Tensor:
    """The stored values of rows [lo, hi) x columns [c0, c1), decoded as compressed-tensors decodes them
    (fp8 as stored, ints as int8, FP4 as bf16)."""
    stored = q.parts[0]
    if q.scheme == "ct-fp8":
        return reader.block(stored, (lo, c0), (hi - lo, c1 - c0))
    if q.scheme == "ct-int":
        bits = q.arg("bits")
        g0, g1 = c0 // GROUP, -(-c1 // GROUP)
        w0, w1 = g0 * bits, min(g1 * bits, stored.shape[1])
        words = reader.block(stored, (lo, w0), (hi - lo, w1 - w0))
        return ct.unpack_int(words.contiguous(), bits, c1 - g0 * GROUP)[:, c0 - g0 * GROUP :]
    b0, b1 = c0 // 2, -(-c1 // 2)
    packed = reader.block(stored, (lo, b0), (hi - lo, b1 - b0))
    return ct.fp4_values(packed)[:, c0 - 2 * b0 : c1 - 2 * b0]


def _spread(
    reader: RowReader, s: StoredTensor, grid: tuple[int, int], lo: int, hi: int, c0: int, c1: int
) -> torch.Tensor:
    """The scales (or float zero points) of rows [lo, hi) x columns [c0, c1), one per value."""
    rows, cols = grid
    if len(s.shape) == 1:  # per tensor: [1]
        return reader.block(s, (0,), (1,)).reshape(1, 1).expand(hi - lo, c1 - c0)
    s0, k0 = lo // rows, c0 // cols
    block = reader.block(s, (s0, k0), ((hi - 1) // rows + 1 - s0, (c1 - 1) // cols + 1 - k0))
    return _cells(block, torch.arange(lo, hi) // rows - s0, torch.arange(c0, c1) // cols - k0)


def _zero(reader: RowReader, q: Quantized, lo: int, hi: int, c0: int, c1: int) -> torch.Tensor:
    """The zero points of rows [lo, hi) x columns [c0, c1), one per value; pack-quantized ones are int32
    words packed along the rows (pack_to_int32 packed_dim=0)."""
    zero = q.parts[-1]
    grid = q.arg("grid")
    if q.scheme != "ct-int":
        return _spread(reader, zero, grid, lo, hi, c0, c1)
    bits, cols = q.arg("bits"), grid[1]
    g0, g1 = lo // GROUP, -(-hi // GROUP)
    w0, w1 = g0 * bits, min(g1 * bits, zero.shape[0])
    k0, k1 = c0 // cols, (c1 - 1) // cols + 1
    words = reader.block(zero, (w0, k0), (w1 - w0, k1 - k0))  # [words, k]
    points = ct.unpack_int(words.t().contiguous(), bits, hi - g0 * GROUP)[:, lo - g0 * GROUP :]  # [k, rows]
    return _cells(points.t(), torch.arange(hi - lo), torch.arange(c0, c1) // cols - k0)


def _cells(block: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """block[rows[i], cols[j]] for every (i, j): a cell's one value spread over the values it covers."""
    return block[rows.unsqueeze(1), cols.unsqueeze(0)]
