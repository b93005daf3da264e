"""Reading a block of a quantized HF weight (`hf_quant`'s logical tensor) as dequantized values.

Only the stored rows (and column groups) the block covers are read, with only their scale rows:

    block FP8  logical [R, C], block rows [r0, r1) x cols [c0, c1), blocks br x bc (square; MXFP8's and
               "dsv4-fp8"'s too: 1 x 32, 128 x 128)
               reads weight [r0, r1) x [c0 // bc * bc, c1) and scale rows / cols `fp8.scale_rows` of those
    MXFP4      logical [E, I, O] (in = I = G*32, out = O), block [e0, e1) x [i0, i1) x [o0, o1)
               reads blocks [e0, e1) x [o0, o1) x groups [i0 // 32, ceil(i1 / 32)) x 16, scales the same

    FP4 groups NVFP4 and "dsv4-fp4": `dequant_fp4`
    per tensor ModelOpt's FP8 ("modelopt-fp8"): the block's rows and the one scale

and dequantizes a slab at a time (FP8: `FP8_ROWS` weight rows, at least one scale row; MXFP4: `MX_VALUES`
values of one expert), so the temporaries are a slab's, whatever the block. Values are the fp32 product
rounded once to the `dtype` asked for (`quant.fp8.dequantize`, `quant.mxfp4.dequantize`,
`quant.nvfp4.dequantize`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from ckptconv.core.specs import StoredTensor
from ckptconv.formats.dequant_ct import ct_block
from ckptconv.formats.dequant_fp4 import fp4_block
from ckptconv.quant import fp8, mxfp4


class RowReader(Protocol):
    """What dequantizing reads through (`safetensors_io.RowReader` is one): a block of a stored tensor."""

    def block(
        self, t: StoredTensor, offsets: Sequence[int], sizes: Sequence[int], dtype: torch.dtype | None = None
    ) -> torch.Tensor: ...


class BlockReader(Protocol):
    """One scheme's dequantizer: the block of logical `t` at `offsets` of `sizes` into `out` (its dtype)."""

    def __call__(
        self,
        reader: RowReader,
        t: StoredTensor,
        offsets: Sequence[int],
        sizes: Sequence[int],
        out: torch.Tensor,
    ) -> None: ...


MX_VALUES = 2**20  # MXFP4 values decoded at a time (fp32 temporaries of a few MiB)
FP8_ROWS = 128  # FP8 weight rows dequantized at a time (one scale row when its blocks are taller)


