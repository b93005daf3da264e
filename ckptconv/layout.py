"""Pure geometry of blocks in a global tensor: tiling checks and intersections (no tensors, no I/O)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)

_MAX_GRID_CELLS = 4_000_000


def tiling_problem(shape: Sequence[int], boxes: Sequence[Box]) -> str | None:
    """Why `boxes` do not cover `shape` exactly once (a hole, an overlap, out of bounds), or None if they do.

    Exact duplicates (the same block stored twice) are allowed: they hold the same data by construction.
    Works on the grid of all block boundaries, so its cost is the number of grid cells, not pairs of blocks.
    """
    shape = tuple(shape)
    unique = [b for b in dict.fromkeys((tuple(o), tuple(s)) for o, s in boxes) if math.prod(b[1]) > 0]
    for offsets, sizes in unique:
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            return f"a chunk has rank {len(sizes)} but the tensor has rank {len(shape)}"
        for o, s, n in zip(offsets, sizes, shape, strict=True):
            if o < 0 or s < 0 or o + s > n:
                return f"chunk at {list(offsets)} of size {list(sizes)} lies outside shape {list(shape)}"
    total = math.prod(shape)
    covered = sum(math.prod(s) for _, s in unique)
    if covered < total:
        return f"chunks cover {covered} of {total} elements (a hole)"
    if covered > total:
        return f"chunks cover {covered} elements of a tensor of {total} (an overlap)"
    if total == 0 or len(unique) <= 1:
        return None
    cuts = [
        sorted({0, n, *(o[d] for o, _ in unique), *(o[d] + s[d] for o, s in unique)})
        for d, n in enumerate(shape)
    ]
    if _one_cell_each(cuts, unique):
        return None
    if math.prod(len(c) - 1 for c in cuts) <= _MAX_GRID_CELLS:
        return _grid_overlap(cuts, unique)
    return _pairwise_overlap(unique)


def _one_cell_each(cuts: list[list[int]], boxes: list[Box]) -> bool:
    """True when every box is exactly one cell of the grid, each a different cell, and there are as many
    boxes as cells: then they tile the tensor (how a DTensor's shards are laid out; checked in O(boxes)
    instead of walking cells). False means "not shown", never "overlaps"."""
    if math.prod(len(c) - 1 for c in cuts) != len(boxes):
        return False
    index = [{x: i for i, x in enumerate(c)} for c in cuts]
    cells = set()
    for offsets, sizes in boxes:
        cell = []
        for d, (o, s) in enumerate(zip(offsets, sizes, strict=True)):
            i = index[d].get(o)
            if i is None or cuts[d][i + 1] != o + s:
                return False
            cell.append(i)
        cells.add(tuple(cell))
    return len(cells) == len(boxes)


def _grid_overlap(cuts: list[list[int]], boxes: list[Box]) -> str | None:
    seen: set[tuple[int, ...]] = set()
    for offsets, sizes in boxes:
        ranges = [
            range(bisect.bisect_left(c, o), bisect.bisect_left(c, o + s))
            for c, o, s in zip(cuts, offsets, sizes, strict=True)
        ]
        for cell in _product(ranges):
            if cell in seen:
                return f"chunk at {list(offsets)} overlaps another chunk"
            seen.add(cell)
    return None


def _product(ranges: list[range]) -> list[tuple[int, ...]]:
    cells: list[tuple[int, ...]] = [()]
    for r in ranges:
        cells = [(*c, i) for c in cells for i in r]
    return cells


def _pairwise_overlap(boxes: list[Box]) -> str | None:
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            if intersect(a, b) is not None:
                return f"chunk at {list(a[0])} overlaps chunk at {list(b[0])}"
    return None


def intersect(a: Box, b: Box) -> Box | None:
    """The common block of `a` and `b` (global coordinates), None if they share no element."""
    offsets, sizes = [], []
    for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1], strict=True):
        lo, hi = max(ao, bo), min(ao + as_, bo + bs)
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return tuple(offsets), tuple(sizes)
