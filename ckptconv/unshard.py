"""Bring every tensor of the files a rank writes to that rank, from the chunks a DCP checkpoint stores.

Two paths, the same output bytes:
- direct (default): the writing rank reads each chunk it needs straight from storage, a few tensors ahead
  in threads (bounded by `bucket_bytes`), and casts it into place. Needs every rank to see every file.
- gather: each chunk is read by one rank (the rank that wrote it modulo the world size, so node-local storage
  works), and rounds of point-to-point transfers bring the chunks to the writers. Every rank walks the same
  rounds in the same order (the unshard scheduler `schedule.plan_rounds`, shared with save_hf's all-gathers,
  with one budget per writer): each round is bounded by `bucket_bytes` of gathered (global) source bytes per
  writer, a tensor larger than that moving in steps of rows; the writer casts what arrives into its output
  tensors at once (memory per rank: about `bucket_bytes` plus the round's output tensors). Read errors are
  agreed on before any transfer, so a failed read never leaves a peer waiting.
Call order: build one `DcpReader` per rank; call `direct_tensors(...)` or `gather_tensors(...)` on every rank
(the latter is collective) and consume the iterator to the end.
"""

from __future__ import annotations

import math
import re
import threading
import zlib
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from .formats.dcp import DcpCheckpoint
from .formats.dcp_reader import DcpReader, RowPiece, byte_view, check_pieces
from .layout import Box, intersect
from .plan import HfSavePlan, OutFile, OutTensor, SourcePart
from .schedule import plan_rounds
from .specs import ChunkSpec, TensorSpec
from .world import World, on_main

Item = tuple[OutFile, OutTensor, torch.Tensor]


RowsFn = Callable[[TensorSpec, ChunkSpec, int, int], torch.Tensor]  # rows [r0, r1) of a stored chunk


