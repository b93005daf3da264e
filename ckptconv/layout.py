"""Pure geometry of blocks in a global tensor: tiling checks and intersections (no tensors, no I/O)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from itertools import chain, pairwise
from operator import add, itemgetter, sub

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)

_MAX_GRID_CELLS = 4_000_000


def tiling_problem(shape: Sequence[int], boxes: Sequence[Box]) -> str | None:
    """Why `boxes` do not cover `shape` exactly once (a hole, an overlap, out of bounds), or None if they do.

    Exact duplicates (the same block stored twice) are allowed: they hold the same data by construction.
    Works on the grid of all block boundaries, so its cost is the number of grid cells, not pairs of blocks;
    the checks of the usual case (every block one cell of that grid) are passes in C over each dimension.
    """
    shape = tuple(shape)
    unique = list(dict.fromkeys(boxes if _all_tuples(boxes) else ((tuple(o), tuple(s)) for o, s in boxes)))
    numels = list(map(math.prod, map(_SIZES, unique)))
    if 0 in numels:
        unique = [b for b, n in zip(unique, numels, strict=True) if n]
        numels = list(filter(None, numels))
    rank = len(shape)
    if (set(map(len, map(_OFFSETS, unique))) | set(map(len, map(_SIZES, unique)))) - {rank}:
        sizes = next(s for o, s in unique if len(o) != rank or len(s) != rank)
        return f"a chunk has rank {len(sizes)} but the tensor has rank {rank}"
    cuts = []
    for d, n in enumerate(shape):
        starts = list(map(itemgetter(d), map(_OFFSETS, unique)))
        ends = list(map(add, starts, map(itemgetter(d), map(_SIZES, unique))))
        if unique and (min(starts) < 0 or min(map(sub, ends, starts)) < 0 or max(ends) > n):
            offsets, sizes = next(
                b for b, lo, hi in zip(unique, starts, ends, strict=True) if not 0 <= lo <= hi <= n
            )
            return f"chunk at {list(offsets)} of size {list(sizes)} lies outside shape {list(shape)}"
        cuts.append((starts, ends))
    total = math.prod(shape)
    covered = sum(numels)
    if covered < total:
        return f"chunks cover {covered} of {total} elements (a hole)"
    if covered > total:
        return f"chunks cover {covered} elements of a tensor of {total} (an overlap)"
    if total == 0 or len(unique) <= 1:
        return None
    grid = [sorted({0, n, *starts, *ends}) for n, (starts, ends) in zip(shape, cuts, strict=True)]
    if _one_cell_each(grid, cuts, len(unique)):
        return None
    if math.prod(len(c) - 1 for c in grid) <= _MAX_GRID_CELLS:
        return _grid_overlap(grid, unique)
    return _pairwise_overlap(unique)


_OFFSETS, _SIZES = itemgetter(0), itemgetter(1)


def _all_tuples(boxes: Sequence[Box]) -> bool:
    return set(map(type, chain(map(_OFFSETS, boxes), map(_SIZES, boxes)))) <= {tuple}


def _one_cell_each(grid: list[list[int]], cuts: list[tuple[list[int], list[int]]], count: int) -> bool:
    """True when every box is exactly one cell of the grid and there are as many (distinct) boxes as cells:
    then they tile the tensor (how a DTensor's shards are laid out). In each dimension a box's interval must
    be one between neighbouring grid lines; boxes that pass are distinct cells because distinct boxes then
    differ in an offset. False means "not shown", never "overlaps"."""
    if math.prod(len(c) - 1 for c in grid) != count:
        return False
    for lines, (starts, ends) in zip(grid, cuts, strict=True):
        if not set(zip(starts, ends, strict=True)) <= set(pairwise(lines)):
            return False
    return True


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
