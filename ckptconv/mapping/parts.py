"""A `Part`: one block of a source tensor copied into one block of a target tensor. Pure geometry.

Every mapping operation becomes parts: a rename is one whole part; a stack one part per expert; a transpose
a part whose block's dims are reordered (`axes`); an interleaved split a part reading every n-th row
(`src_steps`); a grouped QKV split one part per KV group. Both converters execute parts alike
(`ckptconv.stream.blocks.place`), so an operation written once works both ways, on any sharding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in a tensor's global coordinates


@dataclass(frozen=True)
class Part:
    """Copy the source block into the target block.

    The source block is `src_sizes[d]` elements along each dim d, at `src_offsets[d] + k * src_steps[d]`
    (steps default to 1); likewise the target block. The source block, its dims reordered by `axes`
    (default: as they are), holds the same elements in the same order as the target block once size-1 dims
    are dropped: `[1, F, D]` lands in `[F, D]` (unstack), `[E, D, F]` with axes (0, 2, 1) in `[E, F, D]`.
    With `perm` (only on a part without steps or axes), target row r of the block is source row `perm[r]`.
    """

    src: str
    src_offsets: tuple[int, ...]
    src_sizes: tuple[int, ...]
    dst_offsets: tuple[int, ...]
    dst_sizes: tuple[int, ...]
    perm: tuple[int, ...] | None = None
    src_steps: tuple[int, ...] | None = None
    dst_steps: tuple[int, ...] | None = None
    axes: tuple[int, ...] | None = None

    @property
    def plain(self) -> bool:
        """No permutation, no steps, no reordered dims: a block copied as it is."""
        return self.perm is None and self.src_steps is None and self.dst_steps is None and self.axes is None

    @property
    def numel(self) -> int:
        return math.prod(self.src_sizes)

    def step(self, side: str, dim: int) -> int:
        steps = self.src_steps if side == "src" else self.dst_steps
        return steps[dim] if steps else 1

    def src_box(self) -> Box:
        """The smallest block of the source holding every element the part reads."""
        return _span(self.src_offsets, self.src_sizes, self.src_steps)

    def dst_box(self) -> Box:
        return _span(self.dst_offsets, self.dst_sizes, self.dst_steps)

    @cached_property
    def dims(self) -> tuple[int | None, ...]:
        """For each target dim, the source dim that feeds it (None: a size-1 dim with no counterpart)."""
        order = self.axes if self.axes is not None else tuple(range(len(self.src_sizes)))
        src = [d for d in order if self.src_sizes[d] != 1]
        dst = [d for d, n in enumerate(self.dst_sizes) if n != 1]
        out: list[int | None] = [None] * len(self.dst_sizes)
        for s, d in zip(src, dst, strict=True):
            out[d] = s
        return tuple(out)

    def problem(self) -> str | None:
        """Why the two blocks cannot correspond, or None."""
        order = self.axes if self.axes is not None else tuple(range(len(self.src_sizes)))
        if sorted(order) != list(range(len(self.src_sizes))):
            return f"axes {list(order)} are not a reordering of {len(self.src_sizes)} dims"
        src = [self.src_sizes[d] for d in order if self.src_sizes[d] != 1]
        dst = [n for n in self.dst_sizes if n != 1]
        if src != dst:
            return f"a block of {list(self.src_sizes)} does not fit a block of {list(self.dst_sizes)}"
        if self.perm is not None and not (
            self.src_steps is None and self.dst_steps is None and not self.axes
        ):
            return "a row permutation only applies to a plain block"
        return None


def _span(offsets: tuple[int, ...], sizes: tuple[int, ...], steps: tuple[int, ...] | None) -> Box:
    if steps is None:
        return offsets, sizes
    return offsets, tuple((n - 1) * s + 1 if n else 0 for n, s in zip(sizes, steps, strict=True))


def lattice(offset: int, count: int, step: int, lo: int, hi: int) -> tuple[int, int]:
    """The k in [0, count) with lo <= offset + k * step < hi, as [k0, k1) (k0 >= k1: none)."""
    k0 = max(0, -((offset - lo) // step)) if lo > offset else 0
    k1 = min(count, (hi - 1 - offset) // step + 1) if hi > offset else 0
    return k0, k1


def src_rows(part: Part, lo: int, hi: int) -> tuple[int, int] | None:
    """The source rows (dim 0) a part needs to fill target rows [lo, hi); None when it fills none of them.

    When target dim 0 comes from another source dim (a transpose of dim 0) or from no dim (a stacked
    element), every row of the part's source block is needed."""
    if not part.dst_sizes:
        return (0, 1)
    k0, k1 = lattice(part.dst_offsets[0], part.dst_sizes[0], part.step("dst", 0), lo, hi)
    if k0 >= k1:
        return None
    if not part.src_sizes:
        return (0, 1)
    (start,), (span,) = (part.src_offsets[0],), (part.src_box()[1][0],)
    if part.perm is not None:
        wanted = part.perm[k0:k1]
        return start + min(wanted), start + max(wanted) + 1
    if part.dims[0] != 0:
        return start, start + span
    step = part.step("src", 0)
    return start + k0 * step, start + (k1 - 1) * step + 1
