"""Bring every tensor of the files a rank writes to that rank, from the chunks a DCP checkpoint stores.

Two paths, the same output bytes:
- direct (default): the writing rank reads each chunk it needs straight from storage, a few tensors ahead
  in threads (bounded by `bucket_bytes`), and casts it into place. Needs every rank to see every file.
- gather: each chunk is read by one rank (the rank that wrote it modulo the world size, so node-local storage
  works), and rounds of point-to-point transfers bring the chunks to the writers. Every rank walks the same
  rounds in the same order; each round is bounded by `bucket_bytes` of gathered (global) source bytes per
  writer; read errors are agreed on before any transfer, so a failed read never leaves a peer waiting.
Call order: build one `DcpReader` per rank; call `direct_tensors(...)` or `gather_tensors(...)` on every rank
(the latter is collective) and consume the iterator to the end.
"""

from __future__ import annotations

import math
import re
import threading
import zlib
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .formats.dcp import DcpReader, byte_view
from .plan import HfSavePlan, OutFile, OutTensor
from .specs import ChunkSpec
from .world import World

Item = tuple[OutFile, OutTensor, torch.Tensor]


def _region(out: torch.Tensor, chunk: ChunkSpec) -> torch.Tensor:
    view = out
    for dim, (offset, size) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
        view = view.narrow(dim, offset, size)
    return view


def place(out: torch.Tensor, chunk: ChunkSpec, data: torch.Tensor) -> None:
    """Copy a chunk's source values into their block of `out`, casting with torch's own conversion."""
    _region(out, chunk).copy_(data)


SLAB_BYTES = 32 * 2**20  # a chunk that must be cast is read and cast this many bytes at a time
_staging = threading.local()