def quantized_block(
    reader: RowReader,
    t: StoredTensor,
    offsets: Sequence[int],
    sizes: Sequence[int],
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The block of logical tensor `t` at `offsets` of `sizes`, dequantized to `dtype` (into `out` if given:
    contiguous, of `sizes` and `dtype`)."""
    assert t.quant is not None
    if out is None:
        out = torch.empty(tuple(sizes), dtype=dtype)
    if out.numel():
        SCHEMES[t.quant.scheme](reader, t, offsets, sizes, out)
    return out


def _fp8_block(
    reader: RowReader, t: StoredTensor, offsets: Sequence[int], sizes: Sequence[int], out: torch.Tensor
) -> None:
    """Weight [R, C] fp8 + scale [ceil(R/br), ceil(C/bc)] -> out [r1 - r0, c1 - c0], `FP8_ROWS` weight rows
    (at least one scale row) at a time. Blocks br x bc: `block_size` of the scheme's args, else square."""
    assert t.quant is not None
    weight, scale = t.quant.parts
    br, bc = block_shape(t.quant.arg("block_size"), t.quant.block)
    (r0, c0), (nr, nc) = offsets, sizes
    a0 = c0 // bc * bc  # the columns start where their first block does
    q = reader.block(weight, (r0, a0), (nr, c0 + nc - a0))  # [nr, c1 - a0] fp8
    s0, s1 = fp8.scale_rows(r0, r0 + nr, br)
    k0, k1 = fp8.scale_rows(a0, c0 + nc, bc)
    s = reader.block(scale, (s0, k0), (s1 - s0, k1 - k0))  # [s1 - s0, k1 - k0]
    if s.dtype == torch.uint8:  # E8M0 stored as bytes (scale_fmt "ue8m0"), as transformers views them
        s = s.view(torch.float8_e8m0fnu)
    step = max(1, FP8_ROWS // br)  # scale rows a slab
    for i in range(s0, s1, step):
        j = min(i + step, s1)
        lo, hi = max(r0, i * br), min(r0 + nr, j * br)
        rows = fp8.dequantize(q[lo - r0 : hi - r0], s[i - s0 : j - s0], out.dtype, br, bc, lo - i * br)
        out[lo - r0 : hi - r0] = rows[:, c0 - a0 :]


def _per_tensor_block(
    reader: RowReader, t: StoredTensor, offsets: Sequence[int], sizes: Sequence[int], out: torch.Tensor
) -> None:
    """Weight [R, C] fp8 + one scale (ModelOpt's FP8) -> out: q.to(dtype) * scale.to(dtype), the product in
    the dtype asked as ModelOpt's FP8QTensor.dequantize computes it, `FP8_ROWS` rows at a time."""
    assert t.quant is not None
    weight, scale = t.quant.parts
    s = reader.block(scale, [0] * len(scale.shape), scale.shape).reshape(()).to(out.dtype)
    (r0, c0), (nr, nc) = offsets, sizes
    for lo in range(0, nr, FP8_ROWS):
        hi = min(lo + FP8_ROWS, nr)
        out[lo:hi] = reader.block(weight, (r0 + lo, c0), (hi - lo, nc)).to(out.dtype) * s


def block_shape(size: object, block: int) -> tuple[int, int]:
    """(rows, cols) of an FP8 scale's block: the scheme's `block_size` arg, else `block` x `block`."""
    if isinstance(size, tuple) and len(size) == 2:
        return int(size[0]), int(size[1])
    return block, block


def _mxfp4_block(
    reader: RowReader, t: StoredTensor, offsets: Sequence[int], sizes: Sequence[int], out: torch.Tensor
) -> None:
    """blocks [E, O, G, 16] + scales [E, O, G] -> out [e1 - e0, i1 - i0, o1 - o0], the logical [E, I, O]
    (transposed) layout."""
    assert t.quant is not None
    blocks, scales = t.quant.parts
    (e0, i0, o0), (ne, ni, no) = offsets, sizes
    g0, g1 = i0 // mxfp4.GROUP, -(-(i0 + ni) // mxfp4.GROUP)
    packed = reader.block(blocks, (e0, o0, g0, 0), (ne, no, g1 - g0, mxfp4.BYTES))  # [ne, no, g, 16]
    exps = reader.block(scales, (e0, o0, g0), (ne, no, g1 - g0))  # [ne, no, g]
    step = max(1, MX_VALUES // ((g1 - g0) * mxfp4.GROUP))  # stored rows decoded at a time
    skip = i0 - g0 * mxfp4.GROUP
    for e in range(ne):
        for lo in range(0, no, step):
            hi = min(lo + step, no)
            values = mxfp4.dequantize(packed[e, lo:hi], exps[e, lo:hi], out.dtype)  # [hi - lo, g*32]
            out[e, :, lo:hi] = values[:, skip : skip + ni].t()


SCHEMES: dict[str, BlockReader] = {  # Quantized.scheme -> its dequantizer (`quant.schemes.READ` names them)
    "fp8": _fp8_block,
    "mxfp4": _mxfp4_block,
    "ct-fp8": ct_block,  # compressed-tensors: formats.dequant_ct
    "ct-int": ct_block,
    "ct-nvfp4": ct_block,
    "ct-mxfp4": ct_block,
    "mxfp8": _fp8_block,
    "nvfp4": fp4_block,
    "dsv4-fp8": _fp8_block,
    "dsv4-fp4": fp4_block,
    "modelopt-fp8": _per_tensor_block,
}
