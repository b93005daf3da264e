"""Pure geometry of blocks in a global tensor: tiling checks and intersections (no tensors, no I/O)."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from itertools import chain, compress, pairwise
from operator import add, and_, itemgetter, sub

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)

CORNER_DIMS = 6  # cut dims up to which blocks' corners are counted exactly (2**6 terms a block at most)
PRIME = 2**127 - 1  # beyond: the same identity, evaluated at a random point modulo this prime


def tiling_problem(shape: Sequence[int], boxes: Sequence[Box]) -> str | None:
    """Why `boxes` do not cover `shape` exactly once (a hole, an overlap, out of bounds), or None if they do.

    Exact duplicates (the same block stored twice) are allowed: they hold the same data by construction.
    Never compares pairs of blocks: the usual case (every block one cell of the grid of all block boundaries,
    as DTensor shards are) is passes in C over each dimension, and any other layout is checked by counting
    the blocks' corners (`_cover_problem`), in O(n log n) for n blocks.
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
    return _cover_problem(shape, unique, cuts, total)


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


def _cover_problem(
    shape: tuple[int, ...], boxes: list[Box], cuts: list[tuple[list[int], list[int]]], total: int
) -> str | None:
    """None if `boxes` (distinct, non-empty, inside `shape`, with `total` elements together: as many as the
    tensor) cover every element once; else the overlap (with a hole elsewhere) they hide.

    In one dim a block [s, e) is its corners delta(s) - delta(e); in many, the product of those. Summed over
    the blocks, the corners cancel down to the tensor's own exactly when every element is covered once
    (their prefix sums are how often each element is covered). Dims no block cuts are left out; a block
    reaching the tensor's end in a dim has one corner there (delta(n) is the tensor's own, taken as zero).
    Up to `CORNER_DIMS` cut dims, the corners are compared as sorted integers; beyond, as the polynomials
    sum_blocks prod_dims (x^s - x^e) and prod_dims (1 - x^n), at a random point (`_same_polynomial`)."""
    cut = [d for d, (starts, ends) in enumerate(cuts) if max(starts) > 0 or min(ends) < shape[d]]
    sizes, cut_cuts = [shape[d] for d in cut], [cuts[d] for d in cut]
    if len(cut) > CORNER_DIMS:
        if _same_polynomial(sizes, cut_cuts):
            return None
        return f"chunks cover {total} elements, as many as the tensor has, but some twice (an overlap)"
    residual = _corner_residual(sizes, cut_cuts)
    if not residual:
        return None
    code = min(residual)  # lexicographically the first element whose coverage is wrong: covered 1 + residual
    point = [0] * len(shape)
    for d, w in zip(cut, _weights(sizes), strict=True):
        point[d] = code // w % shape[d]
    if residual[code] < 0:
        return f"chunks cover {total} elements, as many as the tensor has, but not {point} (an overlap)"
    holds = [True] * len(boxes)  # the blocks that hold `point`: two at least (passes in C, as all above)
    for d in cut:
        starts, ends = cuts[d]
        holds = list(map(and_, holds, map(and_, map(point[d].__ge__, starts), map(point[d].__lt__, ends))))
    (a, _), (b, _) = list(compress(boxes, holds))[:2]
    return f"chunk at {list(a)} overlaps chunk at {list(b)} (both hold element {point})"


def _weights(sizes: list[int]) -> list[int]:
    """The place value of each cut dim in a corner's code: mixed radix, the first dim the most significant,
    so codes sort as the corners do (lexicographically)."""
    out, w = [], 1
    for n in reversed(sizes):
        out.append(w)
        w *= n
    return out[::-1]


def _corner_residual(sizes: list[int], cuts: list[tuple[list[int], list[int]]]) -> dict[int, int]:
    """The blocks' corners less the tensor's, by code (a count: how many more blocks add the corner than
    take it away); empty exactly when the blocks tile. 2**dims passes, each in C over all blocks, then two
    sorts: O(n log n) for n blocks."""
    weights = _weights(sizes)
    lows = [list(map(w.__mul__, starts)) for w, (starts, _) in zip(weights, cuts, strict=True)]
    highs = [list(map(w.__mul__, ends)) for w, (_, ends) in zip(weights, cuts, strict=True)]
    inner = [list(map(n.__gt__, ends)) for n, (_, ends) in zip(sizes, cuts, strict=True)]  # an end of its own
    plus: list[int] = []
    minus: list[int] = [0]  # the tensor's own corner
    for mask in range(1 << len(sizes)):
        at_end = [(mask >> d) & 1 for d in range(len(sizes))]
        codes, keep = lows[0] if not at_end[0] else highs[0], inner[0] if at_end[0] else None
        for d in range(1, len(sizes)):
            codes = list(map(add, codes, highs[d] if at_end[d] else lows[d]))
            if at_end[d]:
                keep = inner[d] if keep is None else list(map(and_, keep, inner[d]))
        (minus if sum(at_end) % 2 else plus).extend(codes if keep is None else compress(codes, keep))
    plus.sort()
    minus.sort()
    if plus == minus:
        return {}
    more, fewer = Counter(plus), Counter(minus)
    return {**(more - fewer), **{c: -n for c, n in (fewer - more).items()}}


def _same_polynomial(sizes: list[int], cuts: list[tuple[list[int], list[int]]]) -> bool:
    """Whether sum_blocks prod_dims (x_d^s - x_d^e) equals prod_dims (1 - x_d^n) at a random point modulo
    `PRIME`: always when the blocks tile; otherwise with probability at most sum(sizes) / PRIME (< 2**-57).
    Each power is computed once per distinct coordinate."""
    rng = random.SystemRandom()
    values = [1] * len(cuts[0][0])
    outer = 1
    for n, (starts, ends) in zip(sizes, cuts, strict=True):
        x = rng.randrange(2, PRIME - 1)
        power = {c: pow(x, c, PRIME) for c in {0, n, *starts, *ends}}
        factors = map(sub, map(power.__getitem__, starts), map(power.__getitem__, ends))
        values = [v * f % PRIME for v, f in zip(values, factors, strict=True)]
        outer = outer * (1 - power[n]) % PRIME
    return (sum(values) - outer) % PRIME == 0


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


def shard_rows(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """The rows [lo, hi) `rank` holds under `Shard(0)`: torch.chunk's split, as DTensor and FSDP2 use it."""
    step = -(-rows // world_size) if rows else 0
    return min(rank * step, rows), min((rank + 1) * step, rows)
