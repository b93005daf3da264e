"""Bring every tensor of the files a rank writes to that rank, from the chunks a DCP checkpoint stores.

Two paths, the same output bytes:
- direct (default): the writing rank reads each chunk it needs straight from storage, a few tensors ahead
  in threads (bounded by `bucket_bytes`), and casts it into place. Needs every rank to see every file.
- gather: each chunk is read by one rank and rounds of point-to-point transfers bring the chunks to the
  writers (`gather.py`).
Call order: build one `DcpReader` per rank; call `direct_tensors(...)` or `gather.gather_tensors(...)` on
every rank (the latter is collective) and consume the iterator to the end.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ckptconv.core.crc32 import crc32
from ckptconv.core.layout import Box, intersect
from ckptconv.core.specs import ChunkSpec, DcpCheckpoint, TensorSpec
from ckptconv.formats.byte_views import byte_view
from ckptconv.formats.dcp_pieces import RowPiece, check_pieces
from ckptconv.formats.dcp_reader import DcpReader
from ckptconv.job.world import World, on_main
from ckptconv.lora.merge import ReadFn, check_finite, delta_box, merge_rows
from ckptconv.mapping.parts import src_rows
from ckptconv.mapping.types import whole as _whole
from ckptconv.plan.types import HfSavePlan, OutTensor, SourcePart, Write
from ckptconv.stream import blocks
from ckptconv.stream.buffers import BufferPool

Item = tuple[Write, torch.Tensor]  # a write of the plan and its data (the tensor, or its rows)


RowsFn = Callable[[TensorSpec, ChunkSpec, int, int], torch.Tensor]  # rows [r0, r1) of a stored chunk


def narrow(t: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """The block of `t` at `offsets` (relative to `t`) of `sizes`, as a view."""
    for dim, (offset, size) in enumerate(zip(offsets, sizes, strict=True)):
        t = t.narrow(dim, offset, size)
    return t


SLAB_BYTES = 32 * 2**20  # a chunk that must be cast is read and cast this many bytes at a time
_staging = threading.local()


def _slab(nbytes: int, name: str = "buf") -> torch.Tensor:
    """This thread's reusable staging buffer `name` of at least `nbytes` (reused so the allocator does not
    churn: a new 32 MB buffer per slab is a mapping made, faulted in and unmapped each time)."""
    buf = getattr(_staging, name, None)
    if buf is None or buf.numel() < nbytes:
        buf = torch.empty(max(nbytes, SLAB_BYTES), dtype=torch.uint8)
        setattr(_staging, name, buf)
    return buf[:nbytes]


def assemble(
    t: OutTensor,
    rows: RowsFn,
    reader: DcpReader | None = None,
    window: tuple[int, int] | None = None,
    pool: BufferPool | None = None,
) -> torch.Tensor:
    """The output tensor `t` in its dtype, from the stored chunks `rows` returns (and `reader`, if direct);
    with `window` (lo, hi) only its rows [lo, hi) of its laid-out dim 0, laid out (a `writes.Write` slab).

    A part that is a whole stored tensor is filled chunk by chunk straight into place (`_fill_whole`); any
    other part (a block of a stacked or fused tensor, a permuted one, or any part of a slab) reads only the
    rows of the chunks that intersect its block, at most `SLAB_BYTES` at a time, each cast into its place in
    the output as it comes: besides the output, this holds one slab of rows (never a source-dtype copy).
    The output is made in `pool`'s memory when given (give it back there once written). A weight with LoRA to
    merge (`t.lora`) is assembled in fp32, merged (`lora.merge`) and cast once.
    """
    if t.lora is not None:
        return _merged(t, rows, reader, window)
    out = new_out(t, window, pool)
    view = laid_out(out, t, window)
    for sp in t.parts:
        whole = sp.whole and sp.spec.shape == t.shape and t.offset is None  # shifted: placed value by value
        if window is None and whole and reader is not None and not sp.lora:
            _fill_whole(reader, sp.spec, out)
            continue
        read = _factors(rows)
        for chunk, r0, r1 in _part_rows(sp, window):
            for lo, hi in row_slabs(sp.spec, chunk, r0, r1, SLAB_BYTES):
                box = rows_box(chunk, lo, hi)
                # a LoRA update is read first: its factors' reads may reuse the buffer W's rows are read
                # into next (`direct_rows(reuse=True)`), so W's rows are read last and used at once
                delta = delta_box(sp.lora, *box, read) if sp.lora is not None else None
                data = rows(sp.spec, chunk, lo, hi)
                if delta is not None:  # W's block in fp32 with its update, cast once
                    merged = data.to(torch.float32) + delta
                    written = merged.to(view.dtype)
                    check_finite(sp.spec.fqn, box[0][0] if box[0] else 0, merged, written, data)
                    # a rule's offset applies to the merged weight: shifted in fp32 by `place`, cast once
                    data = written if t.offset is None else merged
                place(view, sp, box, data, window, t.offset)
    return out


def _merged(
    t: OutTensor, rows: RowsFn, reader: DcpReader | None, window: tuple[int, int] | None
) -> torch.Tensor:
    """`t` (its rows `window`) with its LoRA merged in: W's rows in fp32 plus the factors' product, plus the
    rule's offset if it has one."""
    assert t.lora is not None
    plain = dataclasses.replace(t, lora=None, dtype=torch.float32, offset=None)
    lo = window[0] if window else 0
    merged = merge_rows(assemble(plain, rows, reader, window), lo, t.lora, _factors(rows))
    # a rule's offset applies to the merged weight (HF = runtime + offset), not to W under the update (nor
    # inside a DoRA norm)
    merged = blocks.shifted(merged, t.offset, t.dtype)
    out = merged if t.quant else merged.to(t.dtype)  # a weight to quantize is quantized from fp32
    check_finite(t.hf_key, lo, merged, out, lambda: assemble(plain, rows, reader, window))
    return out


