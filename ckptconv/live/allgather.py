"""Unshard live DTensors by batched foreach all-gathers (the path `save_hf` uses), on any backend.

Call order (every rank, same arguments but its own tensors): `describe` each tensor, exchange the
descriptions (`World.all_gather_object`), `holdings` -> `live_jobs` (pure) -> `plan_rounds` (pure, shared with
the stored-chunk gather path) -> `run_rounds` -> `emit`, consumed to the end. In each round every rank runs
one foreach all-gather per (process group, dtype) batch, in the same order: every job's piece (padded to the
largest piece of its group, since uneven shards are legal) is gathered and the pieces are laid end to end on
the step's dim (in place when that is dim 0). A job's last step goes only to its readers, the ranks writing
files that read it (`TorchCollective` skips the others on CPU). Tensors stay on their device (gloo on CPU,
nccl on CUDA: the same code); finished blocks are moved to the CPU for writing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from ckptconv.core.dtype_names import short_name
from ckptconv.core.layout import Box, intersect
from ckptconv.core.specs import ChunkSpec, TensorSpec
from ckptconv.errors import CkptconvError
from ckptconv.live.host import to_host
from ckptconv.lora.merge import LoraParts
from ckptconv.mapping.types import whole
from ckptconv.plan.schedule import Holding, Job, Placement, Round, ShardStep, plan_job, shard_steps, slabs
from ckptconv.plan.types import HfSavePlan, OutTensor, SourcePart, Write
from ckptconv.stream.unshard import assemble, narrow, needed_box

Item = tuple[Write, torch.Tensor]


class Collective(Protocol):
    """One foreach all-gather: for every k, `outs[k]` (group size x `inps[k]`'s elements, flat, same dtype)
    receives every member's `inps[k]`, in group-rank order. Where `receivers[k]` names ranks, only those need
    item k (the others pass an empty `outs[k]`); a transport may then skip sending it elsewhere."""

    def all_gather(
        self,
        outs: Sequence[torch.Tensor],
        inps: Sequence[torch.Tensor],
        key: Hashable,
        group: tuple[int, ...],
        receivers: Sequence[tuple[int, ...] | None],
    ) -> None: ...


@dataclass(frozen=True)
class Described:
    """What one rank says about one of its tensors (plain data, exchanged between ranks)."""

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    block: Box
    steps: tuple[ShardStep, ...]
    groups: tuple[tuple[int, ...], ...]  # this rank's group for each step


def describe(fqn: str, tensor: torch.Tensor) -> tuple[Described, list[Any]]:
    """This rank's local block of `tensor` and the process groups of its shard steps (and their handles)."""
    from torch.distributed.tensor import DTensor

    shape = tuple(int(s) for s in tensor.shape)
    if not isinstance(tensor, DTensor):
        return Described(fqn, shape, tensor.dtype, ((0,) * len(shape), shape), (), ()), []
    import torch.distributed as dist
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    chunks = tensor.__create_chunk_list__()
    if len(chunks) != 1:
        raise CkptconvError(f"{fqn!r}: a DTensor whose local data is {len(chunks)} blocks is unsupported")
    block = (tuple(map(int, chunks[0].offsets)), tuple(map(int, chunks[0].sizes)))
    placements = []
    for p in tensor.placements:
        if isinstance(p, Shard | _StridedShard):  # _StridedShard is not a Shard subclass in torch 2.13
            factor = p.split_factor if isinstance(p, _StridedShard) else 1
            placements.append(Placement("shard", int(p.dim) % max(len(shape), 1), int(factor)))
        elif isinstance(p, Replicate):
            placements.append(Placement("replicate"))
        elif p.is_partial():
            placements.append(Placement("partial"))
        else:
            raise CkptconvError(f"{fqn!r}: placement {p} is not one ckptconv knows how to undo")
    mesh = tensor.device_mesh  # a mesh dim of one rank shards nothing: no step (no copy, no collective)
    steps = tuple(s for s in shard_steps(placements) if mesh.size(s.mesh_dim) > 1)
    handles = [mesh.get_group(s.mesh_dim) for s in steps]
    groups = tuple(tuple(dist.get_process_group_ranks(h)) for h in handles)
    return Described(fqn, shape, tensor.dtype, block, steps, groups), handles


def group_handles(described: Sequence[tuple[Described, Sequence[Any]]]) -> dict[tuple[int, ...], Any]:
    """This rank's groups (their ranks) -> a process group handle: the first tensor's with that group, in
    state dict order, so that every member of a group picks the same group object."""
    out: dict[tuple[int, ...], Any] = {}
    for d, handles in described:
        for group, handle in zip(d.groups, handles, strict=True):
            out.setdefault(group, handle)
    return out


def holdings(everyone: Sequence[Sequence[Described]]) -> dict[str, Holding]:
    """Pure: every rank's descriptions (in rank order) -> one Holding per tensor; refuses disagreements."""
    first = everyone[0]
    for rank, descs in enumerate(everyone):
        if [d.fqn for d in descs] != [d.fqn for d in first]:
            raise CkptconvError(
                f"save_hf: rank {rank} holds other tensor keys than rank 0 ({len(descs)} vs {len(first)}); "
                "every rank must pass the same state dict keys (pipeline stages: save each stage's own group)"
            )
    out = {}
    for i, d in enumerate(first):
        views = [rank_descs[i] for rank_descs in everyone]
        for rank, v in enumerate(views):
            if (v.fqn, v.shape, v.dtype, v.steps) != (d.fqn, d.shape, d.dtype, d.steps):
                raise CkptconvError(
                    f"save_hf: {d.fqn!r} is {d.dtype}{list(d.shape)} sharded by {d.steps} on rank 0 but "
                    f"{v.fqn!r} {v.dtype}{list(v.shape)} by {v.steps} on rank {rank}"
                )
        groups = tuple(tuple(v.groups[k] for v in views) for k in range(len(d.steps)))
        for k, group_of in enumerate(groups):
            for rank, group in enumerate(group_of):
                if rank not in group or any(group_of[m] != group for m in group):
                    raise CkptconvError(
                        f"save_hf: the process groups of {d.fqn!r}'s mesh dim {d.steps[k].mesh_dim} do not "
                        "agree between ranks (every rank must hold the tensor on the same mesh)"
                    )
        out[d.fqn] = Holding(d.fqn, d.shape, d.dtype, d.steps, tuple(v.block for v in views), groups)
    return out


def live_jobs(
    plan: HfSavePlan, holding: Mapping[str, Holding], budget: int
) -> tuple[list[Job], list[Write], list[tuple[int, ...]]]:
    """Pure: the jobs that bring the plan's source tensors to every rank, in the order the writers consume
    them; that order (the writers' streams interleaved tensor by tensor, so every writer is busy), with the
    plan's tensors re-pointed at the jobs' blocks (each job block is a "chunk" to `unshard.assemble`); and the
    jobs each of those tensors reads."""
    ranges: dict[str, list[tuple[int, int]]] = {}  # the dim-0 rows each part reads, per source tensor
    for w in plan.writes:
        for sp, window in _reads(w.tensor, w.window):
            rows = ranges.setdefault(sp.spec.fqn, [])
            box = needed_box(sp, window)
            if sp.part.src_sizes and box is not None:
                rows.append((box[0][0], box[0][0] + box[1][0]))
    specs: dict[str, TensorSpec] = {}
    for fqn, rows in ranges.items():
        h = holding[fqn]
        boxes = slabs(h.shape, h.dtype.itemsize, rows, budget)
        chunks = tuple(ChunkSpec(o, s, "", 0, 0, "torch_save") for o, s in boxes)
        specs[fqn] = TensorSpec(fqn, short_name(h.dtype), h.shape, chunks)
    streams = [
        [replace(w, tensor=_repoint(w.tensor, specs)) for w in plan.writes_of(r)]
        for r in range(plan.world_size)
    ]
    depth = max(map(len, streams), default=0)
    order = [stream[k] for k in range(depth) for stream in streams if k < len(stream)]
    index: dict[tuple[str, tuple[int, ...]], int] = {}
    jobs: list[Job] = []
    needs = []
    for w in order:
        mine = []
        for sp, window in _reads(w.tensor, w.window):
            for chunk in _touched(sp, window):
                key = (sp.spec.fqn, chunk.offsets)
                if key not in index:
                    index[key] = len(jobs)
                    jobs.append(plan_job(holding[sp.spec.fqn], (chunk.offsets, chunk.sizes)))
                mine.append(index[key])
        needs.append(tuple(dict.fromkeys(mine)))
    readers: dict[int, set[int]] = {}
    for w, read in zip(order, needs, strict=True):
        for j in read:
            readers.setdefault(j, set()).add(w.rank)
    jobs = [replace(job, readers=tuple(sorted(readers[j]))) for j, job in enumerate(jobs)]
    return jobs, order, needs


def _repoint(t: OutTensor, specs: Mapping[str, TensorSpec]) -> OutTensor:
    parts = tuple(replace(sp, spec=specs[sp.spec.fqn], lora=_lora(sp.lora, specs)) for sp in t.parts)
    return replace(t, parts=parts, lora=_lora(t.lora, specs))


def _lora(lora: LoraParts | None, specs: Mapping[str, TensorSpec]) -> LoraParts | None:
    if lora is None:
        return None
    magnitude = specs[lora.magnitude.fqn] if lora.magnitude is not None else None
    return replace(lora, a=specs[lora.a.fqn], b=specs[lora.b.fqn], magnitude=magnitude)


def _reads(t: OutTensor, window: tuple[int, int] | None) -> list[tuple[SourcePart, tuple[int, int] | None]]:
    """The parts `t` (its rows `window`) reads, with the rows of `t` they serve; a LoRA merge's factors are
    read whole (they are small)."""
    specs = [*(t.lora.specs if t.lora else ()), *(s for sp in t.parts if sp.lora for s in sp.lora.specs)]
    factors = [SourcePart(s, whole(s.fqn, s.shape)) for s in dict.fromkeys(specs)]
    return [(sp, window) for sp in t.parts] + [(sp, None) for sp in factors]


def _touched(sp: SourcePart, window: tuple[int, int] | None) -> list[ChunkSpec]:
    """The job blocks (chunks of the re-pointed spec) that a part reads (for target rows `window`)."""
    box = needed_box(sp, window)
    if box is None:
        return []
    return [c for c in sp.spec.chunks if not c.sizes or intersect((c.offsets, c.sizes), box) is not None]


def run_rounds(
    jobs: Sequence[Job],
    rounds: Sequence[Round],
    rank: int,
    local: Callable[[str], torch.Tensor],
    collective: Collective,
) -> Iterator[tuple[int, torch.Tensor | None]]:
    """Collective: (job index, its gathered block on the CPU) for every job, in the rounds that finish them;
    None for a job whose `readers` do not include this rank (its block was never sent here).

    `local(fqn)`: this rank's local data of a tensor; a batch's collective runs on its first tensor's device.
    """
    held: dict[int, torch.Tensor | None] = {}
    for r in rounds:
        for j in r.started:
            job, mine = jobs[j], jobs[j].start[rank]
            if mine is None:
                held[j] = None
            else:
                relative = [o - b for o, b in zip(mine[0], job.origin[rank], strict=True)]
                held[j] = narrow(local(job.fqn).detach(), relative, mine[1])
        for batch in r.batches:
            device = local(jobs[batch.items[0][0]].fqn).device
            _run_batch(jobs, batch.items, batch.key, rank, held, collective, device)
        for j in r.done:
            value = held.pop(j)
            if not jobs[j].receives(rank):
                yield j, None
            elif value is None:  # an empty block
                yield j, torch.empty(jobs[j].box[1], dtype=jobs[j].dtype)
            else:
                yield j, to_host(value)


def _run_batch(
    jobs: Sequence[Job],
    items: Sequence[tuple[int, int]],
    key: Hashable,
    rank: int,
    held: dict[int, torch.Tensor | None],
    collective: Collective,
    device: torch.device | str,
) -> None:
    """One foreach all-gather of every item's piece, each padded to its group's largest piece. A piece that
    needs no padding is sent as it is, and pieces laid end to end on dim 0 are received straight into the
    gathered tensor: no copy in or out for plain FSDP2 shards."""
    dtype = jobs[items[0][0]].dtype
    group = jobs[items[0][0]].steps[items[0][1]].group_of[rank]
    inps, outs, receivers = [], [], []
    for j, s in items:
        last = s == len(jobs[j].steps) - 1
        receivers.append(jobs[j].readers if last else None)
        n, piece = jobs[j].steps[s].padded_numel(rank), held[j]
        if piece is not None and piece.is_contiguous() and piece.numel() == n:
            inps.append(piece.reshape(-1))
        else:
            inp = _empty(n, dtype, device, zeros=True)  # zeros: the padding bytes are deterministic
            if piece is not None:
                inp[: piece.numel()].view(piece.shape).copy_(piece)
            inps.append(inp)
        wanted = receivers[-1] is None or rank in receivers[-1]
        outs.append(_empty(len(group) * n if wanted else 0, dtype, device))
    collective.all_gather(outs, inps, key, group, receivers)
    for (j, s), inp, out, who in zip(items, inps, outs, receivers, strict=True):
        step, n = jobs[j].steps[s], inp.numel()
        boxes = [step.pieces[m] for m in group]
        result = step.result[rank]
        if result is None or (who is not None and rank not in who):
            held[j] = None
        elif step.dim == 0 and all(b is not None and math.prod(b[1]) == n for b in boxes):
            held[j] = out.view(result[1])  # member after member is the concatenation on dim 0
        else:
            pieces = [out[i * n : i * n + math.prod(b[1])].view(b[1]) for i, b in enumerate(boxes) if b]
            held[j] = torch.cat(pieces, dim=step.dim)


def _empty(n: int, dtype: torch.dtype, device: torch.device | str, zeros: bool = False) -> torch.Tensor:
    """`n` elements of `dtype` (fp8 and bool included) allocated as bytes."""
    new = torch.zeros if zeros else torch.empty
    return new(n * dtype.itemsize, dtype=torch.uint8, device=device).view(dtype)


class TorchCollective:
    """`Collective` over torch.distributed, with this rank's process group handle for each of its groups
    (`group_handles`). On accelerators, `all_gather_single` (nccl's native all-gather). On CPU the same
    all-gather is one batch of point-to-point sends and receives, each member's piece to every other member
    that needs the result: gloo moves those about 4x faster than its own all-gather on this machine (2.0 vs
    0.5 GB/s), and a file's tensors then cross the network once, to the rank writing the file."""

    def __init__(self, handles: Mapping[tuple[int, ...], Any]) -> None:
        self.handles = handles

    def all_gather(
        self,
        outs: Sequence[torch.Tensor],
        inps: Sequence[torch.Tensor],
        key: Hashable,
        group: tuple[int, ...],
        receivers: Sequence[tuple[int, ...] | None],
    ) -> None:
        import torch.distributed as dist

        handle = self.handles[group]
        outs = [o.view(torch.uint8) for o in outs]  # as bytes: any dtype moves (bool, fp8, bf16 on gloo)
        inps = [i.view(torch.uint8) for i in inps]
        if inps and inps[0].device.type != "cpu":  # one flat buffer, one native all-gather (FSDP2's foreach)
            flat = torch.cat(inps)
            gathered = torch.empty(len(group) * flat.numel(), dtype=torch.uint8, device=flat.device)
            # torch 2.13 renamed all_gather_into_tensor (kept, deprecated); pyproject admits torch >= 2.6
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            gather(gathered, flat, group=handle)
            member = gathered.view(len(group), flat.numel())
            offset = 0
            for inp, out in zip(inps, outs, strict=True):
                if out.numel():
                    out.view(len(group), inp.numel()).copy_(member[:, offset : offset + inp.numel()])
                offset += inp.numel()
            return
        me = dist.get_rank()
        ops = []
        for inp, out, who in zip(inps, outs, receivers, strict=True):
            n = inp.numel()
            for i, peer in enumerate(group):
                if peer == me:
                    if out.numel():
                        out[i * n : (i + 1) * n].copy_(inp)
                elif n:  # only to the members that need the result
                    if who is None or peer in who:
                        ops.append(dist.P2POp(dist.isend, inp, peer, handle))
                    if who is None or me in who:
                        ops.append(dist.P2POp(dist.irecv, out[i * n : (i + 1) * n], peer, handle))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()


def emit(
    order: Sequence[Write],
    needs: Sequence[tuple[int, ...]],
    rank: int,
    results: Iterator[tuple[int, torch.Tensor | None]],
    jobs: Sequence[Job],
) -> Iterator[Item]:
    """This rank's output tensors in file order, each assembled as soon as the jobs it reads are done; a
    gathered block is dropped once the last of this rank's tensors reading it is out (at once if none)."""
    mine = [i for i, w in enumerate(order) if w.rank == rank]
    last_use: dict[int, int] = {}
    for n, i in enumerate(mine):
        for j in needs[i]:
            last_use[j] = n
    by_chunk = {(job.fqn, job.box[0]): j for j, job in enumerate(jobs)}
    got: dict[int, torch.Tensor] = {}

    def rows(spec: TensorSpec, chunk: ChunkSpec, r0: int, r1: int) -> torch.Tensor:
        data = got[by_chunk[(spec.fqn, chunk.offsets)]]
        return data.narrow(0, r0, r1 - r0) if chunk.sizes else data

    k = 0
    for j, value in results:
        if j in last_use:
            assert value is not None, "a job this rank reads was not sent to it"
            got[j] = value
        while k < len(mine) and all(x in got for x in needs[mine[k]]):
            w = order[mine[k]]
            yield w, assemble(w.tensor, rows, window=w.window)
            for x in needs[mine[k]]:
                if last_use[x] == k:
                    del got[x]
            k += 1
    if k != len(mine):
        raise AssertionError(f"unshard: {len(mine) - k} tensors never became ready")