def narrow(t: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """The block of `t` at `offsets` (relative to `t`) of `sizes`, as a view."""
    for dim, (offset, size) in enumerate(zip(offsets, sizes, strict=True)):
        t = t.narrow(dim, offset, size)
    return t


SLAB_BYTES = 32 * 2**20  # a chunk that must be cast is read and cast this many bytes at a time
_staging = threading.local()


def _slab(nbytes: int) -> torch.Tensor:
    """This thread's reusable staging buffer of at least `nbytes` (reused so the allocator does not churn)."""
    buf = getattr(_staging, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = _staging.buf = torch.empty(max(nbytes, SLAB_BYTES), dtype=torch.uint8)
    return buf[:nbytes]


def assemble(t: OutTensor, rows: RowsFn, reader: DcpReader | None = None) -> torch.Tensor:
    """The output tensor `t` in its dtype, from the stored chunks `rows` returns (and `reader`, if direct).

    A part that is a whole stored tensor is filled chunk by chunk straight into place (`_fill_whole`); any
    other part (a block of a stacked or fused tensor, a permuted one) reads only the rows of the chunks that
    intersect its block, at most `SLAB_BYTES` at a time, each cast into its place in the output as it comes:
    besides the output, this holds one slab of rows (never a source-dtype copy of the part).
    """
    out = torch.empty(t.shape, dtype=t.dtype)
    for sp in t.parts:
        if sp.whole and sp.spec.shape == t.shape and reader is not None:
            _fill_whole(reader, sp.spec, out)
            continue
        for chunk, r0, r1 in _part_rows(sp):
            for lo, hi in _row_slabs(sp.spec, chunk, r0, r1, SLAB_BYTES):
                place(out, sp, _rows_box(chunk, lo, hi), rows(sp.spec, chunk, lo, hi))
    return out


def _part_rows(sp: SourcePart) -> list[tuple[ChunkSpec, int, int]]:
    """The stored chunks of `sp`'s tensor that intersect its block, each with the rows [r0, r1) it needs."""
    p = sp.part
    out = []
    for chunk in _unique_chunks(sp.spec):
        inter = intersect((chunk.offsets, chunk.sizes), (p.src_offsets, p.src_sizes))
        if inter is None:
            continue
        r0 = inter[0][0] - chunk.offsets[0] if chunk.sizes else 0
        out.append((chunk, r0, r0 + inter[1][0] if chunk.sizes else 1))
    return out


def _row_slabs(spec: TensorSpec, chunk: ChunkSpec, r0: int, r1: int, limit: int) -> list[tuple[int, int]]:
    """Rows [r0, r1) of a chunk cut into runs of at most `limit` bytes (at least one row each)."""
    if not chunk.sizes:
        return [(r0, r1)]
    step = max(1, limit // max(1, math.prod(chunk.sizes[1:]) * spec.dtype.itemsize))
    return [(lo, min(lo + step, r1)) for lo in range(r0, r1, step)]


def _rows_box(chunk: ChunkSpec, r0: int, r1: int) -> Box:
    """The block (global coordinates) that rows [r0, r1) of `chunk` cover."""
    if not chunk.sizes:
        return chunk.offsets, chunk.sizes
    return (chunk.offsets[0] + r0, *chunk.offsets[1:]), (r1 - r0, *chunk.sizes[1:])


def place(out: torch.Tensor, sp: SourcePart, box: Box, data: torch.Tensor) -> None:
    """Cast the part of `data` (the block `box` of `sp`'s stored tensor) that `sp` reads into its place in
    `out`: source blocks map onto target blocks across size-1 dims; a permuted part's rows land where `perm`
    sends them. Holds nothing beyond `data` (a permuted piece: its rows gathered once, in `out`'s dtype)."""
    p = sp.part
    inter = intersect(box, (p.src_offsets, p.src_sizes))
    if inter is None or not math.prod(p.src_sizes):
        return
    values = narrow(data, [o - b for o, b in zip(inter[0], box[0], strict=True)], inter[1])
    rel = [o - s for o, s in zip(inter[0], p.src_offsets, strict=True)]
    src_dims = [d for d, n in enumerate(p.src_sizes) if n != 1]
    dst_dims = [d for d, n in enumerate(p.dst_sizes) if n != 1]
    offsets, sizes = [0] * len(p.dst_sizes), [1] * len(p.dst_sizes)
    for s, d in zip(src_dims, dst_dims, strict=True):
        offsets[d], sizes[d] = rel[s], inter[1][s]
    values = values.reshape(sizes)
    target = narrow(out, p.dst_offsets, p.dst_sizes)
    if p.perm is None:
        narrow(target, offsets, sizes).copy_(values)
        return
    lo, n = offsets[0], sizes[0]  # target row r of the block is (reshaped) source row perm[r]
    dst_rows = [r for r, src in enumerate(p.perm) if lo <= src < lo + n]
    src_rows = torch.tensor([p.perm[r] - lo for r in dst_rows], dtype=torch.long)
    target = narrow(target, [0, *offsets[1:]], [target.shape[0], *sizes[1:]])
    target.index_copy_(0, torch.tensor(dst_rows, dtype=torch.long), values[src_rows].to(out.dtype))


def direct_rows(reader: DcpReader) -> RowsFn:
    """Rows of a stored chunk read straight from its file (only those rows' bytes). A chunk whose bytes
    cannot be located (a compressed or non-contiguous record) is loaded whole once, then kept while its
    slabs are read (`loaded`: the last such chunk; each call works on its own reference to it)."""
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
        out = torch.empty((r1 - r0, *chunk.sizes[1:]) if chunk.sizes else (), dtype=spec.dtype)
        row_bytes = math.prod(chunk.sizes[1:]) * spec.dtype.itemsize
        view = byte_view(out)
        reader.pread(chunk.file, where + r0 * row_bytes, view)
        if r0 == 0 and (not chunk.sizes or r1 == chunk.sizes[0]):  # the whole chunk: check its CRC-32
            reader.check(spec, chunk, where, zlib.crc32(view))
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
            reader.check(spec, chunk, where, zlib.crc32(view))
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
        crc = zlib.crc32(view, crc)
        values = staging.view(spec.dtype).view(n, *row_shape) if chunk.sizes else staging.view(spec.dtype)[0]
        (region.narrow(0, lo, n) if chunk.sizes else region).copy_(values)
    return crc


def _unique_chunks(spec: TensorSpec) -> list[ChunkSpec]:
    seen: dict[tuple[tuple[int, ...], tuple[int, ...]], ChunkSpec] = {}
    for chunk in spec.chunks:
        if chunk.numel:
            seen.setdefault((chunk.offsets, chunk.sizes), chunk)
    return list(seen.values())


def _needed_chunks(t: OutTensor) -> list[tuple[TensorSpec, ChunkSpec, int, int]]:
    """The stored chunks `t` reads from (those intersecting one of its parts' blocks), each with the row
    range [r0, r1) of the chunk those blocks need: a part that is one expert of a stacked tensor needs one
    expert's rows of the chunk, not the chunk."""
    out: dict[tuple[str, tuple[int, ...]], tuple[TensorSpec, ChunkSpec, int, int]] = {}
    for sp in t.parts:
        box = (sp.part.src_offsets, sp.part.src_sizes)
        for chunk in _unique_chunks(sp.spec):
            if not chunk.sizes:
                out.setdefault((sp.spec.fqn, chunk.offsets), (sp.spec, chunk, 0, 1))
                continue
            inter = intersect((chunk.offsets, chunk.sizes), box)
            if inter is None:
                continue
            r0 = inter[0][0] - chunk.offsets[0]
            r1 = r0 + inter[1][0]
            key = (sp.spec.fqn, chunk.offsets)
            if key in out:
                _, _, a, b = out[key]
                r0, r1 = min(a, r0), max(b, r1)
            out[key] = (sp.spec, chunk, r0, r1)
    return list(out.values())


def _stream(plan: HfSavePlan, rank: int) -> list[tuple[OutFile, OutTensor]]:
    return [(f, t) for f in plan.files_of(rank) for t in f.tensors]


def direct_tensors(plan: HfSavePlan, world: World, reader: DcpReader, bucket_bytes: int) -> Iterator[Item]:
    """This rank's output tensors in file order, read directly, up to `bucket_bytes` ahead in threads."""
    pending: deque[tuple[OutFile, OutTensor, Future[torch.Tensor]]] = deque()
    in_flight = 0
    rows = direct_rows(reader)
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="ckptconv-read") as pool:
        for f, t in _stream(plan, world.rank):
            while pending and in_flight + t.nbytes > bucket_bytes:
                done_f, done_t, future = pending.popleft()
                in_flight -= done_t.nbytes
                yield done_f, done_t, future.result()
            pending.append((f, t, pool.submit(assemble, t, rows, reader)))
            in_flight += t.nbytes
        while pending:
            done_f, done_t, future = pending.popleft()
            yield done_f, done_t, future.result()


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp$")


def reader_rank(file: str, world_size: int) -> int:
    """The rank that reads chunks stored in `file` on the gather path: the saving rank modulo world size."""
    match = _RANK_FILE.search(file)
    return (int(match.group(1)) if match else zlib.crc32(file.encode())) % world_size


@dataclass(frozen=True)
class Transfer:
    """Rows [r0, r1) of a stored chunk, read by `reader` and needed by `writer` for `tensor`."""

    tensor: OutTensor
    spec: TensorSpec
    chunk: ChunkSpec
    r0: int
    r1: int
    reader: int
    writer: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.r1 - self.r0, *self.chunk.sizes[1:]) if self.chunk.sizes else ()

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.spec.dtype.itemsize


def round_transfers(
    round_: list[tuple[int, list[tuple[OutFile, OutTensor]]]], world_size: int
) -> list[Transfer]:
    """Pure: every block that moves (or is read locally) in one round, in the same order on every rank."""
    return [
        Transfer(t, spec, chunk, r0, r1, reader_rank(chunk.file, world_size), writer)
        for writer, bucket in round_
        for _, t in bucket
        for spec, chunk, r0, r1 in _needed_chunks(t)
    ]


@dataclass(frozen=True)
class _Fetch:
    """A gather-path job for the scheduler: one output tensor brought to its writer by one p2p batch."""

    account: int  # the writer: the gathered bytes land in its memory
    nbytes: int
    keys: tuple[Hashable, ...] = (("p2p", torch.uint8),)


def gather_rounds(
    plan: HfSavePlan, bucket_bytes: int
) -> list[list[tuple[int, list[tuple[OutFile, OutTensor]]]]]:
    """Pure: the shared scheduler's rounds (`schedule.plan_rounds`) with one budget per writer: round k holds
    the k-th bucket of every writer's stream (each <= bucket_bytes of source bytes, or one larger tensor)."""
    stream = [(rank, f, t) for rank in range(plan.world_size) for f, t in _stream(plan, rank)]
    rounds = plan_rounds([_Fetch(rank, t.src_nbytes) for rank, _, t in stream], bucket_bytes)
    out = []
    for r in rounds:
        buckets: dict[int, list[tuple[OutFile, OutTensor]]] = {}
        for j in r.started:
            rank, f, t = stream[j]
            buckets.setdefault(rank, []).append((f, t))
        out.append(sorted(buckets.items()))
    return out


def split_round(transfers: list[Transfer], bucket_bytes: int) -> list[list[Transfer]]:
    """Pure: one round's transfers as steps each bringing at most `bucket_bytes` to every writer. A round
    within the budget is one step, as it is; a writer's larger round (one tensor bigger than the budget) is
    cut into runs of rows of at most `bucket_bytes` (a single larger row alone), its k-th group of them in
    step k. The same steps, in the same order, on every rank."""
    by_writer: dict[int, list[Transfer]] = {}
    for tr in transfers:
        by_writer.setdefault(tr.writer, []).append(tr)
    if all(sum(tr.nbytes for tr in mine) <= bucket_bytes for mine in by_writer.values()):
        return [transfers]
    groups: dict[int, list[list[Transfer]]] = {}
    for writer, mine in sorted(by_writer.items()):
        if sum(tr.nbytes for tr in mine) <= bucket_bytes:
            groups[writer] = [mine]
            continue
        steps: list[list[Transfer]] = [[]]
        used = 0
        for tr in mine:
            for lo, hi in _row_slabs(tr.spec, tr.chunk, tr.r0, tr.r1, bucket_bytes):
                piece = replace(tr, r0=lo, r1=hi)
                if used and used + piece.nbytes > bucket_bytes:
                    steps.append([])
                    used = 0
                steps[-1].append(piece)
                used += piece.nbytes
        groups[writer] = steps
    depth = max((len(g) for g in groups.values()), default=0)
    return [[tr for _, g in sorted(groups.items()) if k < len(g) for tr in g[k]] for k in range(depth)]


def gather_tensors(plan: HfSavePlan, world: World, source: RowsFn, bucket_bytes: int) -> Iterator[Item]:
    """Collective: this rank's output tensors in file order. The rows each tensor needs of each chunk are read
    by the chunk's reader rank (`source`: rows of a stored chunk, from storage or from memory) and sent to the
    writer in rounds of at most `bucket_bytes` of gathered bytes per writer (`gather_rounds`; a tensor larger
    than that in steps of rows, `split_round`), one batch of p2p ops a step. The writer casts each received
    block into its output tensors as it arrives, so it holds one step's blocks (<= `bucket_bytes`, or one
    larger row) beside the round's output tensors, never a source-dtype copy of a tensor."""
    for round_ in gather_rounds(plan, bucket_bytes):
        mine = dict(round_).get(world.rank, [])
        outs = {t.hf_key: torch.empty(t.shape, dtype=t.dtype) for _, t in mine}
        for step in split_round(round_transfers(round_, world.size), bucket_bytes):
            for tr, data in _exchange(step, world, source):
                for sp in tr.tensor.parts:
                    if sp.spec.fqn == tr.spec.fqn:
                        place(outs[tr.tensor.hf_key], sp, _rows_box(tr.chunk, tr.r0, tr.r1), data)
        for f, t in mine:
            yield f, t, outs.pop(t.hf_key)


def _exchange(step: list[Transfer], world: World, source: RowsFn) -> Iterator[tuple[Transfer, torch.Tensor]]:
    """Collective: read this rank's blocks of `step`, agree on read errors, run one batch of p2p ops; then
    the blocks this rank is the writer of, each dropped once the caller has used it."""
    import torch.distributed as dist

    local: dict[int, torch.Tensor] = {}
    error: BaseException | None = None
    try:
        for i, tr in enumerate(step):
            if tr.reader == world.rank:
                local[i] = source(tr.spec, tr.chunk, tr.r0, tr.r1).contiguous()
    except Exception as e:
        error = e
    world.agree(error)
    ops = []
    for i, tr in enumerate(step):
        if tr.reader == tr.writer:
            continue
        if tr.reader == world.rank:  # sent as bytes: gloo moves any dtype that way (bool, fp8, bf16)
            ops.append(dist.P2POp(dist.isend, _as_bytes(local[i]), tr.writer))
        elif tr.writer == world.rank:
            local[i] = torch.empty(tr.shape, dtype=tr.spec.dtype)
            ops.append(dist.P2POp(dist.irecv, _as_bytes(local[i]), tr.reader))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for i, tr in enumerate(step):
        if tr.writer != world.rank:
            local.pop(i, None)  # sent: free it before casting what arrived
    for i, tr in enumerate(step):
        if tr.writer == world.rank:
            yield tr, local.pop(i)
