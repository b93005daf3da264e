"""Execute a mapping `Part` on data: copy what a block of source data holds of the part into the target.

One function for both converters: dcp-to-hf places each stored chunk (or slab of its rows) as it arrives;
hf-to-dcp places the source rows a rank's target rows need (`window`: the target rows `out` covers). Casts as
torch does; holds nothing beyond the data given (a permuted piece: its rows gathered once).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ckptconv.mapping.parts import Box, Part, lattice


def strided(
    t: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int], steps: Sequence[int]
) -> torch.Tensor:
    """The view of `t` holding `sizes[d]` elements at `offsets[d] + k * steps[d]` along each dim d."""
    for dim, (offset, size, step) in enumerate(zip(offsets, sizes, steps, strict=True)):
        t = t.narrow(dim, offset, (size - 1) * step + 1 if size else 0)
        if step != 1:
            index: list[slice] = [slice(None)] * t.dim()
            index[dim] = slice(None, None, step)
            t = t[tuple(index)]
    return t


def shifted(values: torch.Tensor, offset: float | None, dtype: torch.dtype) -> torch.Tensor:
    """`values` + `offset` (a rule's `offset`) for a target of `dtype`: in float32, or float64 when the
    values or the target are float64; cast to the target's dtype by the copy that places them."""
    if offset is None:
        return values
    work = torch.float64 if torch.float64 in (values.dtype, dtype) else torch.float32
    return values.to(work) + offset


def place(
    out: torch.Tensor,
    part: Part,
    box: Box,
    data: torch.Tensor,
    window: int | None = None,
    shift: float | None = None,
) -> None:
    """Copy the elements of `part` that `data` (block `box` of the part's source, global coordinates)
    holds into `out`: the whole target (in its layout), or target rows [window, window + len(out)); with
    `shift`, each value plus `shift` (`shifted`: a rule's `offset`)."""
    if not part.numel:
        return
    ndim = len(part.src_sizes)
    k0, count = [0] * ndim, [1] * ndim
    starts, steps = [0] * ndim, [1] * ndim
    for d in range(ndim):
        offset, size, step = part.src_offsets[d], part.src_sizes[d], part.step("src", d)
        lo, hi = box[0][d], box[0][d] + box[1][d]
        a, b = lattice(offset, size, step, lo, hi)
        if a >= b:
            return
        k0[d], count[d], starts[d], steps[d] = a, b - a, offset + a * step - lo, step
    values = strided(data, starts, count, steps)
    if part.axes is not None:
        values = values.permute(part.axes)
    dims = part.dims
    dst_k0 = [0 if s is None else k0[s] for s in dims]
    dst_count = [1 if s is None else count[s] for s in dims]
    values = shifted(values.reshape(dst_count), shift, out.dtype)
    dst_start = [part.dst_offsets[d] + dst_k0[d] * part.step("dst", d) for d in range(len(dims))]
    dst_steps = [part.step("dst", d) for d in range(len(dims))]
    if part.perm is not None:  # a plain block: dst_k0[0] and dst_count[0] are source rows of the block
        _place_permuted(out, part, dst_k0[0], dst_count[0], values, dst_start, dst_count, window)
        return
    if window is not None and dims:
        a, b = lattice(dst_start[0], dst_count[0], dst_steps[0], window, window + out.shape[0])
        if a >= b:
            return
        values = values.narrow(0, a, b - a)
        dst_start[0] += a * dst_steps[0] - window
        dst_count[0] = b - a
    strided(out, dst_start, dst_count, dst_steps).copy_(values)


def _place_permuted(
    out: torch.Tensor,
    part: Part,
    first: int,
    rows: int,
    values: torch.Tensor,
    dst_start: list[int],
    dst_count: list[int],
    window: int | None,
) -> None:
    """Target row r of the block is source row perm[r]: the source rows [first, first + rows) of the block,
    held in `values`, land in the target rows that name them (within the window)."""
    perm = part.perm or ()
    base = part.dst_offsets[0] - (window or 0)
    dst_rows = [r for r, s in enumerate(perm) if first <= s < first + rows and 0 <= base + r < out.shape[0]]
    if not dst_rows:
        return
    target = out
    for dim in range(1, len(dst_start)):
        target = target.narrow(dim, dst_start[dim], dst_count[dim])
    index = torch.tensor([base + r for r in dst_rows], dtype=torch.long)
    picked = values[torch.tensor([perm[r] - first for r in dst_rows], dtype=torch.long)].to(out.dtype)
    bits = _BITS.get(out.dtype.itemsize)  # index_copy_ has no kernel for fp8 and other dtypes: copy the bits
    if bits is not None:
        target, picked = target.view(bits), picked.view(bits)
    target.index_copy_(0, index, picked)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
