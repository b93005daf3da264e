"""The block operations of a rule, on the one tensor of its single side (the fused tensor F). Pure.

A rule relates F to the tensors of its other side (L_0 .. L_n-1, or one L). After `transpose` swaps two dims
of F (call the result F'), each operation below picks blocks of F' for each L; every dim below counts on F'.
Shapes, with the runtime tensor on the left:

    narrow    F' [V', D]             -> L [V, D]                 the first V rows (padding dropped)
    unstack   F' [E, F, D]           -> E x L [F, D]             one element per value of the placeholder
    unstack   F' [L, E, F, D]        -> L x E x L [F, D]         two placeholders: consecutive stacked dims
    split     F' [q+k+v, D]          -> L_0 [q, D], L_1 [k, D], L_2 [v, D]
    interleave F' [E, 2F, D]         -> L_0 [E, F, D] (rows 0, 2, ..), L_1 [E, F, D] (rows 1, 3, ..)
    unbind    F' [2, F, D]           -> L_0 [F, D] (F'[0]), L_1 [F, D] (F'[1])   (`dim` has one entry per L)
    unbind    F' [E, 2, F, D] (stacked over E, dim 1) -> E x L_0 [F, D], E x L_1 [F, D]
    grouped   F' [G*(a+b+c), D]      -> L_0 [G*a, D], L_1 [G*b, D], L_2 [G*c, D]   (per group g: a, b, c rows)
    transpose F  [E, D, 2F] (1, 2)   -> F' [E, 2F, D]
    repeated  F' [q+k+v+z, D], hf = [A, A, A, B] -> A [q+k+v, D] (the pieces of A in list order), B [z, D]
    hf_groups N with a repeated key: A = per group g [q_g | k_g | v_g] (each piece cut into N row groups)

They compose in that order: narrow, then unstack, then one split, then the pieces of a repeated key joined.
`pieces` lists, for each L, the blocks of F' it is made of and where each lands in L; `rules.py` turns them
into `Part`s in either direction.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from ckptconv.errors import CkptconvError

MAX_EMPTY_ELEMENTS = 2**16  # blocks an empty tensor may be cut into (stacked elements times groups)


@dataclass(frozen=True)
class Block:
    """`sizes[d]` elements of F' along each dim d, at `offsets[d] + k * steps[d]`."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    steps: tuple[int, ...]

    def at(self, dim: int, offset: int, size: int, step: int = 1) -> Block:
        """The sub-block whose dim `dim` starts `offset` elements in, with `size` elements `step` apart."""
        offsets, sizes, steps = list(self.offsets), list(self.sizes), list(self.steps)
        offsets[dim] += offset * steps[dim]
        sizes[dim] = size
        steps[dim] *= step
        return Block(tuple(offsets), tuple(sizes), tuple(steps))


@dataclass(frozen=True)
class Piece:
    """One tensor L of the other side: which pattern (`index`), which stacked element, its shape, and the
    blocks of F' it is made of, each with its offsets in L (the block's sizes less the stacked dim)."""

    index: int
    element: tuple[int, ...] | None  # its index along each stacked dim
    shape: tuple[int, ...]
    blocks: tuple[tuple[Block, tuple[int, ...]], ...]


@dataclass(frozen=True)
class Geometry:
    """A rule's block operations with every size resolved (from numbers and config.json)."""

    count: int = 1  # tensors on the other side
    transpose: tuple[int, int] | None = None
    narrow: int | None = None  # rows of `dim` kept
    stack_dims: tuple[int, ...] = ()  # one per stacked placeholder, consecutive
    dim: int = 0  # the dim split / interleaved / grouped / narrowed
    split: str | None = None  # "plain", "interleave", "grouped" or "unbind"
    sizes: tuple[int, ...] = ()  # plain: each L's size along dim; grouped: each L's rows per group
    groups: int = 1
    slots: tuple[int, ...] = ()  # repeated hf keys: for each L, the distinct key it is a piece of
    hf_groups: int = 1  # the row groups each repeated key is laid out in, piece after piece per group
    rule: int = 0  # the rule's number in its mapping file, for messages

    @property
    def dropped(self) -> tuple[int, ...]:
        """The dims of F' the other side's tensors lack: the stacked dims, and an unbind's `dim`."""
        return tuple(sorted(self.stack_dims + ((self.dim,) if self.split == "unbind" else ())))


def transposed(shape: tuple[int, ...], pair: tuple[int, int] | None, where: str = "") -> tuple[int, ...]:
    """`shape` with the dims of `pair` swapped; a dim it does not have is a CkptconvError (`where`)."""
    if pair is None:
        return shape
    a, b = pair
    if not (0 <= a < len(shape) and 0 <= b < len(shape)):
        raise CkptconvError(
            f"{where}: transpose {list(pair)} names a dim a tensor of shape {list(shape)} lacks"
        )
    out = list(shape)
    out[a], out[b] = out[b], out[a]
    return tuple(out)