def _slab(nbytes: int) -> torch.Tensor:
    """This thread's reusable staging buffer of at least `nbytes` (reused so the allocator does not churn)."""
    buf = getattr(_staging, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = _staging.buf = torch.empty(max(nbytes, SLAB_BYTES), dtype=torch.uint8)
    return buf[:nbytes]


def assemble_direct(reader: DcpReader, t: OutTensor) -> torch.Tensor:
    """Read every stored chunk of `t` into a new tensor of the output dtype.

    Chunks already in the output dtype whose block is contiguous in the output are read straight into place;
    others are read a slab of rows at a time into a small staging buffer and cast into place, so casting never
    holds a second full-size copy of a tensor.
    """
    out = torch.empty(t.shape, dtype=t.dtype)
    for chunk in _unique_chunks(t):
        region = _region(out, chunk)
        where = reader.locate(t.src, chunk)
        if where is None:
            region.copy_(reader.torch_load_chunk(t.src, chunk))
        elif t.dtype == t.src.dtype and region.is_contiguous():
            reader.pread(chunk.file, where, byte_view(region))  # straight into place, no copy
        else:
            _cast_in_slabs(reader, t, chunk, where, region)
    return out


def _cast_in_slabs(
    reader: DcpReader, t: OutTensor, chunk: ChunkSpec, where: int, region: torch.Tensor
) -> None:
    rows = chunk.sizes[0] if chunk.sizes else 1
    row_shape = chunk.sizes[1:]
    row_bytes = math.prod(row_shape) * t.src.dtype.itemsize
    step = max(1, SLAB_BYTES // max(row_bytes, 1))
    for lo in range(0, rows, step):
        n = min(step, rows - lo)
        staging = _slab(n * row_bytes)
        reader.pread(chunk.file, where + lo * row_bytes, byte_view(staging))
        values = (
            staging.view(t.src.dtype).view(n, *row_shape) if chunk.sizes else staging.view(t.src.dtype)[0]
        )
        (region.narrow(0, lo, n) if chunk.sizes else region).copy_(values)


def _unique_chunks(t: OutTensor) -> list[ChunkSpec]:
    seen: dict[tuple[tuple[int, ...], tuple[int, ...]], ChunkSpec] = {}
    for chunk in t.src.chunks:
        if chunk.numel:
            seen.setdefault((chunk.offsets, chunk.sizes), chunk)
    return list(seen.values())


def _stream(plan: HfSavePlan, rank: int) -> list[tuple[OutFile, OutTensor]]:
    return [(f, t) for f in plan.files_of(rank) for t in f.tensors]


def direct_tensors(plan: HfSavePlan, world: World, reader: DcpReader, bucket_bytes: int) -> Iterator[Item]:
    """This rank's output tensors in file order, read directly, up to `bucket_bytes` ahead in threads."""
    pending: deque[tuple[OutFile, OutTensor, Future[torch.Tensor]]] = deque()
    in_flight = 0
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="ckptconv-read") as pool:
        for f, t in _stream(plan, world.rank):
            while pending and in_flight + t.nbytes > bucket_bytes:
                done_f, done_t, future = pending.popleft()
                in_flight -= done_t.nbytes
                yield done_f, done_t, future.result()
            pending.append((f, t, pool.submit(assemble_direct, reader, t)))
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
    tensor: OutTensor
    chunk: ChunkSpec
    reader: int
    writer: int


def gather_rounds(
    plan: HfSavePlan, bucket_bytes: int
) -> list[list[tuple[int, list[tuple[OutFile, OutTensor]]]]]:
    """Pure: round k holds the k-th bucket of every writer's stream (each bucket <= bucket_bytes of source
    bytes, or one tensor larger than that)."""
    per_writer = []
    for rank in range(plan.world_size):
        buckets: list[list[tuple[OutFile, OutTensor]]] = []
        size = 0
        for f, t in _stream(plan, rank):
            if not buckets or (size + t.src.nbytes > bucket_bytes and buckets[-1]):
                buckets.append([])
                size = 0
            buckets[-1].append((f, t))
            size += t.src.nbytes
        per_writer.append(buckets)
    depth = max((len(b) for b in per_writer), default=0)
    return [[(rank, b[k]) for rank, b in enumerate(per_writer) if k < len(b)] for k in range(depth)]


def gather_tensors(plan: HfSavePlan, world: World, reader: DcpReader, bucket_bytes: int) -> Iterator[Item]:
    """Collective: this rank's output tensors in file order; each chunk is read by its reader rank."""
    import torch.distributed as dist

    for round_ in gather_rounds(plan, bucket_bytes):
        transfers = [
            Transfer(t, chunk, reader_rank(chunk.file, world.size), writer)
            for writer, bucket in round_
            for _, t in bucket
            for chunk in _unique_chunks(t)
        ]
        local: dict[int, torch.Tensor] = {}
        error: BaseException | None = None
        try:
            for i, tr in enumerate(transfers):
                if tr.reader == world.rank:
                    local[i] = reader.read_chunk(tr.tensor.src, tr.chunk)
        except Exception as e:
            error = e
        world.agree(error)
        ops = []
        for i, tr in enumerate(transfers):
            if tr.reader == tr.writer:
                continue
            if tr.reader == world.rank:  # sent as bytes: gloo moves any dtype that way (bool, fp8, bf16)
                ops.append(dist.P2POp(dist.isend, _as_bytes(local.pop(i)), tr.writer))
            elif tr.writer == world.rank:
                local[i] = torch.empty(tr.chunk.sizes, dtype=tr.tensor.src.dtype)
                ops.append(dist.P2POp(dist.irecv, _as_bytes(local[i]), tr.reader))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        mine = dict(round_).get(world.rank, [])
        by_tensor: dict[str, list[int]] = {}
        for i, tr in enumerate(transfers):
            if tr.writer == world.rank:
                by_tensor.setdefault(tr.tensor.hf_key, []).append(i)
        for f, t in mine:
            out = torch.empty(t.shape, dtype=t.dtype)
            for i in by_tensor.get(t.hf_key, []):
                place(out, transfers[i].chunk, local.pop(i))
            yield f, t, out
