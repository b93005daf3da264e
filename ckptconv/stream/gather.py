"""The gather path of dcp-to-hf (`--read gather`): each stored chunk is read by one rank (the rank that wrote
it modulo the world size, so node-local storage works) and rounds of point-to-point transfers bring the
chunks to the writers. Every rank walks the same rounds in the same order (the unshard scheduler
`schedule.plan_rounds`, with one budget per writer): each round is bounded by `bucket_bytes` of gathered
source bytes per writer, a tensor larger than that moving in steps of rows (`split_round`); the writer casts
what arrives into its output tensors at once (memory per rank: about `bucket_bytes` plus the round's output
tensors). Read errors are agreed on before any transfer, so a failed read never leaves a peer waiting.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, replace

import torch

from ckptconv.core.specs import ChunkSpec, TensorSpec
from ckptconv.job.world import World
from ckptconv.plan.schedule import plan_rounds
from ckptconv.plan.types import HfSavePlan, Write
from ckptconv.stream.unshard import Item, RowsFn, laid_out, needed_chunks, new_out, place, row_slabs, rows_box


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp$")


def reader_rank(file: str, world_size: int) -> int:
    """The rank that reads chunks stored in `file` on the gather path: the saving rank modulo world size."""
    match = _RANK_FILE.search(file)
    return (int(match.group(1)) if match else zlib.crc32(file.encode())) % world_size


@dataclass(frozen=True)
class Transfer:
    """Rows [r0, r1) of a stored chunk, read by `reader` and needed by `writer` for `write`."""

    write: Write
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


def round_transfers(round_: list[tuple[int, list[Write]]], world_size: int) -> list[Transfer]:
    """Pure: every block that moves (or is read locally) in one round, in the same order on every rank."""
    return [
        Transfer(w, spec, chunk, r0, r1, reader_rank(chunk.file, world_size), writer)
        for writer, bucket in round_
        for w in bucket
        for spec, chunk, r0, r1 in needed_chunks(w.tensor, w.window)
    ]


@dataclass(frozen=True)
class _Fetch:
    """A gather-path job for the scheduler: one output tensor brought to its writer by one p2p batch."""

    account: int  # the writer: the gathered bytes land in its memory
    nbytes: int
    keys: tuple[Hashable, ...] = (("p2p", torch.uint8),)


def gather_rounds(plan: HfSavePlan, bucket_bytes: int) -> list[list[tuple[int, list[Write]]]]:
    """Pure: the shared scheduler's rounds (`schedule.plan_rounds`) with one budget per writer: round k holds
    the k-th bucket of every writer's stream (each <= bucket_bytes of source bytes, or one larger tensor)."""
    stream = [(rank, w) for rank in range(plan.world_size) for w in plan.writes_of(rank)]
    rounds = plan_rounds([_Fetch(rank, w.src_nbytes) for rank, w in stream], bucket_bytes)
    out = []
    for r in rounds:
        buckets: dict[int, list[Write]] = {}
        for j in r.started:
            rank, w = stream[j]
            buckets.setdefault(rank, []).append(w)
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
            for lo, hi in row_slabs(tr.spec, tr.chunk, tr.r0, tr.r1, bucket_bytes):
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
        outs = {id(w): new_out(w.tensor, w.window) for w in mine}
        for step in split_round(round_transfers(round_, world.size), bucket_bytes):
            for tr, data in _exchange(step, world, source):
                w = tr.write
                view = laid_out(outs[id(w)], w.tensor, w.window)
                for sp in w.tensor.parts:
                    if sp.spec.fqn == tr.spec.fqn:
                        place(view, sp, rows_box(tr.chunk, tr.r0, tr.r1), data, w.window, w.tensor.offset)
        for w in mine:
            yield w, outs.pop(id(w))


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