def _factors(rows: RowsFn) -> ReadFn:
    """Rows of a LoRA factor (all of it with None) in fp32, read through `rows` like any stored tensor; a
    factor read whole is read once for the tensor being made (every slab of W asks for all of A)."""
    whole: dict[str, torch.Tensor] = {}

    def read(spec: TensorSpec, span: tuple[int, int] | None) -> torch.Tensor:
        if span is None and spec.fqn in whole:
            return whole[spec.fqn]
        part = SourcePart(spec, _whole(spec.fqn, spec.shape))
        value = assemble(OutTensor(spec.fqn, spec.shape, torch.float32, (part,)), rows, None, span)
        if span is None:
            whole[spec.fqn] = value
        return value

    return read


def new_out(
    t: OutTensor, window: tuple[int, int] | None = None, pool: BufferPool | None = None
) -> torch.Tensor:
    """The output tensor to fill: zeros where no part lands (padding), else uninitialised; a weight to be
    quantized is assembled in its source dtype. With `window`: its rows [lo, hi), laid out."""
    shape = t.shape
    if window is not None:
        laid = t.layout or t.shape
        shape = (window[1] - window[0], *laid[1:])
    if pool is not None:
        return pool.take(shape, t.work_dtype, zeroed=t.padded)
    return (torch.zeros if t.padded else torch.empty)(shape, dtype=t.work_dtype)


def laid_out(out: torch.Tensor, t: OutTensor, window: tuple[int, int] | None = None) -> torch.Tensor:
    """`out` in the shape its parts address (a reshaped tensor's other shape; same storage); a slab
    (`window`) is made in that shape already."""
    return out.view(t.layout) if t.layout and window is None else out


def _part_rows(sp: SourcePart, window: tuple[int, int] | None = None) -> list[tuple[ChunkSpec, int, int]]:
    """The stored chunks of `sp`'s tensor that intersect its block (the part of it that target rows `window`
    need), each with the rows [r0, r1) it needs."""
    box = needed_box(sp, window)
    if box is None:
        return []
    out = []
    for chunk in _unique_chunks(sp.spec):
        inter = intersect((chunk.offsets, chunk.sizes), box)
        if inter is None:
            continue
        r0 = inter[0][0] - chunk.offsets[0] if chunk.sizes else 0
        out.append((chunk, r0, r0 + inter[1][0] if chunk.sizes else 1))
    return out


def needed_box(sp: SourcePart, window: tuple[int, int] | None) -> Box | None:
    """The block of `sp`'s source that target rows `window` (None: all) need; None if they need none."""
    offsets, sizes = sp.part.src_box()
    if window is None or not sizes:
        return offsets, sizes
    need = src_rows(sp.part, *window)
    if need is None:
        return None
    return (need[0], *offsets[1:]), (need[1] - need[0], *sizes[1:])