def pieces(fused: tuple[int, ...], g: Geometry, where: str) -> list[Piece]:
    """The tensors of the other side, made from F' (`fused`, already transposed), in order."""
    _check_dims(fused, g, where)
    whole = Block((0,) * len(fused), fused, (1,) * len(fused))
    if g.narrow is not None:
        if not 0 <= g.narrow <= fused[g.dim]:
            raise CkptconvError(f"{where}: narrow keeps {g.narrow} of dim {g.dim}, which has {fused[g.dim]}")
        whole = whole.at(g.dim, 0, g.narrow)
    _check_empty(whole, g, where)
    elements: list[tuple[tuple[int, ...] | None, Block]] = [(None, whole)]
    if g.stack_dims:
        elements = [(e, _element(whole, g.stack_dims, e)) for e in _elements(fused, g.stack_dims)]
    out = []
    for element, block in elements:
        for index, parts in enumerate(_split(block, g, where)):
            shape = squeeze(_extent(block, parts, g.dim), g.dropped)
            placed = tuple((b, squeeze(offsets, g.dropped)) for b, offsets in parts)
            out.append(Piece(index, element, shape, placed))
    return _joined(out, g, where) if g.slots else out


def _elements(fused: tuple[int, ...], dims: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every element of the stacked dims, row-major: (0, 0), (0, 1), ..., (1, 0), ..."""
    return list(itertools.product(*(range(fused[d]) for d in dims)))


def _check_empty(whole: Block, g: Geometry, where: str) -> None:
    """Refuse cutting an empty tensor into more than `MAX_EMPTY_ELEMENTS` blocks (stacked elements times
    groups): no data backs the sizes of an empty tensor's dims, and each block is a part, each element a
    tensor, of its own. (A tensor with data has more elements than blocks, in bytes that exist.)"""
    count = math.prod(whole.sizes[d] for d in g.stack_dims)
    if g.split == "grouped" and g.groups > 0:
        count *= g.groups
    if g.slots and g.hf_groups > 0:
        count *= g.hf_groups
    if count > MAX_EMPTY_ELEMENTS and not math.prod(whole.sizes):
        raise CkptconvError(
            f"{where}: a tensor of shape {list(whole.sizes)} holds no data, yet the rule cuts it into "
            f"{count} blocks (at most {MAX_EMPTY_ELEMENTS} of an empty tensor); fix its shape or the rule"
        )


def _element(whole: Block, dims: tuple[int, ...], element: tuple[int, ...]) -> Block:
    """The block of one stacked element (size 1 along each stacked dim)."""
    for d, e in zip(dims, element, strict=True):
        whole = whole.at(d, e, 1)
    return whole


def _check_dims(fused: tuple[int, ...], g: Geometry, where: str) -> None:
    used = [("dim", g.dim)] if g.split or g.narrow is not None or g.dim else []  # a dim given must exist
    used += [("stack_dim", d) for d in g.stack_dims]
    used += [("transpose", d) for d in g.transpose or ()]
    for name, d in used:
        if not 0 <= d < len(fused):
            raise CkptconvError(f"{where}: {name} {d} is not a dim of a tensor of shape {list(fused)}")
    if (g.split or g.narrow is not None) and g.dim in g.stack_dims:
        raise CkptconvError(f"{where}: dim {g.dim} is a stacked dim; split along another dim")


def _split(block: Block, g: Geometry, where: str) -> list[list[tuple[Block, tuple[int, ...]]]]:
    """For each L: its blocks of F' and their offsets in L (before the stacked dim is dropped)."""
    origin = (0,) * len(block.sizes)
    if g.split is None:
        return [[(block, origin)]]
    total = block.sizes[g.dim]
    if g.split == "interleave":
        if total % g.count:
            raise CkptconvError(f"{where}: dim {g.dim} of {total} does not interleave {g.count} ways")
        return [[(block.at(g.dim, i, total // g.count, g.count), origin)] for i in range(g.count)]
    if g.split == "unbind":  # one slice of dim per L, which L lacks: [2, F, D] -> [F, D], [F, D]
        if total != g.count:
            raise CkptconvError(f"{where}: dim {g.dim} of {total} does not unbind into {g.count} tensors")
        return [[(block.at(g.dim, i, 1), origin)] for i in range(g.count)]
    if g.split == "plain":
        sizes = _sizes(g.sizes, total, g.count, where, f"dim {g.dim} of {total}")
        starts = [sum(sizes[:i]) for i in range(g.count)]
        return [[(block.at(g.dim, s, n), origin)] for s, n in zip(starts, sizes, strict=True)]
    if g.groups < 1 or total % g.groups:
        raise CkptconvError(f"{where}: dim {g.dim} of {total} does not split into {g.groups} groups")
    per = total // g.groups
    sizes = _sizes(g.sizes, per, g.count, where, f"a group of {per} (dim {g.dim} of {total} / {g.groups})")
    out = []
    for i, n in enumerate(sizes):
        start = sum(sizes[:i])
        out.append(
            [
                (block.at(g.dim, grp * per + start, n), _with(origin, g.dim, grp * n))
                for grp in range(g.groups)
            ]
        )
    return out


def _joined(found: list[Piece], g: Geometry, where: str) -> list[Piece]:
    """The pieces of each repeated key (`g.slots`) joined into one along `g.dim`, in list order; with
    `g.hf_groups` N, laid out per group: [group g's rows of the 1st piece, of the 2nd, ...] for g < N. A
    block is cut where it crosses a group's boundary; each piece is then indexed by its distinct key."""
    dim = g.dim - sum(1 for d in g.dropped if d < g.dim)  # `g.dim` in L's coordinates
    by: dict[tuple[tuple[int, ...] | None, int], list[Piece]] = {}
    for piece in found:
        by.setdefault((piece.element, g.slots[piece.index]), []).append(piece)
    out = []
    for (element, slot), group in by.items():
        if len(group) == 1:
            out.append(Piece(slot, element, group[0].shape, group[0].blocks))
            continue
        n = g.hf_groups
        for p in group:
            if n < 1 or p.shape[dim] % n:
                raise CkptconvError(
                    f"{where}: rule {g.rule}: hf_groups {n}: a piece of {p.shape[dim]} rows (dim {g.dim}) of "
                    f"a repeated hf key does not split into {n} equal groups; fix hf_groups or sizes"
                )
        per = [p.shape[dim] // n for p in group]
        blocks = []
        for j, p in enumerate(group):
            before = sum(per[:j])
            for block, offsets in p.blocks:
                start, end = offsets[dim], offsets[dim] + block.sizes[g.dim]
                row = start
                while row < end:  # rows [row, stop) of the piece lie in one group
                    grp = row // per[j]
                    stop = min(end, (grp + 1) * per[j])
                    at = grp * sum(per) + before + row - grp * per[j]
                    blocks.append((block.at(g.dim, row - start, stop - row), _with(offsets, dim, at)))
                    row = stop
        shape = _with(group[0].shape, dim, sum(p.shape[dim] for p in group))
        out.append(Piece(slot, element, shape, tuple(blocks)))
    return out


def _sizes(given: tuple[int, ...], total: int, count: int, where: str, what: str) -> list[int]:
    if not given:
        if total % count:
            raise CkptconvError(f"{where}: {what} does not split in {count}; give sizes")
        return [total // count] * count
    if sum(given) != total or any(n < 0 for n in given):
        raise CkptconvError(f"{where}: {what}, but the sizes {list(given)} add up to {sum(given)}")
    return list(given)


def _extent(block: Block, parts: list[tuple[Block, tuple[int, ...]]], dim: int) -> tuple[int, ...]:
    """The shape of L: the blocks' sizes, with dim `dim` as long as all of them together."""
    if len(parts) == 1:
        return parts[0][0].sizes
    return _with(parts[0][0].sizes, dim, sum(b.sizes[dim] for b, _ in parts))


def _with(t: tuple[int, ...], dim: int, value: int) -> tuple[int, ...]:
    out = list(t)
    out[dim] = value
    return tuple(out)


def squeeze(t: tuple[int, ...], dims: tuple[int, ...]) -> tuple[int, ...]:
    """`t` less the entries at `dims` (the stacked dims)."""
    return tuple(v for d, v in enumerate(t) if d not in dims)


def unsqueeze(t: tuple[int, ...], dims: tuple[int, ...], values: tuple[int, ...]) -> tuple[int, ...]:
    """`t` with `values` inserted so that they sit at `dims` (ascending) of the result."""
    out = list(t)
    for d, v in zip(dims, values, strict=True):
        out.insert(d, v)
    return tuple(out)


def fused_shape(
    shapes: list[tuple[int, ...]],
    g: Geometry,
    elements: tuple[int, ...],
    padded: int | None,
    where: str = "",
) -> tuple[int, ...]:
    """F' from the shapes of the other side's tensors (one per index; all elements alike) and the number of
    elements along each stacked dim: the inverse of `pieces`, checked afterwards by running `pieces` on it."""
    if g.split == "unbind":  # the unbound dim comes back with one entry per tensor of the other side
        values = dict(zip(g.stack_dims, elements, strict=True)) | {g.dim: g.count}
        shapes = [unsqueeze(s, g.dropped, tuple(values[d] for d in g.dropped)) for s in shapes]
    elif g.stack_dims:
        shapes = [unsqueeze(s, g.stack_dims, elements) for s in shapes]
    out = list(shapes[0])
    if (g.split is not None or g.narrow is not None) and not 0 <= g.dim < len(out):
        raise CkptconvError(f"{where}: dim {g.dim} is not a dim of a tensor of shape {out}")
    if g.split == "interleave":
        out[g.dim] = shapes[0][g.dim] * g.count
    elif g.split is not None and g.split != "unbind":
        out[g.dim] = sum(s[g.dim] for s in shapes if len(s) > g.dim)
    if g.narrow is not None and padded is not None:
        out[g.dim] = padded
    return tuple(out)
