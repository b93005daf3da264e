"""Reading a block of an FP4 weight with a scale per group (ModelOpt NVFP4, DeepSeek-V4's routed experts) as
dequantized values (`quant.nvfp4.dequantize`), reading only the rows and column groups the block covers.

    layout "rows"  packed [..., O, I/2], scale [..., O, ceil(I/g)]          ->  logical [..., O, I]
    layout "bmm"   packed [E, I/2, O], scale [E, ceil(I/g), O] (ModelOpt's  ->  logical [E, I, O]
                   export of Llama4 / gpt-oss bmm experts: the [E, in, out] layout, packed along in)
    global scale   parts[2] when there is one: one value, or one per expert ([E], [E, 1] or [E, 1, 1])

A block [.., r0:r1, c0:c1] reads packed bytes [c0 // g * g / 2, ceil(c1 / g) * g / 2) of its rows and scale
columns [c0 // g, ceil(c1 / g)), and decodes `FP4_VALUES` values at a time (fp32 temporaries of a few MiB).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from ckptconv.core.specs import StoredTensor
from ckptconv.quant import nvfp4


class RowReader(Protocol):
    """What dequantizing reads through (`dequant.RowReader`, restated: dequant imports this module)."""

    def block(
        self, t: StoredTensor, offsets: Sequence[int], sizes: Sequence[int], dtype: torch.dtype | None = None
    ) -> torch.Tensor: ...


FP4_VALUES = 2**20  # values decoded at a time


def fp4_block(
    reader: RowReader, t: StoredTensor, offsets: Sequence[int], sizes: Sequence[int], out: torch.Tensor
) -> None:
    """The block of logical `t` at `offsets` of `sizes` into `out` (its dtype)."""
    q = t.quant
    assert q is not None
    packed, scale = q.parts[:2]
    group = q.block
    bmm = q.arg("layout") == "bmm"
    lead = len(sizes) - 2
    k = lead + (0 if bmm else 1)  # the logical dim the values are packed along (in)
    c0, nc = offsets[k], sizes[k]
    g0, g1 = c0 // group, -(-(c0 + nc) // group)
    b0, b1 = g0 * group // 2, min(g1 * group // 2, packed.shape[k])
    off_p, size_p = list(offsets), list(sizes)
    off_p[k], size_p[k] = b0, b1 - b0
    off_s, size_s = list(offsets), list(sizes)
    off_s[k], size_s[k] = g0, g1 - g0
    pk = reader.block(packed, off_p, size_p)
    sc = reader.block(scale, off_s, size_s)
    if sc.dtype == torch.uint8:  # E8M0 stored as bytes
        sc = sc.view(torch.float8_e8m0fnu)
    glob = _global(reader, q.parts[2], offsets[0], sizes[0]) if len(q.parts) > 2 else None
    skip = c0 - g0 * group
    zero = q.scheme != "nvfp4"  # ModelOpt's table decodes E2M1's -0 as +0.0
    if lead == 0:
        _decode(pk, sc, glob, group, skip, nc, out, zero)
        return
    for e in range(sizes[0]):
        g = None if glob is None else glob[e] if glob.numel() > 1 else glob[0]
        if bmm:  # decode [O, I] rows, written transposed
            _decode(pk[e].t(), sc[e].t(), g, group, skip, nc, out[e].t(), zero)
        else:
            _decode(pk[e], sc[e], g, group, skip, nc, out[e], zero)


def _global(reader: RowReader, part: StoredTensor, e0: int, ne: int) -> torch.Tensor:
    """The global scale as a flat fp32 tensor: one value, or the experts' [e0, e0 + ne)."""
    if part.shape and part.shape[0] > 1:
        whole = reader.block(part, (e0, *[0] * (len(part.shape) - 1)), (ne, *part.shape[1:]))
    else:
        whole = reader.block(part, [0] * len(part.shape), part.shape)
    return whole.reshape(-1).to(torch.float32)


def _decode(
    pk: torch.Tensor,
    sc: torch.Tensor,
    glob: torch.Tensor | None,
    group: int,
    skip: int,
    n: int,
    out: torch.Tensor,
    negative_zero: bool,
) -> None:
    """Rows of packed `pk` [R, P] and scales `sc` [R, G] -> out [R, n] (values `skip` .. skip + n of each
    row), a slab of rows at a time."""
    step = max(1, FP4_VALUES // max(1, pk.shape[1] * 2))
    for lo in range(0, pk.shape[0], step):
        hi = min(lo + step, pk.shape[0])
        values = nvfp4.dequantize(pk[lo:hi], sc[lo:hi], out.dtype, group, glob, negative_zero)
        out[lo:hi] = values[:, skip : skip + n]
