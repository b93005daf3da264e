"""Where each element of a ZeRO-partitioned parameter lies: flat ranges of the fp32 partitions mapped back
to rectangular blocks of the parameter, by the rules of DeepSpeed's own `zero_to_fp32.py`
(`_zero2_merge_trainable_params`, `_zero3_merge_trainable_params`, `zero3_partitioned_param_info`).

A piece is (start, stop, file, byte offset): elements [start, stop) of the parameter in C order, stored
contiguously from that byte of that file. `chunks` cuts pieces into the blocks a `ChunkSpec` describes
(a flat range of a matrix is at most a partial row, whole rows and a partial row).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

from ckptconv.core.specs import ChunkSpec


class Piece(NamedTuple):
    """Elements [start, stop) of a parameter (C order), stored contiguously from `byte` of `file`."""

    start: int
    stop: int
    file: str
    byte: int


class Span(NamedTuple):
    """A run of `numel` stored elements: one rank's flat fp32 group, from `byte` of `file`."""

    file: str
    byte: int
    numel: int


def blocks(shape: tuple[int, ...], a: int, b: int) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The rectangular blocks (offsets, sizes) that elements [a, b) of a C-order tensor of `shape` make, in
    order; each block is contiguous in the flat order."""
    if a >= b:
        return
    if not shape:
        yield (), ()
        return
    inner = math.prod(shape[1:])
    rest = tuple(0 for _ in shape[1:])
    i0, i1 = a // inner, b // inner
    if a % inner == 0 and b % inner == 0:
        yield (i0, *rest), (i1 - i0, *shape[1:])
        return
    if b <= (i0 + 1) * inner:  # within one row
        for offs, sizes in blocks(shape[1:], a - i0 * inner, b - i0 * inner):
            yield (i0, *offs), (1, *sizes)
        return
    if a % inner:
        yield from blocks(shape, a, (i0 + 1) * inner)
        i0 += 1
    if i1 > i0:
        yield (i0, *rest), (i1 - i0, *shape[1:])
    if b % inner:
        yield from blocks(shape, i1 * inner, b)


def chunks(shape: tuple[int, ...], itemsize: int, pieces: list[Piece]) -> tuple[ChunkSpec, ...]:
    """The raw chunks of a parameter of `shape` stored as `pieces`."""
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    out = []
    for piece in pieces:
        for offs, sizes in blocks(shape, piece.start, piece.stop):
            first = sum(o * s for o, s in zip(offs, strides, strict=True))
            byte = piece.byte + (first - piece.start) * itemsize
            out.append(ChunkSpec(offs, sizes, piece.file, byte, math.prod(sizes) * itemsize, "torch_entry"))
    return tuple(out)


def spread(spans: list[Span], start: int, stop: int, itemsize: int, at: int = 0) -> list[Piece]:
    """Elements [start, stop) of the concatenation of `spans` as pieces, numbered from `at` in the
    parameter; the range must lie within the spans (checked by the caller)."""
    pieces, base = [], 0
    for span in spans:
        lo, hi = max(start, base), min(stop, base + span.numel)
        if lo < hi:
            pieces.append(
                Piece(at + lo - start, at + hi - start, span.file, span.byte + (lo - base) * itemsize)
            )
        base += span.numel
    return pieces


def zero2_pieces(
    shapes: list[tuple[str, tuple[int, ...]]], ranks: list[Span], world: int, paddings: list[int] | None
) -> tuple[dict[str, list[Piece]], str | None]:
    """One ZeRO-1/2 param group: the ranks' `single_partition_of_fp32_groups` entries concatenated, each
    parameter in turn (with its alignment padding after it), then the whole rounded up to 2 * world
    elements, which must be what the partitions hold; (pieces by name, what does not add up or None)."""
    avail = sum(s.numel for s in ranks)
    found: dict[str, list[Piece]] = {}
    offset = 0
    for i, (name, shape) in enumerate(shapes):
        numel = math.prod(shape)
        if offset + numel > avail:
            return found, f"{name!r} ends at element {offset + numel}, past the {avail} the partitions hold"
        found[name] = spread(ranks, offset, offset + numel, 4)
        offset += numel + (paddings[i] if paddings else 0)
    align = 2 * world
    if align * math.ceil(offset / align) != align * math.ceil(avail / align):
        return found, f"the parameters take {offset} elements of the {avail} the partitions hold"
    return found, None


def zero3_info(numel: int, world: int) -> int:
    """`zero3_partitioned_param_info`'s partitioned numel: each rank holds ceil(numel / world) elements."""
    return math.ceil(numel / world)


def zero3_pieces(
    shapes: list[tuple[str, tuple[int, ...]]], ranks: list[list[Span]], itemsize: int = 4
) -> tuple[dict[str, list[Piece]], str | None]:
    """ZeRO-3: every rank's flat groups concatenated; each parameter takes the next ceil(numel / world)
    elements of every rank, rank r holding its elements [r * that, (r + 1) * that) (the last padded); all
    the ranks' elements must be used: (pieces by name, what does not add up or None)."""
    world = len(ranks)
    avail = sum(s.numel for s in ranks[0])
    if any(sum(s.numel for s in r) != avail for r in ranks):
        return {}, "the ranks' flat groups differ in size"
    found: dict[str, list[Piece]] = {}
    offset = 0
    for name, shape in shapes:
        numel = math.prod(shape)
        part = zero3_info(numel, world)
        if offset + part > avail:
            return found, f"{name!r} ends at element {offset + part}, past the {avail} each partition holds"
        pieces = []
        for r, spans in enumerate(ranks):
            lo, hi = r * part, min((r + 1) * part, numel)
            if lo < hi:
                pieces += spread(spans, offset, offset + hi - lo, itemsize, lo)
        found[name] = pieces
        offset += part
    if offset != avail:
        return found, f"the parameters take {offset * world} elements of the {avail * world} partitioned"
    return found, None