def row_slabs(spec: TensorSpec, chunk: ChunkSpec, r0: int, r1: int, limit: int) -> list[tuple[int, int]]:
    """Rows [r0, r1) of a chunk cut into runs of at most `limit` bytes (at least one row each)."""
    if not chunk.sizes:
        return [(r0, r1)]
    step = max(1, limit // max(1, math.prod(chunk.sizes[1:]) * spec.dtype.itemsize))
    return [(lo, min(lo + step, r1)) for lo in range(r0, r1, step)]


def rows_box(chunk: ChunkSpec, r0: int, r1: int) -> Box:
    """The block (global coordinates) that rows [r0, r1) of `chunk` cover."""
    if not chunk.sizes:
        return chunk.offsets, chunk.sizes
    return (chunk.offsets[0] + r0, *chunk.offsets[1:]), (r1 - r0, *chunk.sizes[1:])


def place(
    out: torch.Tensor,
    sp: SourcePart,
    box: Box,
    data: torch.Tensor,
    window: tuple[int, int] | None = None,
    shift: float | None = None,
) -> None:
    """Cast what `data` (the block `box` of `sp`'s stored tensor) holds of `sp` into its place in `out` (the
    output tensor as `laid_out` gives it, or with `window` its rows [lo, hi)), plus `shift` if given (the
    output tensor's `offset`); see `blocks.place`."""
    blocks.place(out, sp.part, box, data, window[0] if window else None, shift)


def direct_rows(reader: DcpReader, reuse: bool = False) -> RowsFn:
    """Rows of a stored chunk read straight from its file (only those rows' bytes). A chunk whose bytes
    cannot be located (a compressed or non-contiguous record) is loaded whole once, then kept while its
    slabs are read (`loaded`: the last such chunk; each call works on its own reference to it).
    `reuse`: the rows land in this thread's reusable buffer, valid until the thread's next call (for callers
    that place each result at once, as `assemble` does); otherwise in a tensor of their own."""
    loaded: list[tuple[tuple[str, tuple[int, ...]], torch.Tensor]] = []

    def rows(spec: TensorSpec, chunk: ChunkSpec, r0: int, r1: int) -> torch.Tensor:
        where = reader.locate(spec, chunk)
        if where is None:
            key = (spec.fqn, tuple(chunk.offsets))
            entry = loaded[0] if loaded else None
            if entry is None or entry[0] != key:
                entry = (key, reader.torch_load_chunk(spec, chunk))
                loaded[:] = [entry]
            whole = entry[1]
            return whole.narrow(0, r0, r1 - r0) if chunk.sizes else whole
        shape = (r1 - r0, *chunk.sizes[1:]) if chunk.sizes else ()
        if reuse:
            out = _slab(math.prod(shape) * spec.dtype.itemsize, "rows").view(spec.dtype).view(shape)
        else:
            out = torch.empty(shape, dtype=spec.dtype)
        row_bytes = math.prod(chunk.sizes[1:]) * spec.dtype.itemsize
        view = byte_view(out)
        reader.pread(chunk.file, where + r0 * row_bytes, view)
        if r0 == 0 and (not chunk.sizes or r1 == chunk.sizes[0]):  # the whole chunk: check its CRC-32
            reader.check(spec, chunk, where, crc32(view))
        else:  # some rows: checked once all of the chunk's rows are read (`check_pieces`)
            reader.note_piece(spec, chunk, where, r0 * row_bytes, view)
        return out

    return rows


def check_read_pieces(world: World, ckpt: DcpCheckpoint, pieces: list[RowPiece]) -> None:
    """Collective: the chunks this job read in pieces (`direct_rows` of some rows: stacked experts split,
    fused projections cut), on any ranks, against their stored CRC-32 once all their pieces are in."""
    everywhere = [piece for rank_pieces in world.all_gather_object(pieces) for piece in rank_pieces]
    on_main(world, check_pieces, ckpt, everywhere)


def _fill_whole(reader: DcpReader, spec: TensorSpec, out: torch.Tensor) -> None:
    """Every chunk of `spec` into its block of `out`: read straight into place when no cast is needed,
    otherwise a slab of rows at a time through a small staging buffer (never a second full-size copy)."""
    for chunk in _unique_chunks(spec):
        region = narrow(out, chunk.offsets, chunk.sizes)
        where = reader.locate(spec, chunk)
        if where is None:
            region.copy_(reader.torch_load_chunk(spec, chunk))
        elif out.dtype == spec.dtype and region.is_contiguous():
            view = byte_view(region)
            reader.pread(chunk.file, where, view)  # straight into place, no copy
            reader.check(spec, chunk, where, crc32(view))
        else:
            reader.check(spec, chunk, where, _cast_in_slabs(reader, spec, chunk, where, region))


def _cast_in_slabs(
    reader: DcpReader, spec: TensorSpec, chunk: ChunkSpec, where: int, region: torch.Tensor
) -> int:
    """Read the chunk a slab at a time, cast into `region`; the CRC-32 of the bytes read."""
    crc = 0
    rows = chunk.sizes[0] if chunk.sizes else 1
    row_shape = chunk.sizes[1:]
    row_bytes = math.prod(row_shape) * spec.dtype.itemsize
    step = max(1, SLAB_BYTES // max(row_bytes, 1))
    for lo in range(0, rows, step):
        n = min(step, rows - lo)
        staging = _slab(n * row_bytes)
        view = byte_view(staging)
        reader.pread(chunk.file, where + lo * row_bytes, view)
        crc = crc32(view, crc)
        values = staging.view(spec.dtype).view(n, *row_shape) if chunk.sizes else staging.view(spec.dtype)[0]
        (region.narrow(0, lo, n) if chunk.sizes else region).copy_(values)
    return crc


def _unique_chunks(spec: TensorSpec) -> list[ChunkSpec]:
    seen: dict[tuple[tuple[int, ...], tuple[int, ...]], ChunkSpec] = {}
    for chunk in spec.chunks:
        if chunk.numel:
            seen.setdefault((chunk.offsets, chunk.sizes), chunk)
    return list(seen.values())


def needed_chunks(
    t: OutTensor, window: tuple[int, int] | None = None
) -> list[tuple[TensorSpec, ChunkSpec, int, int]]:
    """The stored chunks `t` (its rows `window`) reads from (those intersecting one of its parts' blocks),
    each with the row range [r0, r1) of the chunk those blocks need: a part that is one expert of a stacked
    tensor needs one expert's rows of the chunk, not the chunk."""
    out: dict[tuple[str, tuple[int, ...]], tuple[TensorSpec, ChunkSpec, int, int]] = {}
    for sp in t.parts:
        for chunk, r0, r1 in _part_rows(sp, window):
            key = (sp.spec.fqn, chunk.offsets)
            if key in out:
                _, _, a, b = out[key]
                r0, r1 = min(a, r0), max(b, r1)
            out[key] = (sp.spec, chunk, r0, r1)
    factors = [*(t.lora.specs if t.lora else ()), *(s for sp in t.parts if sp.lora for s in sp.lora.specs)]
    for spec in factors:  # LoRA factors: small, read whole
        for chunk in _unique_chunks(spec):
            out.setdefault((spec.fqn, chunk.offsets), (spec, chunk, 0, chunk.sizes[0] if chunk.sizes else 1))
    return list(out.values())


def direct_tensors(
    plan: HfSavePlan, world: World, reader: DcpReader, bucket_bytes: int, pool: BufferPool | None = None
) -> Iterator[Item]:
    """This rank's writes (`plan.writes_of`) with their data, in file order, read directly, up to
    `bucket_bytes` ahead in threads (their tensors made in `pool`, when given). From object storage, the
    reads of the next `bucket_bytes` of writes are announced (`reader.expect`) before a write is read, so
    which neighbours one GET fetches does not depend on how far the loop got while a thread was reading."""
    pending: deque[tuple[Write, Future[torch.Tensor]]] = deque()
    announced: deque[Write] = deque()
    in_flight = ahead = 0
    look_ahead = bucket_bytes if reader.remote else 0
    rows = direct_rows(reader, reuse=True)  # each read thread's rows are placed by its `assemble` at once
    # not `with`: a generator abandoned on an error may be finalized in one of these threads, which cannot
    # join itself; the reads in flight finish on their own, and those not started are cancelled
    threads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ckptconv-read")

    def submit(w: Write) -> Iterator[Item]:
        nonlocal in_flight
        while pending and in_flight + w.nbytes > bucket_bytes:
            done, future = pending.popleft()
            in_flight -= done.nbytes
            yield done, future.result()
        pending.append((w, threads.submit(assemble, w.tensor, rows, reader, w.window, pool)))
        in_flight += w.nbytes

    expect_elsewhere(reader, plan, world.rank)
    try:
        for w in plan.writes_of(world.rank):
            expect_rows(reader, w.tensor, w.window)
            announced.append(w)
            ahead += w.nbytes
            while announced and ahead > look_ahead:
                first = announced.popleft()
                ahead -= first.nbytes
                yield from submit(first)
        while announced:
            yield from submit(announced.popleft())
        while pending:
            done, future = pending.popleft()
            yield done, future.result()
    finally:
        threads.shutdown(wait=False, cancel_futures=True)


def expect_rows(reader: DcpReader, t: OutTensor, window: tuple[int, int] | None = None) -> None:
    """Tell `reader` which rows of which chunks reading `t` (rows `window` of it) takes (from object
    storage, neighbours are fetched together); on a file system, nothing to do."""
    if reader.remote:
        for spec, chunk, r0, r1 in needed_chunks(t, window):
            reader.expect(spec, chunk, r0, r1)


def expect_elsewhere(reader: DcpReader, plan: HfSavePlan, rank: int) -> None:
    """From object storage, tell `reader` the rows of chunks every other rank's writes read (the plan holds
    every rank's writes: no collective), so that its requests, coalesced across small gaps, never fetch
    bytes another rank fetches; on a file system, or alone, nothing to do."""
    if reader.remote:
        for w in plan.writes:
            if w.rank != rank:
                for spec, chunk, r0, r1 in needed_chunks(w.tensor, w.window):
                    reader.elsewhere(spec, chunk, r0, r1)
