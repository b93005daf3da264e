"""Where a DTensor's local tensor lies in its global tensor, from its placements, as torch computes it.

torch's `_compute_local_shape_and_global_offset` (torch/distributed/tensor/_utils.py) follows each tensor
dim's global indices through the placements left to right: a `Shard(d)` over a mesh dim of k ranks keeps
the c-th of `torch.chunk`'s k pieces of the indices so far (pieces of ceil(n / k), the last ones short or
empty: FSDP2's uneven last shard); a `_StridedShard(d, split_factor=f)` first chunks them into f pieces,
each of those into k, and keeps the c-th of every piece, in order (FSDP2 over a dim TP sharded first). The
indices are kept here as runs (start, length), so a vocabulary of 150k rows costs a run, not 150k ints.

The local tensor is C-contiguous, so a set of runs in its first dim is one block per run (consecutive rows
of its bytes); runs in a later dim are not blocks, and are refused by name. A mesh dim that replicates the
tensor leaves one copy on each of its ranks: only coordinate 0's is taken.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ckptconv.formats.dtensor_pickle import Partial, Replicate, Shard, StridedShard
from ckptconv.formats.safe_pickle import short

Runs = list[tuple[int, int]]  # (first global index, count), in the local tensor's order
Block = tuple[tuple[int, ...], tuple[int, ...], int]  # global offsets, sizes, first row in the local tensor


class LayoutError(ValueError):
    """A spec that does not describe the local tensor it came with (the message says what)."""


def _length(runs: Runs) -> int:
    return sum(n for _, n in runs)


def _slice(runs: Runs, start: int, stop: int) -> Runs:
    """The runs of positions [start, stop) of the index list `runs` spells."""
    out: Runs = []
    pos = 0
    for first, n in runs:
        lo, hi = max(start, pos), min(stop, pos + n)
        if lo < hi:
            if out and out[-1][0] + out[-1][1] == first + lo - pos:
                out[-1] = (out[-1][0], out[-1][1] + hi - lo)
            else:
                out.append((first + lo - pos, hi - lo))
        pos += n
    return out


def _joined(runs: Runs) -> Runs:
    """`runs` with each run that continues the one before merged into it (the same indices)."""
    out: Runs = []
    for first, n in runs:
        if out and out[-1][0] + out[-1][1] == first:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((first, n))
    return out


def _chunk(runs: Runs, k: int, c: int) -> Runs:
    """The c-th of `torch.chunk(indices, k)` (empty past the pieces torch makes)."""
    n = _length(runs)
    size = -(-n // k)
    return _slice(runs, min(c * size, n), min((c + 1) * size, n))


def _int(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise LayoutError(f"{what} {short(value)} is not a non-negative integer")
    return value


def local_blocks(
    global_shape: Sequence[int],
    mesh: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Any],
    local_size: Sequence[int],
    shard_order: Any = None,
) -> list[Block]:
    """The blocks (global offsets, sizes, first local row) the local tensor of `local_size` holds, on the
    rank at `coordinate` of `mesh`; [] when another rank holds this copy (Replicate) or it is empty.
    `shard_order` (torch 2.10's `DTensorSpec.shard_order`: (tensor dim, mesh dims) pairs) must be the
    default, left to right; another order is refused."""
    if shard_order is not None and not isinstance(shard_order, tuple):
        raise LayoutError(f"a shard order of {type(shard_order).__name__}, not a tuple")
    for entry in shard_order or ():
        # ints checked before they are sorted or printed (a crafted entry can hold anything, nested deep)
        pair = isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], tuple)
        if not pair or type(entry[0]) is not int or any(type(m) is not int for m in entry[1]):
            raise LayoutError("a shard order entry that is not (tensor dim, mesh dims) of integers")
        dims = entry[1]
        if list(dims) != sorted(dims):
            raise LayoutError(f"a shard order {entry!r} other than left to right (not read by ckptconv)")
    if len(mesh) != len(placements) or len(coordinate) != len(mesh):
        raise LayoutError(
            f"{len(placements)} placements, a mesh of {len(mesh)} dims and a coordinate of {len(coordinate)}"
        )
    runs: list[Runs] = [[(0, _int(n, "a size"))] for n in global_shape]
    owner = True
    ranks = 1
    for k in mesh:
        ranks *= _int(k, "a mesh dim's size")
    for k, c, placement in zip(mesh, coordinate, placements, strict=True):
        if not 0 <= _int(c, "a coordinate") < k:
            raise LayoutError(f"coordinate {c} outside a mesh dim of {k}")
        if isinstance(placement, Replicate):
            owner = owner and c == 0
            continue
        if isinstance(placement, Partial):
            raise LayoutError("a Partial placement (partial sums: no rank holds the values)")
        if not isinstance(placement, Shard | StridedShard):
            raise LayoutError(f"a placement {type(placement).__name__}")
        d = _int(placement.dim, "a shard dim")
        if d >= len(runs):
            raise LayoutError(f"a Shard({d}) of a tensor of {len(runs)} dims")
        if isinstance(placement, StridedShard):
            f = _int(placement.split_factor, "a split factor")
            if f < 1:
                raise LayoutError("a split factor of 0")
            # torch's split factor is the product of the mesh dims that shard the dim after this one, so
            # never more than the mesh's ranks; a larger one would loop over that many pieces
            if f > ranks:
                raise LayoutError(f"a split factor of {f}, more than the {ranks} ranks of its mesh")
            runs[d] = _joined([r for piece in range(f) for r in _chunk(_chunk(runs[d], f, piece), k, c)])
            # each mesh dim sharding a dim at most multiplies its runs by its size: more than the mesh's
            # ranks is a crafted spec, refused before its runs multiply again
            if len(runs[d]) > ranks:
                raise LayoutError(f"its placements split dim {d} into more runs than its {ranks} ranks")
        else:
            runs[d] = _chunk(runs[d], k, c)
    sizes = tuple(_length(r) for r in runs)
    if sizes != tuple(local_size):
        raise LayoutError(f"its spec gives this rank {list(sizes)}, its local tensor is {list(local_size)}")
    if not owner or 0 in sizes:
        return []
    if not runs:  # a scalar
        return [((), (), 0)]
    for d, r in enumerate(runs[1:], 1):
        if len(r) > 1:
            raise LayoutError(f"its rows are strided in dim {d}, which ckptconv does not read")
    rest = tuple(r[0] for r in runs[1:])
    blocks: list[Block] = []
    row = 0
    for first, n in runs[0]:
        blocks.append(((first, *(s for s, _ in rest)), (n, *(m for _, m in rest)), row))
        row += n
    return blocks
